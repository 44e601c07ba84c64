"""Loading the model for ``fcprag labels build``: a missing local path is one clear line, and ``--no-progress`` is
quiet while the model loads (transformers' own bars included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fcprag_tools.cli import main
from fcprag_tools.lm.model_io import check_model_path, load_model, looks_like_path
from helpers import make_adapter_dir, save_tiny_lm

SRC = str(Path(__file__).resolve().parents[3] / "src")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_io")
    model = save_tiny_lm(root / "lm", seed=0)
    ad = make_adapter_dir(root / "p0", seed=0)
    manifest = root / "manifest.jsonl"
    manifest.write_text(json.dumps({"id": "q0", "question": "Who is the king?", "answer": "the king",
                                    "passages": ["x"], "adapters": [str(ad)]}) + "\n", encoding="utf-8")
    return {"model": model, "manifest": manifest}


def test_looks_like_path():
    for path in ["/models/x", "./x", "../x", "~/x", "~", ".", "..", "a/b/c", "org/name/", "x/"]:
        assert looks_like_path(path), path
    for name in ["gpt2", "meta-llama/Llama-3.2-1B-Instruct", "org/name", "x.y"]:  # hub names
        assert not looks_like_path(name), name


def test_check_model_path_expands_home(world, monkeypatch):
    monkeypatch.setenv("HOME", str(world["model"].parent))
    assert check_model_path("--model", "~/lm") == str(world["model"])
    assert check_model_path("--model", "org/name") == "org/name"  # a hub name is left to transformers


def _run(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("option", ["--model", "--tokenizer"])
@pytest.mark.parametrize("kind", ["absolute", "./", "../", "~", "nested"])
def test_missing_model_path_is_one_line(world, tmp_path, capsys, monkeypatch, option, kind):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    missing = {"absolute": str(tmp_path / "no-model"), "./": "./no-model", "../": "../no-model-here",
               "~": "~/no-model", "nested": "models/org/no-model"}[kind]
    model = missing if option == "--model" else str(world["model"])
    out = tmp_path / "o.jsonl"
    argv = ["labels", "build", str(world["manifest"]), "--model", model, "--out", str(out), "--no-progress"]
    if option == "--tokenizer":
        argv += ["--tokenizer", missing]
    rc, err = _run(argv, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (f"fcprag labels build: error: {option} {missing}: no such file or directory; expected a "
                        "local model folder or a hub name")
    assert not out.exists()


def test_no_progress_loads_quietly_and_restores_the_bars(world, capsys):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    capsys.readouterr()
    load_model(str(world["model"]), device="cpu")
    loud = capsys.readouterr().err
    load_model(str(world["model"]), device="cpu", progress=False)
    assert capsys.readouterr().err == ""
    assert (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()) == before
    if before[0] and "Loading weights" not in loud:  # transformers < 5 shows no bar while loading
        pytest.skip("this transformers shows no progress bar while loading a model, so quiet proves nothing")
    assert before[0] and "Loading weights" in loud


@pytest.mark.slow
def test_build_no_progress_writes_nothing_to_stderr(world, tmp_path):
    """Load, label and write with --no-progress: stderr stays empty. transformers' log messages are set to errors
    only (4.44 logs a deprecation from the forward pass); its progress bars do not follow that setting."""
    out = tmp_path / "o.jsonl"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-m", "fcprag_tools.cli", "labels", "build", str(world["manifest"]),
                           "--model", str(world["model"]), "--out", str(out), "--max-new-tokens", "2",
                           "--empty-generation", "zero", "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "1 written" in proc.stdout and out.exists()


def test_dtype_auto_is_float32_on_a_cpu_and_bfloat16_on_cuda():
    import torch

    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.lm.model_io import dtype_name, resolve_dtype

    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", torch.device("cuda:1")) is torch.bfloat16  # no GPU needed: the rule alone
    assert resolve_dtype("auto", "meta") is torch.float32  # any other device: float32
    assert resolve_dtype("fp16", "cpu") is torch.float16 and resolve_dtype("bfloat16", "cuda") is torch.bfloat16
    assert dtype_name(resolve_dtype("bf16", "cpu")) == "bfloat16"
    with pytest.raises(FcpragError, match="--dtype 'half': expected one of"):
        resolve_dtype("half", "cpu")


def test_dtype_auto_loads_a_bfloat16_checkpoint_in_float32_on_a_cpu(tmp_path):
    """The rule, not the stack's default (transformers 5 would keep the checkpoint's bfloat16)."""
    import torch

    from helpers import tiny_model, tiny_tokenizer

    tiny_model().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tiny_tokenizer().save_pretrained(tmp_path / "bf16")
    model, _ = load_model(str(tmp_path / "bf16"), device="cpu", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model, _ = load_model(str(tmp_path / "bf16"), device="cpu", dtype="bfloat16", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_labels_and_study_share_the_model_flags():
    from helpers import cli_leaves, options

    flags = ("--model", "--gguf-file", "--dtype", "--device")
    seen = {words: {a.option_strings[0]: (a.help, a.default) for a in options(p) if a.option_strings and a.option_strings[0] in flags}
            for words, p in cli_leaves() if words in (("labels", "build"), ("study",))}
    build, study = seen[("labels", "build")], seen[("study",)]
    assert set(build) == set(study) == set(flags)
    assert all(build[f] == study[f] for f in flags[1:])  # --model differs only in being optional for the study
    assert "float32 on a CPU, bfloat16 on CUDA" in study["--dtype"][0]
