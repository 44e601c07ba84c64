"""Batches that halve on a (simulated) device out-of-memory error: the same results as without the error, one log
line per halving, and a batch of one that still fails re-raises. The study's augmentation and stacked training use
the same helper: tests/tools/study/test_adapters.py and test_data.py."""

from __future__ import annotations

import logging

import pytest
import torch

from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.slot import FusedSlot
from fcprag_tools.lm import batched, oom
from fcprag_tools.lm.batched import ScoreRow, score_rows
from helpers import make_adapter_dir, save_tiny_lm

OOM = torch.OutOfMemoryError


def oom_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "out of device memory" in r.getMessage()]


def test_the_out_of_memory_errors_are_recognised():
    assert oom.is_oom(OOM("CUDA out of memory")) and oom.is_oom(torch.cuda.OutOfMemoryError("x"))
    assert not oom.is_oom(RuntimeError("CUDA out of memory")) and not oom.is_oom(MemoryError())


def test_halving_gives_every_batch_once_in_order_and_logs_once(caplog):
    seen = []

    def run(batch):
        seen.append(list(batch))
        if len(batch) > 3:
            raise OOM("simulated")
        return [u * 10 for u in batch]

    with caplog.at_level(logging.WARNING):
        got = list(oom.halving(list(range(10)), 8, run, what="unit test"))
    assert [b for b, _ in got] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # 8 failed, then 4: batches of 2
    assert [o for _, outs in got for o in outs] == [u * 10 for u in range(10)]
    assert seen[:3] == [list(range(8)), list(range(4)), [0, 1]]
    assert oom_lines(caplog) == ["unit test: out of device memory at a batch of 8; going on with batches of 4",
                                 "unit test: out of device memory at a batch of 4; going on with batches of 2"]


def test_halving_keeps_the_smaller_size_and_reraises_at_one(caplog):
    def run(batch):
        if len(batch) > 2:
            raise OOM("simulated")
        return sum(batch)

    with caplog.at_level(logging.WARNING):
        got = list(oom.halving(list(range(7)), 5, run, what="t"))
    assert [b for b, _ in got] == [[0, 1], [2, 3], [4, 5], [6]]
    assert oom_lines(caplog) == ["t: out of device memory at a batch of 5; going on with batches of 2"]

    def always(batch):
        raise OOM("still too big")

    with pytest.raises(OOM, match="still too big"):
        list(oom.halving([1, 2, 3], 3, always, what="t"))

    def other(batch):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):  # other errors are not retried
        list(oom.halving([1, 2, 3], 3, other, what="t"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("oom")
    model_dir = save_tiny_lm(root / "lm", seed=2)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ads = [LoraAdapter.from_pretrained(make_adapter_dir(root / f"p{i}", seed=40 + i)) for i in range(3)]
    qs = ["what is the capital of france ?", "who wrote the book ?", "which river is in paris ?",
          "where is the king ?", "when was the tower born ?"]
    rows = []
    for j, q in enumerate(qs):
        p = tok(q)["input_ids"]
        gold = [tok(" " + a, add_special_tokens=False)["input_ids"] for a in (["paris", "the city"] if j % 2 else
                                                                                ["seine"])]
        rows.append(ScoreRow(p, gold, ads[:1 + j % 3], [1.0, 0.5, 2.0][:1 + j % 3], gen_prompt_ids=p))
    return {"model": model, "tok": tok, "ads": ads, "rows": rows}


def _fail_above(monkeypatch, k: int) -> list[int]:
    """Forwards and generations of more than ``k`` sequences raise the out-of-memory error."""
    sizes = []
    real_lp, real_read = batched.batched_answer_logprobs, batched.read_prompts

    def lp(model, seqs, pad):
        sizes.append(len(seqs))
        if len(seqs) > k:
            raise OOM("CUDA out of memory (simulated)")
        return real_lp(model, seqs, pad)

    def read(model, tok, prompts, *a, **kw):
        sizes.append(len(prompts))
        if len(prompts) > k:
            raise OOM("CUDA out of memory (simulated)")
        return real_read(model, tok, prompts, *a, **kw)

    monkeypatch.setattr(batched, "batched_answer_logprobs", lp)
    monkeypatch.setattr(batched, "read_prompts", read)
    return sizes


def _score(world, batch_size, share=False):
    slot = FusedSlot(world["model"], world["ads"][0], max_adapters=8, max_rank=2)
    try:
        return score_rows(world["model"], world["tok"], slot, world["rows"], batch_size=batch_size, max_new_tokens=4,
                          share_prompt=share)
    finally:
        slot.remove()


def test_score_rows_halves_its_forwards_and_generation(world, monkeypatch, caplog):
    want = _score(world, 1)
    sizes = _fail_above(monkeypatch, 3)
    with caplog.at_level(logging.WARNING):
        got = _score(world, 8)
    # teacher forcing: all 7 sequences (5 rows, two with 2 aliases) failed, then batches of <= 3 ran;
    # generation: all 5 rows failed, then batches of 2
    assert sizes[0] == 7 and max(sizes[1:sizes.index(5)]) <= 3 and sizes[sizes.index(5) + 1:] == [2, 2, 1]
    for g, w in zip(got, want):
        assert g.alias_logprobs == pytest.approx(w.alias_logprobs, abs=1e-5) and g.generation == w.generation
    assert oom_lines(caplog) == ["scoring forwards: out of device memory at a batch of 7; going on with batches of 3",
                                 "scoring generation: out of device memory at a batch of 5; going on with batches of 2"]


def test_score_rows_halves_its_reads_of_each_prompt_once(world, monkeypatch, caplog):
    """A row's prompt read once for its aliases and its answer: one sequence per row, halved like the others."""
    want = _score(world, 1, share=True)
    sizes = _fail_above(monkeypatch, 3)
    with caplog.at_level(logging.WARNING):
        got = _score(world, 8, share=True)
    assert sizes == [5, 2, 2, 1]
    for g, w in zip(got, want):
        assert g.alias_logprobs == pytest.approx(w.alias_logprobs, abs=1e-5) and g.generation == w.generation
    assert oom_lines(caplog) == ["scoring forwards: out of device memory at a batch of 5; going on with batches of 2"]


def test_score_rows_reraises_when_one_row_does_not_fit(world, monkeypatch):
    _fail_above(monkeypatch, 1)  # a row with two gold aliases is two sequences: never fits
    with pytest.raises(OOM):
        _score(world, 8)
