"""Batched leave-one-out labels (``--batch-size > 1``) equal the sequential path (``--batch-size 1``)."""

from __future__ import annotations

import json

import pytest
import torch

from fcprag_tools.cli import main
from fcprag_tools.lm.batched import batched_answer_logprobs, batched_greedy
from fcprag_tools.label_builder.builder import BuildOptions, LabelBuilder, build_labels
from fcprag_tools.label_builder.manifest import read_manifest
from fcprag_tools.lm.metrics import answer_logprob, greedy_generate
from helpers import assert_bit_identical, make_adapter_dir, read_jsonl, save_tiny_lm, state_snapshot

QUESTIONS = ["What is the capital of France?", "Who wrote the book?", "Which river is in Paris?",
             "When was the tower born?", "Where is the king?", "Which war was first?"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny LM, 4 adapters (ranks 2 and 4), 6 records with N = 3, 1, 2, 4, 3, 1 and one or two gold aliases."""
    root = tmp_path_factory.mktemp("batched")
    model_dir = save_tiny_lm(root / "lm", seed=0)
    ads = [make_adapter_dir(root / f"p{i}", seed=10 + i, r=2 if i % 2 == 0 else 4) for i in range(4)]
    ns = [3, 1, 2, 4, 3, 1]
    answers = [["paris", "paris city"], "the king", "seine", ["one year", "1"], "tower", ["war", "peace"]]
    recs = [{"id": f"r{i}", "question": q, "answer": answers[i], "passages": [f"passage {j}" for j in range(ns[i])],
             "adapters": [str(ads[(i + j) % 4]) for j in range(ns[i])]} for i, q in enumerate(QUESTIONS)]
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return {"model": model_dir, "manifest": manifest, "adapters": ads}


def _load(world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(str(world["model"])).eval(),
            AutoTokenizer.from_pretrained(str(world["model"])))


def _assert_same_labels(seq: list[dict], bat: list[dict]) -> None:
    assert [r["id"] for r in seq] == [r["id"] for r in bat]
    for x, y in zip(seq, bat):
        assert set(x) == set(y)
        for k in x:
            if k.startswith("answer_logprob") or k.startswith("metric_") and x["metric"] == "answer_logprob":
                assert y[k] == pytest.approx(x[k], abs=1e-5), (x["id"], k)
            else:  # greedy texts, predictions, f1 / em and everything else: identical
                assert y[k] == x[k], (x["id"], k)


def test_batched_scorers_equal_one_row_at_a_time(world):
    model, tok = _load(world)
    prompts = [tok(q)["input_ids"] for q in QUESTIONS]
    answers = [tok(a, add_special_tokens=False)["input_ids"] for a in ["paris", "the king born", "seine", "1 2 3"]]
    rows = [(p, a) for p in prompts[:3] for a in answers]  # prompts of 7-9 tokens, answers of 1-3: real padding
    assert len({len(p) + len(a) for p, a in rows}) > 2
    got = batched_answer_logprobs(model, rows, tok.pad_token_id)
    want = [answer_logprob(model, p, a) for p, a in rows]
    assert got == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 0.1  # the rows differ, so a mix-up of rows would show
    texts = batched_greedy(model, tok, prompts, 6)
    assert texts == [greedy_generate(model, tok, p, 6) for p in prompts]


@pytest.mark.parametrize("batch_size", [2, 5, 64])  # records split over forwards, a few records each, all at once
def test_batched_labels_equal_sequential(world, tmp_path, batch_size):
    common = ["labels", "build", str(world["manifest"]), "--model", str(world["model"]), "--max-new-tokens", "5",
              "--empty-generation", "zero", "--no-progress"]
    seq, bat = tmp_path / "seq.jsonl", tmp_path / "bat.jsonl"
    assert main(common + ["--out", str(seq), "--batch-size", "1"]) == 0
    assert main(common + ["--out", str(bat), "--batch-size", str(batch_size)]) == 0
    s, b = read_jsonl(seq), read_jsonl(bat)
    _assert_same_labels(s, b)
    # the labels are not degenerate: adapters move the log-prob, and some greedy texts differ between subsets
    assert any(abs(r["metric_all"] - w) > 1e-4 for r in s for w in r["metric_without"])
    assert any(len({r["generation_all"], *r["generation_without"]}) > 1 for r in s)


def test_batched_f1_metric_and_no_generation(world, tmp_path):
    model, tok = _load(world)
    records = read_manifest(world["manifest"])
    for extra in ({"metric": "f1"}, {"generate": False}, {"cot": True}):
        outs = []
        for bs in (1, 7):
            out = tmp_path / f"{sorted(extra)[0]}{bs}.jsonl"
            opts = BuildOptions(max_new_tokens=4, empty_generation="zero", batch_size=bs, **extra)
            build_labels(records, LabelBuilder(model, tok, opts), out, progress=False)
            outs.append(read_jsonl(out))
        _assert_same_labels(*outs)


def test_batched_builder_leaves_model_untouched_and_groups_records(world, tmp_path):
    model, tok = _load(world)
    snap = state_snapshot(model)
    builder = LabelBuilder(model, tok, BuildOptions(max_new_tokens=2, empty_generation="zero", batch_size=8))
    records = read_manifest(world["manifest"])
    # N + 1 = 4, 2, 3, 5, 4, 2: grouped while they fit 8 rows
    assert [[r.id for r in g] for g in builder.group(records)] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    calls = []
    orig = builder.label_many
    builder.label_many = lambda recs: (calls.append([r.id for r in recs]), orig(recs))[1]
    s = build_labels(records, builder, tmp_path / "o.jsonl", progress=False)
    assert s.written == 6 and calls == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    builder.close()
    assert_bit_identical(model, snap)
    assert not any(m._forward_hooks for m in model.modules())


def test_a_bad_record_in_a_batch_costs_only_itself(world, tmp_path, capsys):
    bad = make_adapter_dir(tmp_path / "bad", seed=3)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    recs = [json.loads(line) for line in world["manifest"].read_text().splitlines()[:3]]
    recs[1]["adapters"] = [str(bad)]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    out = tmp_path / "o.jsonl"
    args = ["labels", "build", str(manifest), "--model", str(world["model"]), "--out", str(out), "--no-generation",
            "--no-progress", "--batch-size", "64"]
    assert main(args) == 2  # on-error fail: the record before is kept, nothing after it
    assert "record 'r1'" in capsys.readouterr().err and [r["id"] for r in read_jsonl(out)] == ["r0"]
    assert main(args + ["--on-error", "skip"]) == 1
    assert [r["id"] for r in read_jsonl(out)] == ["r0", "r2"]
    ref = tmp_path / "ref.jsonl"
    assert main(args[:6] + [str(ref)] + args[7:-1] + ["1", "--on-error", "skip"]) == 1
    _assert_same_labels(read_jsonl(ref), read_jsonl(out))


def test_incompatible_adapter_in_a_batch_names_record_and_subset(world, tmp_path):
    from fcprag_plugin.adapter import LoraAdapter, LoraModule
    from fcprag_tools.label_builder.errors import LabelBuildError

    wide = LoraAdapter({"model.layers.0.mlp.gate_proj": LoraModule(torch.randn(2, 16), torch.randn(48, 2), 2.0)},
                       {"r": 2, "lora_alpha": 4}).save_pretrained(tmp_path / "wide")
    recs = [json.loads(line) for line in world["manifest"].read_text().splitlines()[:3]]
    recs[2]["adapters"][1] = str(wide)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    model, tok = _load(world)
    builder = LabelBuilder(model, tok, BuildOptions(generate=False, batch_size=16))
    outs = builder.label_many(read_manifest(manifest))
    assert isinstance(outs[0], dict) and isinstance(outs[1], dict)
    assert isinstance(outs[2], LabelBuildError) and "record 'r2'" in str(outs[2]) and "all 2 adapters" in str(outs[2])
    builder.close()


def test_batched_resume_after_interruption(world, tmp_path):
    """Interrupted between groups and mid-write, a batched run resumes with the missing records only: byte-identical
    to an uninterrupted batched run, and the same labels as the sequential path."""
    model, tok = _load(world)
    records = read_manifest(world["manifest"])
    opts = dict(max_new_tokens=3, empty_generation="zero")
    full, seq = tmp_path / "full.jsonl", tmp_path / "seq.jsonl"
    build_labels(records, LabelBuilder(model, tok, BuildOptions(batch_size=6, **opts)), full, progress=False)
    build_labels(records, LabelBuilder(model, tok, BuildOptions(batch_size=1, **opts)), seq, progress=False)
    _assert_same_labels(read_jsonl(seq), read_jsonl(full))

    builder = LabelBuilder(model, tok, BuildOptions(batch_size=6, **opts))  # groups r0,r1 | r2 | r3 | r4,r5
    real = builder.label_many
    calls = []

    def stopping(recs):
        calls.append([r.id for r in recs])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(recs)

    builder.label_many = stopping
    out = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        build_labels(records, builder, out, progress=False)
    assert [r["id"] for r in read_jsonl(out)] == ["r0", "r1", "r2"]
    lines = full.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][: len(lines[1]) // 2], encoding="utf-8")  # a crash while writing r1
    resumed = LabelBuilder(model, tok, BuildOptions(batch_size=6, **opts))
    seen = []
    orig = resumed.label_many
    resumed.label_many = lambda recs: (seen.append([r.id for r in recs]), orig(recs))[1]
    s = build_labels(records, resumed, out, progress=False)
    # r1's group is evaluated whole again (r0 with it: same neighbours, same rounding); r0 is not written twice
    assert seen == [["r0", "r1"], ["r2"], ["r3"], ["r4", "r5"]] and s.already_done == 1 and s.written == 5
    assert out.read_text(encoding="utf-8") == full.read_text(encoding="utf-8")
    s = build_labels(records, resumed, out, progress=False)
    assert s.written == 0 and s.already_done == 6 and seen[4:] == []


def test_batched_shards_merge_to_the_sequential_labels(world, tmp_path):
    """Round-robin shards labelled batched, merged in manifest order: the single-process sequential labels."""
    from fcprag_tools.label_builder.parts import merge_parts, shard_records
    from fcprag_tools.lm.shard import part_path

    model, tok = _load(world)
    records = read_manifest(world["manifest"])
    opts = dict(max_new_tokens=3, empty_generation="zero")
    seq = tmp_path / "seq.jsonl"
    build_labels(records, LabelBuilder(model, tok, BuildOptions(batch_size=1, **opts)), seq, progress=False)
    out = tmp_path / "out.jsonl"
    parts = [part_path(out, r, 2) for r in range(2)]
    for rank, part in enumerate(parts):
        mine = shard_records(records, rank, 2)
        build_labels(mine, LabelBuilder(model, tok, BuildOptions(batch_size=5, **opts)), part, progress=False)
        assert [r["id"] for r in read_jsonl(part)] == [r.id for r in mine]
    merge_parts(parts, records, out)
    _assert_same_labels(read_jsonl(seq), read_jsonl(out))


def test_bad_batch_size_is_one_clear_line(world, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    with pytest.raises(SystemExit) as exc:  # argparse's one-line usage error
        main(["labels", "build", str(world["manifest"]), "--model", str(world["model"]), "--out", str(out),
              "--batch-size", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "argument --batch-size: 0 is too small; expected an integer >= 1" in err
    assert "Traceback" not in err and not out.exists()
