"""The study's Arrow row of many questions at once (``scoring.score_arrow_rows``): in one batch equal to each
question alone on every stack, and equal to PEFT's ``create_arrow_model`` one question at a time where PEFT has
Arrow (the routing itself: tests/tools/lm/test_arrow.py)."""

from __future__ import annotations

import pytest

from fcprag_plugin import LoraAdapter
from fcprag_tools.study import scoring
from helpers import make_adapter_dir, tiny_model, tiny_tokenizer


def _arrow_world(tmp_path):
    model = tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0)
    tok = tiny_tokenizer()
    dirs = {f"p{i}": make_adapter_dir(tmp_path / f"p{i}", seed=30 + i) for i in range(5)}
    qs = {"a": {"question": "what is the capital of france ?", "answers": ["paris", "the city"]},
          "b": {"question": "who wrote the book ?", "answers": ["the king"]},
          "c": {"question": "which river is in paris ?", "answers": ["seine"]}}
    items = [("a", qs["a"], ["p0", "p1", "p2"]), ("b", qs["b"], ["p2", "p3"]), ("c", qs["c"], ["p4", "p0", "p1", "p3"])]
    return model, tok, dirs, items


def test_arrow_rows_in_one_batch_equal_each_question_alone(tmp_path):
    """On every stack: the Arrow rows of three questions (own adapter sets, one shared) scored together equal each
    scored alone, in score_arrow's result format; the model is left as it was."""
    from helpers import assert_bit_identical, state_snapshot

    model, tok, dirs, items = _arrow_world(tmp_path)
    ads = {p: LoraAdapter.from_pretrained(d) for p, d in dirs.items()}
    snap = state_snapshot(model)
    together = scoring.score_arrow_rows(model, tok, items, ads.__getitem__, max_new_tokens=4, batch_size=16)
    alone = [scoring.score_arrow_rows(model, tok, [it], dirs.__getitem__, max_new_tokens=4, batch_size=1)[0]
             for it in items]
    assert_bit_identical(model, snap)
    assert not any(m._forward_hooks for m in model.modules())
    for (qid, q, pids), g, a in zip(items, together, alone):
        assert g["id"] == f"{qid}|arrow" and g["pids"] == pids and g["w"] is None
        assert set(g) == {"id", "logprob", "generation", "prediction", "f1", "em", "acc", "prompt", "pids", "w"}
        assert g["logprob"] == pytest.approx(a["logprob"], abs=1e-5) and g["generation"] == a["generation"]


@pytest.mark.skipif(not scoring.arrow_status()[0], reason="this PEFT has no Arrow (PEFT >= 0.18 has it)")
def test_arrow_rows_equal_peft_arrow_one_question_at_a_time(tmp_path):
    """The batched Arrow rows equal PEFT's create_arrow_model per question (score_arrow): the gold log-lik. within
    1e-5, the same greedy answer."""
    model, tok, dirs, items = _arrow_world(tmp_path)
    ads = {p: LoraAdapter.from_pretrained(d) for p, d in dirs.items()}
    got = scoring.score_arrow_rows(model, tok, items, ads.__getitem__, max_new_tokens=6, batch_size=4)
    for (qid, q, pids), g in zip(items, got):
        ref = scoring.score_arrow(model, tok, qid, q, pids, dirs.__getitem__, max_new_tokens=6)
        assert g["logprob"] == pytest.approx(ref["logprob"], abs=1e-5)
        assert {k: v for k, v in g.items() if k != "logprob"} == {k: v for k, v in ref.items() if k != "logprob"}
