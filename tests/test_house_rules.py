"""The house rules of docs/layout.md, checked on the source: the library's size and floors, no import of the
tooling or of the shims from the core, no file over 450 lines, function over 80 or class over 250 in src/, one
append-mode open and one import of tqdm in src/, and a tracked tree a device call can carry beside the model (at
most 12 MiB). (No dataclass of the study over 12 fields: tests/tools/study/test_options.py.)"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC, LIB = ROOT / "src", ROOT / "src" / "fcprag_plugin"
LIBRARY_LINES = 6_600  # docs/layout.md says why this number and how it changes
MAX_FLOORS, MAX_FILE, MAX_FUNCTION, MAX_CLASS, TREE_BYTES = 6, 450, 80, 250, 12 * 2**20


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _imported(path: Path) -> set[str]:
    """The dotted modules ``path`` imports (relative imports resolved; ``from X import name`` gives ``X.name``)."""
    package = ".".join(path.relative_to(SRC).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _room(module: str) -> str | None:
    """The library room a module is in: a top-level file or folder of fcprag_plugin (None: outside it)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "fcprag_plugin" and len(parts) > 1 else None


def test_the_library_stays_within_its_line_budget():
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in _files(LIB))
    assert lines <= LIBRARY_LINES, f"src/fcprag_plugin is {lines} lines, over its budget of {LIBRARY_LINES}"


def test_the_library_stands_on_at_most_six_floors_without_a_circle_or_the_tooling():
    arrows: dict[str, set[str]] = {}
    for p in _files(LIB):
        if p == LIB / "__init__.py":  # the package's face hands names on
            continue
        mods = _imported(p)
        assert not any(m.split(".")[0] == "fcprag_tools" for m in mods), f"{p} imports the tooling"
        room = _room(".".join(p.relative_to(SRC).with_suffix("").parts))
        if room != "hosts":
            assert not any(_room(m) == "hosts" for m in mods), f"{p}: the core imports the shims"
        arrows.setdefault(room, set()).update(r for m in mods if (r := _room(m)) not in (None, room))
    floors: dict[str, int] = {}

    def floor(room: str, path: tuple[str, ...] = ()) -> int:
        assert room not in path, f"import circle: {' -> '.join(path + (room,))}"
        if room not in floors:
            floors[room] = 1 + max((floor(r, path + (room,)) for r in arrows.get(room, ())), default=0)
        return floors[room]

    assert max(floor(r) for r in arrows) <= MAX_FLOORS, floors


def test_no_long_function_or_class_and_one_append_mode_open_in_src():
    too_long, appends = [], []
    for p in _files(SRC):
        for node in ast.walk(_tree(p)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                size, limit = node.end_lineno - node.lineno + 1, MAX_CLASS if isinstance(node, ast.ClassDef) \
                    else MAX_FUNCTION
                if size > limit:
                    too_long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({size} lines > {limit})")
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "open":
                given = [*node.args, *(k.value for k in node.keywords if k.arg == "mode")]
                modes = [a.value for a in given if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if any(re.fullmatch(r"[rwxabt+]{1,3}", m) and "a" in m for m in modes):
                    appends.append(f"{p.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Attribute) and node.attr == "O_APPEND":  # os.open(..., os.O_APPEND)
                appends.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not too_long, too_long
    assert len(appends) <= 1, f"append-mode opens (one JSON Lines appender: fcprag_plugin.fileio): {appends}"


def test_no_file_in_src_over_450_lines():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _files(SRC)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE]
    assert not long, f"files over {MAX_FILE} lines: {long}"


def test_tqdm_is_imported_by_one_file_in_src():
    importers = [str(p.relative_to(ROOT)) for p in _files(SRC) if any(m.split(".")[0] == "tqdm" for m in _imported(p))]
    assert len(importers) <= 1, f"tqdm imported by {importers} (progress bars: fcprag_plugin/progress.py)"


def test_the_tracked_tree_fits_a_device_call_beside_the_model():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked tree is unknown")
    files = [ROOT / f for f in listed.decode().split("\0") if f]
    size = sum(f.stat().st_size for f in files if f.is_file())
    assert size <= TREE_BYTES, f"the tracked tree is {size / 2**20:.1f} MiB, over {TREE_BYTES / 2**20:.0f} MiB"
