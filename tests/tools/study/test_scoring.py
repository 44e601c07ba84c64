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
from fcprag_tools.study.pipeline import Study
from helpers import make_adapter_dir, tiny_model, tiny_tokenizer


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
    w = Study.oracle(done, "q", 2)
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
