"""DyPRAG's rows: the composite against a dense ``mean(B) @ mean(A)``, kappa acting squared, the gold-passage
ceiling, the pairwise cosine against dense updates, the cost summary, and a DyPRAG row scored through the study's
fused slot against an independent implementation (the double of DyPRAG's translator, dense forward hooks)."""

from __future__ import annotations

import math

import pytest
import torch

from fcprag_plugin import LoraAdapter, LoraModule
from fcprag_plugin.slot import FusedSlot
from fcprag_tools.study import scoring
from fcprag_tools.study.ceiling import gold_passage_weights
from fcprag_tools.translator import (Translator, TranslatorError, TranslatorShape, cost_summary, dyprag_adapter,
                                     generate_adapters, mean_pairwise_cosine, prag_adapter_seconds, save_translator)
from helpers import random_adapter, tiny_model, tiny_tokenizer

from .double import double_for, dyprag_answer, dyprag_deltas, dyprag_embedding


def _generated(model, n, seed=0):
    return [random_adapter(model, 2, seed=seed + i, alpha=2) for i in range(n)]  # alpha = r: scaling 1


def _dense_mean(ads, name, u):
    """``(sum u_i B_i) @ (sum u_i A_i)`` in float64, from the raw factors."""
    A = sum(w * a.modules[name].A.double() for w, a in zip(u, ads))
    B = sum(w * a.modules[name].B.double() for w, a in zip(u, ads))
    return B @ A


def test_the_composite_is_dyprags_mean_b_times_mean_a():
    model = tiny_model("llama")
    ads = _generated(model, 3)
    comp = dyprag_adapter(ads)
    assert comp.modules.keys() == ads[0].modules.keys()
    for name, m in comp.modules.items():
        assert m.scaling == 1.0 and m.rank == 2
        torch.testing.assert_close(m.delta(torch.float64), _dense_mean(ads, name, [1 / 3] * 3), rtol=1e-5, atol=1e-6)
        # not the mean of the updates: DyPRAG's rule has the cross terms
        assert (m.delta(torch.float64) - sum(a.modules[name].delta(torch.float64) for a in ads) / 3).abs().max() > 1e-3


def test_weights_enter_as_u_and_kappa_multiplies_the_update_by_its_square():
    model = tiny_model("qwen2")
    ads = _generated(model, 4, seed=5)
    w = [0.5, 2.0, 1.25, 0.25]
    name = "model.layers.1.mlp.down_proj"
    torch.testing.assert_close(dyprag_adapter(ads, w).modules[name].delta(torch.float64),
                               _dense_mean(ads, name, [x / 4 for x in w]), rtol=1e-5, atol=1e-6)
    base = dyprag_adapter(ads).modules[name].delta(torch.float64)
    for kappa in (2.0, 0.5, 3.0):
        scaled = dyprag_adapter(ads, [kappa] * 4).modules[name].delta(torch.float64)
        torch.testing.assert_close(scaled, kappa ** 2 * base, rtol=1e-5, atol=1e-6)
        assert (scaled - kappa * base).abs().max() > 0.1 * base.abs().max()  # not kappa


def test_the_gold_ceiling_is_the_mean_over_the_supporting_passages():
    model = tiny_model("llama")
    ads = _generated(model, 4, seed=9)
    passages = [{"title": t} for t in ("a", "b", "c", "d")]
    w = gold_passage_weights(passages, ["b", "d"])
    name = "model.layers.0.mlp.up_proj"
    torch.testing.assert_close(dyprag_adapter(ads, w).modules[name].delta(torch.float64),
                               _dense_mean([ads[1], ads[3]], name, [0.5, 0.5]), rtol=1e-5, atol=1e-6)
    assert gold_passage_weights(passages, ["z"]) == [1.0] * 4  # none retrieved: DyPRAG's own row


def test_prag_adapters_have_no_dyprag_rule():
    model = tiny_model("llama")
    with pytest.raises(TranslatorError, match=r"module 'model\.layers\.0\.mlp\.gate_proj' has scaling 16\.0"):
        dyprag_adapter([random_adapter(model, 2, seed=0, alpha=32)])


def _dense_cosine(ads):
    vecs = [torch.cat([(m.scaling * m.B.double() @ m.A.double()).flatten() for _, m in sorted(a.modules.items())])
            for a in ads]
    cos = [torch.nn.functional.cosine_similarity(vecs[i], vecs[j], dim=0)
           for i in range(len(vecs)) for j in range(i + 1, len(vecs))]
    return float(sum(cos) / len(cos))


@pytest.mark.parametrize("alpha", [2, 32])
def test_the_mean_pairwise_cosine_equals_the_dense_one(alpha):
    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i, alpha=alpha) for i in range(4)]
    assert mean_pairwise_cosine(ads) == pytest.approx(_dense_cosine(ads), abs=1e-10)
    near = [ads[0], LoraAdapter({n: LoraModule(m.A * 1.1, m.B + 0.01, m.scaling) for n, m in ads[0].modules.items()})]
    assert mean_pairwise_cosine(near) == pytest.approx(_dense_cosine(near), abs=1e-10) and _dense_cosine(near) > 0.9
    assert mean_pairwise_cosine(ads[:1]) is None
    zero = LoraAdapter({n: LoraModule(m.A, m.B * 0, m.scaling) for n, m in ads[0].modules.items()})
    assert mean_pairwise_cosine([ads[1], zero]) is None


def test_the_cost_summary():
    prag = prag_adapter_seconds([{"id": "a", "group_seconds": 8.0, "group": 4}, {"id": "b", "group_seconds": 3.0,
                                                                                   "group": 1}])
    assert prag == {"a": 2.0, "b": 3.0}
    s = cost_summary(100.0, {"a": 0.5, "b": 0.25, "c": 0.75}, prag)
    assert s["generation_seconds_per_passage"] == 0.5 and s["prag_seconds_per_passage"] == 2.5
    assert s["prag_over_generation"] == 5.0 and s["break_even_passages"] == math.ceil(100 / 2.0)
    assert cost_summary(1.0, {"a": 9.0}, {"a": 1.0})["break_even_passages"] is None


def _reference(model, tok, double, question, passages, answers, max_new, prompt):
    """DyPRAG's inference, independently: the double per passage, mean of every key, dense delta through forward
    hooks (:func:`.double.dyprag_answer`)."""
    deltas = dyprag_deltas([double(dyprag_embedding(model, tok, p)) for p in passages])
    return dyprag_answer(model, tok, deltas, question, answers, passages, prompt, max_new)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_dyprag_row_through_the_fused_slot_equals_an_independent_dyprag(tmp_path, kind):
    model, tok = tiny_model(kind, bos_token_id=2, eos_token_id=3, pad_token_id=0), tiny_tokenizer()
    ours = Translator(TranslatorShape.from_config(model.config, width=8), seed=4, init_std=0.15)
    double = double_for(model, 2, 8)
    double.load_state_dict(torch.load(save_translator(ours, tmp_path / "t.pt"), weights_only=True)["model_state_dict"])
    qs = {"q": {"question": "who wrote the book ?", "answers": ["the king", "queen"],
                "passages": [{"text": t} for t in ("the king wrote the book in the year 1", "paris city",
                                                   "a red bridge and a green tower")]}}
    texts = {f"p{i}": p["text"] for i, p in enumerate(qs["q"]["passages"])}
    gen, _ = generate_adapters(model, tok, ours, texts)
    comp = dyprag_adapter(list(gen.values()))
    rows = [scoring.Row("q", "dyprag", list(texts), [1.0] * 3, update=comp),
            scoring.Row("q", "dyprag_combine", list(texts), [1.0] * 3, "combine", update=comp),
            scoring.Row("q", "vanilla", list(texts), [0.0] * 3)]
    slot = FusedSlot.for_model(model, rows[0].update, max_adapters=2, max_rank=2)
    try:
        got = scoring.score(model, tok, slot, rows, qs, lambda p: None, max_new_tokens=6, until_cut=False)
    finally:
        slot.remove()
    for g, prompt in zip(got, ("param", "combine")):
        lp, text = _reference(model, tok, double, qs["q"]["question"], list(texts.values()), qs["q"]["answers"], 6,
                              prompt)
        assert g["logprob"] == pytest.approx(lp, abs=1e-4) and g["generation"] == text and g["prompt"] == prompt
        assert g["pids"] == ["p0", "p1", "p2"] and g["w"] == [1.0] * 3 and g["update"].startswith("dyprag")
    assert abs(got[2]["logprob"] - got[0]["logprob"]) > 1e-2 and "update" not in got[2]  # the update matters
