"""Held-out scoring: every row of a mixed batch equals scoring it alone with its own merge; the oracle's weights;
the one bootstrap."""

from __future__ import annotations

import pytest
import torch

from fcprag_plugin import LoraAdapter, activate
from fcprag_plugin.merge import merge_adapters
from fcprag_plugin.slot import FusedSlot
from fcprag_tools.lm.metrics import answer_logprob, extract_answer, f1_score, greedy_generate
from fcprag_tools.study import scoring, stats
from fcprag_tools.study.stages.rows import oracle
from helpers import assert_bit_identical, make_adapter_dir, tiny_model, tiny_tokenizer


def test_mixed_batch_rows_equal_each_row_alone(tmp_path):
    model = tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0)
    tok = tiny_tokenizer()
    ads = {f"p{i}": LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"p{i}", seed=i)) for i in range(4)}
    qs = {"a": {"question": "what is the capital of france ?", "answers": ["paris", "the city"]},
          "b": {"question": "who wrote the book ?", "answers": ["the king"]}}
    rows = [scoring.Row("a", "prag_sum", ["p0", "p1"], [1.0, 1.0]), scoring.Row("a", "x", ["p0", "p1"], [2.5, 0.5]),
            scoring.Row("b", "loo:0", ["p2", "p3"], [0.0, 1.0]), scoring.Row("b", "avg", ["p2", "p3"], [0.5, 0.5])]
    slot = FusedSlot.for_model(model, ads["p0"], max_adapters=4, max_rank=2)
    try:
        got = scoring.score(model, tok, slot, rows, qs, ads.__getitem__, max_new_tokens=4, batch_size=5)
    finally:
        slot.remove()
    for r, g in zip(rows, got):
        keep = [(ads[p], w) for p, w in zip(r.pids, r.weights) if w]
        p_ids, gold = scoring.encode(tok, qs[r.qid]["question"], qs[r.qid]["answers"])
        with activate(model, merge_adapters([a for a, _ in keep], [w for _, w in keep], "cat").adapter), \
                torch.no_grad():
            lp = max(answer_logprob(model, p_ids, a) for a in gold)
            gen = greedy_generate(model, tok, p_ids, 4)
        assert g["id"] == f"{r.qid}|{r.name}" and g["w"] == r.weights
        assert g["logprob"] == pytest.approx(lp, abs=1e-4)
        assert g["generation"] == gen
        assert g["f1"] == pytest.approx(f1_score(extract_answer(gen, scoring="prag"), qs[r.qid]["answers"]))


def test_oracle_weights_follow_the_leave_one_out_deltas():
    done = {"q|prag_sum": {"logprob": -1.0}, "q|loo:0": {"logprob": -1.5}, "q|loo:1": {"logprob": -0.9}}
    w = oracle(done, "q", 2)
    ref = 2 * torch.softmax(torch.tensor([0.5, -0.1]) / 0.1, 0)
    assert w == pytest.approx(ref.tolist(), abs=1e-6) and sum(w) == pytest.approx(2)


def test_paired_bootstrap_brackets_the_mean_and_is_seeded():
    g = torch.Generator().manual_seed(0)
    d = (torch.randn(200, generator=g) * 0.1 + 0.05).tolist()
    m, ci = stats.paired(d, "x")
    assert m == pytest.approx(sum(d) / len(d)) and ci[0] < m < ci[1]
    assert (m, ci) == stats.paired(d, "x")
    se = float(torch.tensor(d).std()) / len(d) ** 0.5  # the normal interval, an independent reference
    assert ci[0] == pytest.approx(m - 1.96 * se, abs=0.4 * se) and ci[1] == pytest.approx(m + 1.96 * se, abs=0.4 * se)


def _dense_copy(model, adapters, weights):
    """A float64 copy of ``model`` with ``sum_i w_i s_i B_i @ A_i`` written into its weights (independent of the
    library's merge and slot)."""
    import copy

    from helpers import dense_reference

    ref = copy.deepcopy(model).double()
    table = dict(ref.named_modules())
    keep = [(a, w) for a, w in zip(adapters, weights) if w]
    with torch.no_grad():
        for name in (adapters[0].modules if keep else ()):
            table[name].weight += dense_reference([a for a, _ in keep], [w for _, w in keep], name)
    return ref


def _gold_logprob(model, prompt, gold):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + gold])).logits[0].double(), -1)
    return float(torch.stack([logp[len(prompt) - 1 + j, t] for j, t in enumerate(gold)]).mean())


def test_combine_and_no_adapter_rows_equal_a_hand_built_reference(tmp_path):
    """The Combine prompt holds every retrieved passage; a Combine row's gold log-lik. equals a dense float64 copy
    with the merged update under a prompt written by hand; vanilla / standard_rag run the base model (no slot
    write, base weights bit-identical)."""
    from helpers import state_snapshot

    model = tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0)
    tok = tiny_tokenizer()
    ads = {f"p{i}": LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"p{i}", seed=i)) for i in range(3)}
    texts = ["paris : paris is the capital of france .", "berlin : the river of berlin .", "rome : a city in italy ."]
    qs = {"a": {"question": "what is the capital of france ?", "answers": ["paris"],
                "passages": [{"pid": f"p{i}", "text": t} for i, t in enumerate(texts)]}}
    pids = ["p0", "p1", "p2"]
    rows = [scoring.Row("a", "recommended_combine", pids, [2.0, 0.5, 1.0], "combine"),
            scoring.Row("a", "standard_rag", pids, [0.0, 0.0, 0.0], "combine"),
            scoring.Row("a", "vanilla", pids, [0.0, 0.0, 0.0], "param")]
    by_hand = {"combine": "Answer the question with a short answer, using the passages below and your own knowledge."
                          "\n" + "\n".join(f"Passage {i + 1}: {t}" for i, t in enumerate(texts)) +
                          "\nQuestion: what is the capital of france ?\nThe answer is",
               "param": "Answer the question with a short answer.\nQuestion: what is the capital of france ?\n"
                        "The answer is"}
    prompts = {m: tok(text)["input_ids"] for m, text in by_hand.items()}
    for m, ids in prompts.items():
        got, _ = scoring.encode(tok, qs["a"]["question"], ["paris"], texts, m)
        assert got == ids
    decoded = tok.decode(prompts["combine"])
    assert all(tok.decode(tok(t, add_special_tokens=False)["input_ids"]) in decoded for t in texts)
    snap = state_snapshot(model)
    slot = FusedSlot.for_model(model, ads["p0"], max_adapters=3, max_rank=2)
    active_during = []
    hook = model.register_forward_pre_hook(lambda mod, args: active_during.append(slot.active))
    try:
        base = scoring.score(model, tok, slot, rows[1:], qs, ads.__getitem__, generate=False, batch_size=4)
        assert active_during and not any(active_during)  # no adapter was on for the base-model rows
        got = scoring.score(model, tok, slot, rows, qs, ads.__getitem__, generate=False, batch_size=4)
    finally:
        hook.remove()
        slot.remove()
    assert_bit_identical(model, snap)
    gold = tok(" paris", add_special_tokens=False)["input_ids"]
    for r, g in zip(rows, got):
        ref = _dense_copy(model, [ads[p] for p in r.pids], r.weights)
        assert g["logprob"] == pytest.approx(_gold_logprob(ref, prompts[r.prompt], gold), abs=1e-4), r.name
        assert g["prompt"] == r.prompt and g["w"] == r.weights
    assert [b["logprob"] for b in base] == pytest.approx([g["logprob"] for g in got[1:]], abs=1e-6)
