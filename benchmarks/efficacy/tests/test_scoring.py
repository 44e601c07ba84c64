"""The efficacy study's batched scorer equals scoring each weighting alone with the library's reference path
(merged adapter activated by hooks + the label builder's answer_logprob / greedy_generate)."""

from __future__ import annotations

import pytest
import torch

from helpers import make_adapter_dir, tiny_model, tiny_tokenizer

from fusion_eval import TEMPLATE, FusionScorer, distinct

QUESTION = "what is the capital of france ?"
PASSAGES = ["paris is the capital of france .", "berlin is a city in germany .", "rome is in italy ."]


@pytest.fixture()
def setup(tmp_path):
    from fcprag_plugin import LoraAdapter

    model = tiny_model("llama", seed=3, bos_token_id=2, eos_token_id=3, pad_token_id=0).eval()
    tok = tiny_tokenizer()
    tok.chat_template = None
    adapters = [LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"a{i}", seed=i)) for i in range(3)]
    return model, tok, adapters


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["param", "combine"])
def test_rows_equal_each_weighting_alone(setup, mode):
    from fcprag_plugin import WeightedAdapterMerger
    from fcprag_tools.label_builder.metrics import answer_logprob, extract_answer, greedy_generate
    from fcprag_tools.label_builder.prompts import answer_ids
    from fcprag_plugin import activate

    model, tok, adapters = setup
    W = torch.tensor([[1.0, 1.0, 1.0], [0.2, 2.5, 0.3], [0.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
    scorer = FusionScorer(model, tok, adapters[0], max_adapters=3, max_new_tokens=5)
    got = scorer.score(QUESTION, PASSAGES, ["paris"], mode, adapters, W)
    scorer.slot.remove()
    prompt = scorer.prompt(QUESTION, PASSAGES, mode)
    gold = answer_ids(tok, prompt, "paris")
    for r in range(W.shape[0]):
        merged = WeightedAdapterMerger("cat").merge(adapters, W[r].tolist()).adapter
        with activate(model, merged):
            lp = answer_logprob(model, prompt.ids, gold)
            gen = greedy_generate(model, tok, prompt.ids, 5)
        assert got[r].logprob == pytest.approx(lp, abs=1e-4)
        assert got[r].prediction == extract_answer(gen, False)
    assert len({round(g.logprob, 4) for g in got}) > 1  # the weightings really differ


def test_repeated_passage_weights_add_up():
    pids, w = ["a", "b", "a"], torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.0, 0.5]])
    order, W = distinct(pids, w)
    assert order == ["a", "b"]
    torch.testing.assert_close(W, torch.tensor([[4.0, 2.0], [1.0, 0.0]]))


def test_template_is_the_label_builders_default():
    from fcprag_tools.label_builder.prompts import PromptTemplate

    assert TEMPLATE == PromptTemplate()
