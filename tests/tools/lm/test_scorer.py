"""``labels.batched.score_rows``: many rows, each under its own weighted adapters, equal to scoring each row alone."""

from __future__ import annotations

import pytest
import torch

from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.errors import FcpragError, MergeError
from fcprag_plugin.slot import FusedSlot
from fcprag_tools.lm.batched import ScoreRow, score_rows
from fcprag_tools.lm.metrics import answer_logprob, greedy_generate
from fcprag_plugin import activate
from fcprag_plugin.merge import merge_adapters
from helpers import assert_bit_identical, make_adapter_dir, save_tiny_lm, state_snapshot

QUESTIONS = ["What is the capital of France?", "Who wrote the book?", "Which river is in Paris?",
             "When was the tower born?", "Where is the king?"]
ANSWERS = [["paris", "paris city"], ["the king"], ["seine"], ["one year", "1"], ["tower"]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("scorer")
    model_dir = save_tiny_lm(root / "lm", seed=1)
    dirs = [make_adapter_dir(root / f"p{i}", seed=20 + i, r=2 if i % 2 else 4) for i in range(4)]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ads = [LoraAdapter.from_pretrained(d) for d in dirs]
    ads.append(LoraAdapter.from_pretrained(dirs[2]))  # a second object for the same files: a 5th union member
    return {"model": model, "tok": tok, "dirs": dirs, "ads": ads}


def _rows(world, generate=True):
    """Rows with different adapter sets and non-uniform (also negative) weights, a base row, a repeated prompt."""
    tok, ads = world["tok"], world["ads"]
    plan = [([0, 1, 2], [0.7, 1.3, -0.4]), ([], None), ([3], [2.0]), ([1, 3], [0.5, 0.5]), ([0, 1, 2, 3], None),
            ([4], [1.0])]
    rows = []
    for j, (idx, w) in enumerate(plan):
        q = j % len(QUESTIONS)
        p = tok(QUESTIONS[q])["input_ids"]
        gold = [tok(" " + a, add_special_tokens=False)["input_ids"] for a in ANSWERS[q]]
        rows.append(ScoreRow(p, gold, [ads[i] for i in idx], w, gen_prompt_ids=p if generate else None))
    return rows


def _alone(model, tok, row, mode="cat", max_new=5):
    """The reference: this row alone, its merged adapter applied with hooks, one sequence at a time."""
    if row.adapters:
        w = row.weights if row.weights is not None else [1.0] * len(row.adapters)
        ads = [a if isinstance(a, LoraAdapter) else LoraAdapter.from_pretrained(a) for a in row.adapters]
        ctx = activate(model, merge_adapters(ads, list(w), mode).adapter)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx:
        lps = [answer_logprob(model, row.prompt_ids, g) for g in row.gold_ids]
        gen = greedy_generate(model, tok, row.gen_prompt_ids, max_new) if row.gen_prompt_ids is not None else None
    return lps, gen


@pytest.mark.parametrize("batch_size,max_tokens,k", [(64, None, 8), (3, None, 8), (64, 40, 8), (64, None, 4)])
def test_rows_equal_each_row_alone(world, monkeypatch, batch_size, max_tokens, k):
    """All rows in one forward, a few per forward, a token budget, and a slot too small for the whole union (5)."""
    from fcprag_tools.lm import batched

    model, tok = world["model"], world["tok"]
    rows = _rows(world)
    snap = state_snapshot(model)
    forwards = []
    real = batched.read_prompts

    def counting(m, t, prompts, golds=None, **kw):  # one call: one read of its prompts (gold + greedy answer)
        forwards.append((len(prompts), max(len(p) for p in prompts) + 5))
        return real(m, t, prompts, golds, **kw)

    monkeypatch.setattr(batched, "read_prompts", counting)
    slot = FusedSlot(model, world["ads"][0], max_adapters=k, max_rank=4)
    try:
        got = score_rows(model, tok, slot, rows, batch_size=batch_size, max_tokens=max_tokens, max_new_tokens=5)
    finally:
        slot.remove()
    assert (len(forwards) == 1) == ((batch_size, max_tokens, k) == (64, None, 8))  # the budgets split the rows
    assert all(b <= batch_size and (max_tokens is None or b * w <= max_tokens) for b, w in forwards)
    assert sum(b for b, _ in forwards) == len(rows)  # each prompt read once
    assert_bit_identical(model, snap)
    want = [_alone(model, tok, r) for r in rows]
    for g, (lps, gen) in zip(got, want):
        assert g.alias_logprobs == pytest.approx(lps, abs=1e-5)
        assert g.logprob == max(g.alias_logprobs)
        assert g.generation == gen
    # not degenerate: the adapters move the scores, and rows differ
    base = [_alone(model, tok, ScoreRow(r.prompt_ids, r.gold_ids))[0] for r in rows]
    assert max(abs(g.alias_logprobs[0] - b[0]) for g, b in zip(got, base)) > 1e-3
    assert len({g.generation for g in got}) > 1


def test_separate_mode_and_adapter_directories(world):
    """DyPRAG's merge per row (equal ranks within the union), adapters given as directories."""
    model, tok = world["model"], world["tok"]
    d = world["dirs"]  # ranks 4, 2, 4, 2: rows use equal ranks
    p = tok(QUESTIONS[0])["input_ids"]
    gold = [tok(" paris", add_special_tokens=False)["input_ids"]]
    rows = [ScoreRow(p, gold, [d[0], d[2]], [0.3, 1.1]), ScoreRow(p, gold, [d[2]], None), ScoreRow(p, gold)]
    slot = FusedSlot(model, world["ads"][0], max_adapters=4, max_rank=4)
    try:
        got = score_rows(model, tok, slot, rows, mode="separate", batch_size=8)
    finally:
        slot.remove()
    for g, r in zip(got, rows):
        assert g.alias_logprobs == pytest.approx(_alone(model, tok, r, "separate")[0], abs=1e-5)
    assert abs(got[0].logprob - got[2].logprob) > 1e-4


def test_stop_ids_cut_each_row_after_its_first_stop(world):
    model, tok = world["model"], world["tok"]
    prompts = [tok(q)["input_ids"] for q in QUESTIONS[:3]]
    free = [model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    stop = free[0][2]  # a token row 0 emits third: row 0 stops there, others where (if) they emit it
    rows = [ScoreRow(p, [[5]], gen_prompt_ids=p) for p in prompts]
    got = score_rows(model, tok, None, rows, max_new_tokens=6, stop_ids=[stop])
    for g, toks in zip(got, free):
        cut = toks[: toks.index(stop) + 1] if stop in toks else toks
        assert g.generation == tok.decode(cut, skip_special_tokens=True)
    first = free[0].index(stop)
    assert tok.decode(free[0][: first + 1], skip_special_tokens=True) != tok.decode(free[0], skip_special_tokens=True)


def test_errors_are_clear(world):
    model, tok = world["model"], world["tok"]
    p = tok(QUESTIONS[0])["input_ids"]
    with pytest.raises(FcpragError, match="need a FusedSlot"):
        score_rows(model, tok, None, [ScoreRow(p, [[5]], [world["ads"][0]])])
    with pytest.raises(MergeError, match="score row 1: 1 adapters but 2 weights"):
        score_rows(model, tok, None, [ScoreRow(p, [[5]]), ScoreRow(p, [[5]], [world["ads"][0]], [1.0, 2.0])])
    with pytest.raises(FcpragError, match="score row 0: needs a non-empty prompt"):
        score_rows(model, tok, None, [ScoreRow(p, [[]])])
    with pytest.raises(FcpragError, match="batch_size must be an integer >= 1"):
        score_rows(model, tok, None, [ScoreRow(p, [[5]])], batch_size=0)
    slot = FusedSlot(model, world["ads"][0], max_adapters=2, max_rank=4)
    try:
        with pytest.raises(MergeError, match="3 adapters do not fit this slot"):
            score_rows(model, tok, slot, [ScoreRow(p, [[5]], world["ads"][:3])])
        assert not slot.active  # nothing left switched on
    finally:
        slot.remove()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_read_of_each_prompt_equals_separate_reads(tmp_path, kind):
    """The prompt's cache shared by the gold aliases (of different lengths) and the greedy answer: alias
    log-probabilities equal a separate teacher-forced forward per alias, greedy answers equal, with and without
    adapters, in one batch and alone."""
    from helpers import tiny_model, tiny_tokenizer

    model, tok = tiny_model(kind, seed=3, bos_token_id=2, eos_token_id=3, pad_token_id=0), tiny_tokenizer()
    ads = [LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"p{i}", kind, seed=50 + i)) for i in range(2)]
    rows = []
    for j, q in enumerate(QUESTIONS):
        p = tok(q)["input_ids"]
        gold = [tok(" " + a, add_special_tokens=False)["input_ids"] for a in ANSWERS[j] + ["the river of berlin"]]
        rows.append(ScoreRow(p, gold, ads[: j % 3], [1.5, -0.5][: j % 3], gen_prompt_ids=p))
    slot = FusedSlot(model, ads[0], max_adapters=2, max_rank=2)
    try:
        once, twice = (score_rows(model, tok, slot, rows, batch_size=4, max_new_tokens=6, share_prompt=s)
                       for s in (True, False))
        alone = [score_rows(model, tok, slot, [r], max_new_tokens=6)[0] for r in rows]
    finally:
        slot.remove()
    for j, (a, b, c) in enumerate(zip(once, twice, alone)):
        assert len(a.alias_logprobs) == len(ANSWERS[j]) + 1
        assert a.alias_logprobs == pytest.approx(b.alias_logprobs, abs=1e-5)
        assert a.alias_logprobs == pytest.approx(c.alias_logprobs, abs=1e-5)
        assert a.generation == b.generation == c.generation
    assert len({round(a.logprob, 4) for a in once}) == len(rows)
