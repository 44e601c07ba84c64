"""``fcprag labels build``: labels vs an independent peft computation, resume, per-record errors, merge checks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from fcprag_tools.cli import main
from fcprag_plugin.errors import FcpragError, LabelFileError
from fcprag_tools.label_builder.builder import BuildOptions, LabelBuilder, build_labels
from fcprag_tools.label_builder.errors import LabelBuildError
from fcprag_tools.label_builder.manifest import read_manifest
from fcprag_tools.lm.metrics import exact_match, extract_answer, f1_score
from fcprag_tools.lm.prompts import PromptTemplate, answer_ids, render_prompt
from fcprag_tools.label_builder.parts import merge_parts
from helpers import assert_bit_identical, make_adapter_dir, read_jsonl, save_tiny_lm, state_snapshot

MAX_NEW = 4
PASSAGES = ["Paris is the capital of France.", "Rome is the capital of Italy.", "Berlin is in Germany."]


def _write_manifest(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A saved tiny LM + tokenizer, three real PEFT adapters, and a 4-record manifest (N = 3, 1, 2, 3)."""
    root = tmp_path_factory.mktemp("labels")
    model_dir = save_tiny_lm(root / "lm", seed=0)
    ads = [make_adapter_dir(root / "adapters" / f"passage_{i}", seed=i) for i in range(3)]
    recs = [
        {"id": "q0", "question": "What is the capital of France?", "answer": ["Paris", "paris city"],
         "passages": PASSAGES, "adapters": [str(a) for a in ads], "group": "g0"},
        {"id": "q1", "question": "Who wrote the book?", "answer": "the king",
         "passages": PASSAGES[1:2], "adapters": [str(ads[1])]},
        {"id": "q2", "question": "Which river is in Paris?", "answer": "seine",
         "passages": PASSAGES[:2], "adapters": ["adapters/passage_2", "adapters/passage_0"]},  # relative paths
        {"id": "q3", "question": "When was the tower born?", "answer": ["one year", "1"],
         "passages": PASSAGES[::-1], "adapters": [str(a) for a in ads[::-1]]},
    ]
    manifest = _write_manifest(root / "manifest.jsonl", recs)
    return {"root": root, "model": model_dir, "adapters": ads, "manifest": manifest, "records": recs}


def _build(world, out, *extra: str) -> int:
    return main(["labels", "build", str(world["manifest"]), "--model", str(world["model"]), "--out", str(out),
                 "--max-new-tokens", str(MAX_NEW), "--empty-generation", "zero", "--no-progress", *extra])


# ----------------------------------------------------------------------------- independent reference
def _reference(model_dir: Path, rec, mode: str) -> list[dict]:
    """Per subset (all, then each left out): peft's own ``add_weighted_adapter(..., "cat")`` on a PeftModel,
    answer log-prob as minus HF's masked cross-entropy, greedy generation through peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    pm = PeftModel.from_pretrained(base, str(rec.adapters[0]), adapter_name="p0")
    for i, path in enumerate(rec.adapters[1:], start=1):
        pm.load_adapter(str(path), adapter_name=f"p{i}")
    pm.eval()
    prompt = render_prompt(tok, PromptTemplate(), rec.question, rec.passages if mode == "combine" else None, mode)

    def score() -> dict:
        lps = []
        for ans in rec.answers:
            a = answer_ids(tok, prompt, ans)
            ids = torch.tensor([prompt.ids + a])
            labels = torch.tensor([[-100] * len(prompt.ids) + a])
            with torch.no_grad():
                lps.append(-float(pm(input_ids=ids, labels=labels).loss))
        with torch.no_grad():
            out = pm.generate(input_ids=torch.tensor([prompt.ids]), attention_mask=torch.ones(1, len(prompt.ids),
                              dtype=torch.long), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        gen = tok.decode(out[0, len(prompt.ids):], skip_special_tokens=True)
        return {"lp": max(lps), "gen": gen}

    n = rec.n
    subsets = [list(range(n))] + [[j for j in range(n) if j != i] for i in range(n)]
    results = []
    for k, subset in enumerate(subsets):
        if subset:
            name = f"s{k}"
            pm.add_weighted_adapter([f"p{i}" for i in subset], [1.0] * len(subset), name, combination_type="cat")
            pm.set_adapter(name)
            results.append(score())
        else:
            with pm.disable_adapter():
                results.append(score())
    return results


@pytest.mark.parametrize("mode", ["param", "combine"])
def test_labels_equal_independent_peft_cat_computation(world, tmp_path, mode):
    out = tmp_path / "labels.jsonl"
    assert _build(world, out, "--prompt-mode", mode) == 0
    got = {r["id"]: r for r in read_jsonl(out)}
    records = read_manifest(world["manifest"])
    assert [r["id"] for r in read_jsonl(out)] == [r.id for r in records]
    for rec in records[:2]:  # N = 3 and N = 1 (the empty set = the base model)
        lab = got[rec.id]
        ref = _reference(world["model"], rec, mode)
        assert lab["metric"] == "answer_logprob" and lab["query"] == rec.question and lab["passages"] == rec.passages
        assert len(lab["metric_without"]) == rec.n
        assert lab["metric_all"] == pytest.approx(ref[0]["lp"], abs=1e-4)
        assert lab["metric_without"] == pytest.approx([r["lp"] for r in ref[1:]], abs=1e-4)
        assert lab["generation_all"] == ref[0]["gen"]
        assert lab["generation_without"] == [r["gen"] for r in ref[1:]]
        preds = [extract_answer(r["gen"]) for r in ref]
        assert lab["f1_all"] == f1_score(preds[0], rec.answers)
        assert lab["em_without"] == [exact_match(p, rec.answers) for p in preds[1:]]
        # the deltas are not all zero: leaving an adapter out changes the model
        assert any(abs(lab["metric_all"] - w) > 1e-6 for w in lab["metric_without"])
    assert got["q0"]["group"] == "g0" and got["q0"]["prompt_mode"] == mode


def test_use_slot_gives_the_same_labels(world, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert _build(world, a) == 0
    assert _build(world, b, "--use-slot") == 0
    for x, y in zip(read_jsonl(a), read_jsonl(b)):
        assert x["id"] == y["id"]
        assert x["metric_all"] == pytest.approx(y["metric_all"], abs=1e-5)
        assert x["metric_without"] == pytest.approx(y["metric_without"], abs=1e-5)
        assert x["generation_without"] == y["generation_without"]


def test_builder_never_touches_base_weights(world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(world["model"])).eval()
    tok = AutoTokenizer.from_pretrained(str(world["model"]))
    snap = state_snapshot(model)
    for use_slot in (False, True):
        builder = LabelBuilder(model, tok, BuildOptions(max_new_tokens=2, empty_generation="zero", use_slot=use_slot))
        s = build_labels(read_manifest(world["manifest"])[:2], builder, tmp_path / f"o{use_slot}.jsonl",
                         progress=False)
        builder.close()
        assert s.written == 2
        assert_bit_identical(model, snap)
        assert not any(m._forward_hooks for m in model.modules())


# ----------------------------------------------------------------------------- resume
def test_resume_after_interruption_no_duplicates_identical_labels(world, tmp_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(world["model"])).eval()
    tok = AutoTokenizer.from_pretrained(str(world["model"]))
    records = read_manifest(world["manifest"])
    opts = BuildOptions(max_new_tokens=MAX_NEW, empty_generation="zero")
    full = tmp_path / "full.jsonl"
    build_labels(records, LabelBuilder(model, tok, opts), full, progress=False)

    # A run stopped after 2 records (the 3rd raises KeyboardInterrupt), then a crash in the middle of a write.
    builder = LabelBuilder(model, tok, opts)
    calls = {"n": 0}
    real = builder.label

    def stopping(rec):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(rec)

    builder.label = stopping
    out = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        build_labels(records, builder, out, progress=False)
    assert [r["id"] for r in read_jsonl(out)] == ["q0", "q1"]
    third = full.read_text(encoding="utf-8").splitlines()[2]
    with out.open("a", encoding="utf-8") as f:
        f.write(third[: len(third) // 2])  # a partial last line, no newline

    resumed = LabelBuilder(model, tok, opts)
    labelled = []
    orig = resumed.label
    resumed.label = lambda rec: (labelled.append(rec.id), orig(rec))[1]
    with caplog.at_level(logging.WARNING, logger="fcprag_plugin"):
        s = build_labels(records, resumed, out, progress=False)
    assert "dropping a partial last line" in caplog.text
    assert labelled == ["q2", "q3"] and s.already_done == 2 and s.written == 2
    assert out.read_text(encoding="utf-8") == full.read_text(encoding="utf-8")  # byte-identical, no duplicates
    # A third run has nothing to do.
    s = build_labels(records, resumed, out, progress=False)
    assert s.written == 0 and s.already_done == 4


def test_resume_via_cli_keeps_lines(world, tmp_path):
    out = tmp_path / "labels.jsonl"
    assert _build(world, out, "--no-generation") == 0
    before = out.read_text(encoding="utf-8")
    lines = before.splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:10], encoding="utf-8")  # crash while writing the last record
    assert _build(world, out, "--no-generation") == 0
    assert out.read_text(encoding="utf-8") == before
    rec = read_jsonl(out)[0]
    assert "f1_all" not in rec and "answer_logprob_without" in rec


# ----------------------------------------------------------------------------- per-record errors
def _corrupt_adapter(path: Path) -> Path:
    make_adapter_dir(path, seed=9)
    (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    return path


def test_adapter_that_fails_to_load_names_record_and_path(world, tmp_path, capsys):
    bad = _corrupt_adapter(tmp_path / "bad_adapter")
    recs = [dict(world["records"][1]), dict(world["records"][0], id="qbad", adapters=[str(world["adapters"][0]), str(bad),
                                                                                      str(world["adapters"][2])]),
            dict(world["records"][3])]
    recs[0]["adapters"] = [str(world["adapters"][1])]
    manifest = _write_manifest(tmp_path / "m.jsonl", recs)
    out = tmp_path / "labels.jsonl"
    args = ["labels", "build", str(manifest), "--model", str(world["model"]), "--out", str(out), "--no-generation",
            "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "record 'qbad'" in err and str(bad) in err and "adapter 1" in err and "failed to load" in err
    assert [r["id"] for r in read_jsonl(out)] == ["q1"]  # the record before it was kept; no fake label for qbad

    assert main(args + ["--on-error", "skip"]) == 1  # skipped records make the exit status 1
    captured = capsys.readouterr()
    assert "failed qbad" in captured.err and "1 failed" in captured.out
    assert [r["id"] for r in read_jsonl(out)] == ["q1", "q3"]

    make_adapter_dir(bad, seed=9)  # repaired: a re-run fills in the missing record only
    assert main(args) == 0
    assert sorted(r["id"] for r in read_jsonl(out)) == ["q1", "q3", "qbad"]


def test_empty_generation_is_a_record_error_or_zero(tmp_path, capsys):
    model_dir = save_tiny_lm(tmp_path / "lm0", seed=0, zero_lm_head=True)  # greedy always emits [PAD]
    ad = make_adapter_dir(tmp_path / "a0", seed=0)
    manifest = _write_manifest(tmp_path / "m.jsonl", [
        {"id": "e1", "question": "Who is the king?", "answer": "the king", "passages": ["x"], "adapters": [str(ad)]}])
    out = tmp_path / "labels.jsonl"
    args = ["labels", "build", str(manifest), "--model", str(model_dir), "--out", str(out), "--max-new-tokens", "2",
            "--no-progress"]
    for extra in (["--empty-generation", "fail"], ["--metric", "f1"]):  # the default fails where f1 is the label
        assert main(args + extra) == 2
        err = capsys.readouterr().err
        assert "record 'e1'" in err and "empty generation with all 1 adapters" in err
        assert not out.exists() or out.read_text() == ""
    # the default with the answer_logprob label: the generation is an extra, an empty one scores 0 and is counted
    assert main(args) == 0
    default = out.read_text()
    assert json.loads(default)["metric"] == "answer_logprob"
    out.unlink()
    assert main(args + ["--empty-generation", "zero"]) == 0
    assert out.read_text() == default
    (rec,) = read_jsonl(out)
    assert rec["f1_all"] == 0.0 and rec["f1_without"] == [0.0] and rec["empty_generations"] == 2
    assert rec["prediction_all"] == ""


def test_adapter_incompatible_with_model_names_record_and_subset(world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fcprag_plugin.adapter import LoraAdapter, LoraModule

    # an adapter for a wider model: gate_proj [48, 16] instead of [48, 32]
    wide = LoraAdapter({"model.layers.0.mlp.gate_proj": LoraModule(torch.randn(2, 16), torch.randn(48, 2), 2.0)},
                       {"r": 2, "lora_alpha": 4}).save_pretrained(tmp_path / "wide")
    model = AutoModelForCausalLM.from_pretrained(str(world["model"])).eval()
    tok = AutoTokenizer.from_pretrained(str(world["model"]))
    rec = read_manifest(_write_manifest(tmp_path / "m.jsonl", [
        {"id": "w1", "question": "Who?", "answer": "king", "passages": ["a", "b"],
         "adapters": [str(world["adapters"][0]), str(wide)]}]))[0]
    with pytest.raises(LabelBuildError, match=r"record 'w1' .*m\.jsonl:1.*all 2 adapters"):
        LabelBuilder(model, tok, BuildOptions(generate=False)).label(rec)


def test_option_errors():
    with pytest.raises(FcpragError, match="metric 'f1' needs the greedy generation"):
        BuildOptions(metric="f1", generate=False).validate()
    with pytest.raises(FcpragError, match="metric 'bleu'"):
        BuildOptions(metric="bleu").validate()
    with pytest.raises(FcpragError, match="prompt mode 'ctx'"):
        BuildOptions(prompt_mode="ctx").validate()


def test_metric_f1_is_the_label(world, tmp_path):
    out = tmp_path / "f1.jsonl"
    assert _build(world, out, "--metric", "f1") == 0
    for r in read_jsonl(out):
        assert r["metric"] == "f1" and r["metric_all"] == r["f1_all"] and r["metric_without"] == r["f1_without"]


# ----------------------------------------------------------------------------- merge validation
def _labels_line(rid: str, n: int) -> str:
    return json.dumps({"id": rid, "query": "q", "passages": ["p"] * n, "metric_all": 0.0,
                       "metric_without": [0.0] * n}) + "\n"


def test_merge_orders_by_manifest_and_reports_culprits(world, tmp_path):
    records = read_manifest(world["manifest"])  # ids q0..q3 with N = 3, 1, 2, 3
    p0, p1 = tmp_path / "x.part0-of2.jsonl", tmp_path / "x.part1-of2.jsonl"
    p0.write_text(_labels_line("q2", 2) + _labels_line("q0", 3))
    p1.write_text(_labels_line("q3", 3) + _labels_line("q1", 1))
    out = tmp_path / "x.jsonl"
    s = merge_parts([p0, p1], records, out)
    assert s.written == 4 and [r["id"] for r in read_jsonl(out)] == ["q0", "q1", "q2", "q3"]

    p1.write_text(_labels_line("q3", 3) + _labels_line("q0", 3))
    with pytest.raises(LabelFileError, match=r"x\.part1-of2\.jsonl:2: field 'id': duplicate id 'q0' "
                                             r"\(also at .*x\.part0-of2\.jsonl:2\)"):
        merge_parts([p0, p1], records, out)
    # a re-run of an auto-merge sees its parts again next to the merged file: identical lines are accepted
    assert merge_parts([out, p0, p1], records, out, allow_identical_duplicates=True).written == 4
    assert [r["id"] for r in read_jsonl(out)] == ["q0", "q1", "q2", "q3"]
    p1.write_text(_labels_line("q3", 3).replace("0.0,", "0.5,", 1) + _labels_line("q1", 1))
    with pytest.raises(LabelFileError, match=r"x\.part1-of2\.jsonl:1: field 'id': duplicate id 'q3' \(also at .*x\.jsonl:4\)"):
        merge_parts([out, p0, p1], records, out, allow_identical_duplicates=True)
    p1.write_text(_labels_line("zz", 1))
    with pytest.raises(LabelFileError, match=r"x\.part1-of2\.jsonl:1: field 'id': 'zz' is not in the manifest"):
        merge_parts([p0, p1], records, out)
    p1.write_text(_labels_line("q3", 3))
    with pytest.raises(LabelFileError, match=r"1 manifest ids have no labels in the given parts: q1"):
        merge_parts([p0, p1], records, out)
    assert merge_parts([p0, p1], records, out, allow_missing=True).missing == ["q1"]
    p1.write_text(_labels_line("q3", 2))
    with pytest.raises(LabelFileError, match=r"x\.part1-of2\.jsonl:1: field 'metric_without': expected a list of 3"):
        merge_parts([p0, p1], records, out)
    p1.write_text(_labels_line("q3", 3) + _labels_line("q1", 1)[:12])
    with pytest.raises(LabelFileError, match=r"x\.part1-of2\.jsonl:2: the last line is incomplete"):
        merge_parts([p0, p1], records, out)
    p1.write_text("{oops\n")
    with pytest.raises(LabelFileError, match=r"x\.part1-of2\.jsonl:1: not valid JSON"):
        merge_parts([p0, p1], records, out)


def test_merge_cli(world, tmp_path, capsys):
    p0 = tmp_path / "y.part0-of1.jsonl"
    p0.write_text("".join(_labels_line(r, n) for r, n in (("q3", 3), ("q2", 2), ("q1", 1), ("q0", 3))))
    out = tmp_path / "y.jsonl"
    assert main(["labels", "merge", str(p0), "--manifest", str(world["manifest"]), "--out", str(out)]) == 0
    assert "merged 4 records" in capsys.readouterr().out
    assert [r["id"] for r in read_jsonl(out)] == ["q0", "q1", "q2", "q3"]
    assert main(["labels", "merge", str(tmp_path / "nope.jsonl"), "--manifest", str(world["manifest"]),
                 "--out", str(out)]) == 2
    assert "nope.jsonl: part file not found" in capsys.readouterr().err
