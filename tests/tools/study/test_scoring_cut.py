"""Greedy answers that stop at PRAG's cut: the study's predictions, F1 and EM equal those of the full-length answer
cut afterwards, on both prompt kinds, the Arrow row, and the tiny Llama and Qwen2 models."""

from __future__ import annotations

import pytest
import torch

from fcprag_plugin import LoraAdapter
from fcprag_plugin.slot import FusedSlot
from fcprag_tools.lm.metrics import extract_answer, greedy_generate, reaches_cut
from fcprag_tools.study import scoring
from helpers import make_adapter_dir, tiny_model, tiny_tokenizer

# ids whose decoded text holds a cut mid-token, or is only a newline (leading newlines are stripped, not cut at)
ODD = {7: "4.5", 11: "x,y", 13: "\n", 17: "a\nb"}


class CutTok:
    """The tiny tokenizer with its own decode: the :data:`ODD` ids decode to text with a cut character inside,
    every other id to its word (``w<id>`` past the vocabulary); words joined by spaces, special tokens dropped."""

    def __init__(self) -> None:
        self.tok = tiny_tokenizer()

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        specials = set(self.tok.all_special_ids) if skip_special_tokens else set()
        return " ".join(ODD.get(i) or self.tok.convert_ids_to_tokens(i) or f"w{i}" for i in ids if i not in specials)


def test_reaches_cut_follows_the_scorers_strip_then_cut():
    assert not reaches_cut("") and not reaches_cut(" \n ") and not reaches_cut("\n paris")
    assert reaches_cut(" paris\n") and reaches_cut("4.5") and reaches_cut(" no, it") and reaches_cut("\n x,")
    for text in ("\n paris", " paris\n", "4.5", " no, it is"):  # once reached, every continuation cuts the same
        if reaches_cut(text):
            assert extract_answer(text + " more. words", scoring="prag") == extract_answer(text, scoring="prag")


def _world(tmp_path, kind):
    model = tiny_model(kind, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    with torch.no_grad():  # a cut character often among the likely tokens: most answers end early
        model.lm_head.weight[list(ODD)] += 2.0 * model.lm_head.weight.std()
    ads = {f"p{i}": LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"p{i}", kind, seed=40 + i))
           for i in range(4)}
    texts = ["paris : paris is the capital of france .", "berlin : the river of berlin .", "rome : a city in italy ."]
    qs = {q: {"question": text, "answers": ans, "passages": [{"pid": f"p{(i + j) % 4}", "text": texts[j]}
                                                             for j in range(3)]}
          for i, (q, text, ans) in enumerate([("a", "what is the capital of france ?", ["paris", "the city"]),
                                              ("b", "who wrote the book ?", ["the king"]),
                                              ("c", "which river is in paris ?", ["seine"]),
                                              ("d", "when was the tower born ?", ["one year", "1"])])}
    return model, CutTok(), ads, qs


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_answers_stopped_at_the_cut_score_as_full_length_answers(tmp_path, kind):
    model, tok, ads, qs = _world(tmp_path, kind)
    rows = []
    for q, rec in qs.items():
        pids = [p["pid"] for p in rec["passages"]]
        rows += [scoring.Row(q, "vanilla", pids, [0.0] * 3), scoring.Row(q, "standard_rag", pids, [0.0] * 3, "combine"),
                 scoring.Row(q, "prag_sum", pids, [1.0] * 3), scoring.Row(q, "x", pids, [2.0, 0.5, -0.3]),
                 scoring.Row(q, "prag_sum_combine", pids, [1.0] * 3, "combine")]
    slot = FusedSlot.for_model(model, ads["p0"], max_adapters=4, max_rank=2)
    try:
        full, cut = (scoring.score(model, tok, slot, rows, qs, ads.__getitem__, max_new_tokens=16, batch_size=7,
                                   until_cut=u) for u in (False, True))
    finally:
        slot.remove()
    for r, f, c in zip(rows, full, cut):
        assert (c["prediction"], c["f1"], c["em"]) == (f["prediction"], f["f1"], f["em"]), r
        assert c["logprob"] == pytest.approx(f["logprob"], abs=1e-5)
        assert f["generation"].startswith(c["generation"]) and (c["generation"] == f["generation"]
                                                                 or reaches_cut(c["generation"]))
    for r, f in zip(rows, full):  # the full-length reference is the model's own generate, on the base-model rows
        if r.name in ("vanilla", "standard_rag"):
            p_ids, _ = scoring.encode(tok, qs[r.qid]["question"], qs[r.qid]["answers"],
                                      [p["text"] for p in qs[r.qid]["passages"]], r.prompt)
            out = model.generate(input_ids=torch.tensor([p_ids]), attention_mask=torch.ones(1, len(p_ids),
                                 dtype=torch.long), max_new_tokens=16, do_sample=False, pad_token_id=0)
            assert f["generation"] == tok.decode(out[0, len(p_ids):])
    shorter = sum(len(c["generation"]) < len(f["generation"]) for f, c in zip(full, cut))
    assert shorter >= len(rows) // 3  # not degenerate: most answers stop early, on both prompts
    assert {r.prompt for r, f, c in zip(rows, full, cut) if len(c["generation"]) < len(f["generation"])} == \
        {"param", "combine"}


def test_arrow_rows_stopped_at_the_cut_score_as_full_length_ones(tmp_path):
    model, tok, ads, qs = _world(tmp_path, "llama")
    items = [(q, rec, [p["pid"] for p in rec["passages"]]) for q, rec in qs.items()]
    full, cut = (scoring.score_arrow_rows(model, tok, items, ads.__getitem__, max_new_tokens=16, until_cut=u)
                 for u in (False, True))
    for f, c in zip(full, cut):
        assert (c["prediction"], c["f1"], c["em"]) == (f["prediction"], f["f1"], f["em"])
        assert f["generation"].startswith(c["generation"])
    assert any(len(c["generation"]) < len(f["generation"]) for f, c in zip(full, cut))
