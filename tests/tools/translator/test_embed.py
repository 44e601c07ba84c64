"""Passage embeddings as DyPRAG reads them (the passage alone, last layer after the final norm, last token): batched
and left-padded equal one passage at a time and DyPRAG's own read; the generated updates, their cache and seconds."""

from __future__ import annotations

import pytest
import torch

from fcprag_plugin import LoraAdapter
from fcprag_tools.translator import (Translator, TranslatorError, TranslatorShape, generate_adapters,
                                     passage_embeddings)
from helpers import tiny_model, tiny_tokenizer

from .double import dyprag_embedding

TEXTS = ["paris is the capital of france", "the river seine", "berlin",
         "rome is a city in italy and the king was born in the year 1 . the tower and the bridge are old"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batched_embeddings_equal_one_passage_at_a_time_and_dyprags_read(kind):
    model, tok = tiny_model(kind, bos_token_id=2, eos_token_id=3, pad_token_id=0), tiny_tokenizer()
    got = passage_embeddings(model, tok, TEXTS, batch_size=4)  # lengths 2..24 tokens: real left padding
    alone = torch.cat([passage_embeddings(model, tok, [t]) for t in TEXTS])
    ref = torch.cat([dyprag_embedding(model, tok, t) for t in TEXTS])
    assert got.shape == (4, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    # batches of similar lengths (2 and 4 tokens, then 7 and 24), put back in the passages' order
    torch.testing.assert_close(passage_embeddings(model, tok, TEXTS, batch_size=2), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, ref, rtol=0, atol=1e-6)
    assert (got[0] - got[1]).abs().max() > 1e-2  # different passages, different embeddings
    # the final norm is in: every embedding has the norm's scale (RMSNorm weight 1: mean square 1)
    torch.testing.assert_close(got.pow(2).mean(1), torch.ones(4), rtol=0, atol=1e-2)  # before it: about 3e-4


def test_a_passage_is_tokenized_alone_with_the_tokenizers_special_tokens():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    with_bos = dyprag_embedding(model, tok, "paris")  # the tiny tokenizer prepends <s>, as Llama-3's does
    assert tok("paris")["input_ids"][0] == 2
    torch.testing.assert_close(passage_embeddings(model, tok, ["paris"]), with_bos, rtol=0, atol=1e-6)
    no_bos = model(torch.tensor([tok("paris", add_special_tokens=False)["input_ids"]]),
                   output_hidden_states=True).hidden_states[-1][:, -1]
    assert (no_bos - with_bos).abs().max() > 1e-3


def test_generated_adapters_are_the_translators_factors_with_scaling_one_cached_per_passage(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tr = Translator(TranslatorShape.from_config(model.config, width=8), seed=1, init_std=0.1)
    passages = {f"p{i}": t for i, t in enumerate(TEXTS)}
    cache: dict = {}
    ads, secs = generate_adapters(model, tok, tr, {k: passages[k] for k in ("p0", "p1")}, batch_size=2, cache=cache)
    assert set(cache) == {"p0", "p1"} and set(secs) == {"p0", "p1"} and secs["p0"] == secs["p1"] > 0
    ads2, secs2 = generate_adapters(model, tok, tr, passages, batch_size=3, cache=cache)
    assert set(secs2) == {"p2", "p3"} and ads2["p0"] is ads["p0"] and list(ads2) == list(passages)
    with torch.no_grad():
        factors = tr(passage_embeddings(model, tok, TEXTS))
    for j, pid in enumerate(passages):
        a = ads2[pid]
        assert len(a.modules) == 6 and all(m.scaling == 1.0 for m in a.modules.values())
        for path, (A, B) in factors.items():
            torch.testing.assert_close(a.modules[path].A, A[j], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a.modules[path].B, B[j], rtol=1e-5, atol=1e-6)
    back = LoraAdapter.from_pretrained(ads2["p3"].save_pretrained(tmp_path / "p3"))  # kept per passage id
    for path, m in ads2["p3"].modules.items():
        assert torch.equal(back.modules[path].A, m.A) and back.modules[path].scaling == 1.0


def test_a_passage_without_tokens_is_named():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok_no_bos = lambda text, **kw: {"input_ids": []}  # noqa: E731
    tok_no_bos.pad_token_id = 0
    tr = Translator(TranslatorShape.from_config(model.config, width=4))
    with pytest.raises(TranslatorError, match="passage 'empty' tokenizes to no tokens"):
        generate_adapters(model, tok_no_bos, tr, {"empty": ""})
    assert tok  # the real tokenizer is not needed for this error
