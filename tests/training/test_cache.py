"""The on-disk embedding cache: no re-encoding across runs, per-model separation, clear errors."""

import pytest
import torch

from fcprag_plugin.errors import EncoderError
from fcprag_plugin.training.data import build_tensors
from fcprag_plugin.training.embed_cache import EmbeddingCache, embed_texts
from fcprag_plugin.labels import LabelRecord
from helpers import hash_embed


def counting_encoder(calls, dim=16, name="hash-16"):
    from fcprag_plugin.encoding import TextEncoder

    def fn(texts):
        calls.extend(texts)
        return hash_embed(texts, dim)

    return TextEncoder.from_function(fn, dim, name=name)


def no_encoder():
    raise AssertionError("the encoder must not be loaded when everything is cached")


def ref_of(text):
    return torch.nn.functional.normalize(hash_embed([text], 16), dim=-1)[0]


def test_second_run_encodes_nothing_and_returns_identical_embeddings(tmp_path):
    texts = ["alpha beta", "gamma", "alpha beta", "delta epsilon zeta"]
    calls = []
    first = embed_texts(texts, counting_encoder(calls), EmbeddingCache(tmp_path, "hash-16"))
    assert sorted(calls) == sorted(set(texts))  # each distinct text once
    ref = torch.nn.functional.normalize(hash_embed(texts, 16), dim=-1)
    assert torch.allclose(first, ref, atol=1e-6)

    calls2 = []  # a new process: fresh encoder (empty in-memory LRU), cache re-read from disk
    again = embed_texts(texts, counting_encoder(calls2), EmbeddingCache(tmp_path, "hash-16"))
    assert calls2 == []
    assert torch.equal(again, first)

    calls3 = []  # only the new text is encoded; the one file holds all four, the old rows as they were
    embed_texts(texts + ["brand new"], counting_encoder(calls3), EmbeddingCache(tmp_path, "hash-16"))
    assert calls3 == ["brand new"]
    cache = EmbeddingCache(tmp_path, "hash-16")
    assert len(cache) == 4 and [p.name for p in tmp_path.iterdir()] == [cache.path.name]
    assert torch.equal(embed_texts(texts, no_encoder, cache), first)  # the old rows as they were
    assert torch.equal(embed_texts(["brand new"], no_encoder, cache)[0], ref_of("brand new"))


def test_fully_cached_run_never_builds_the_encoder(tmp_path):
    embed_texts(["a b", "c"], counting_encoder([]), EmbeddingCache(tmp_path, "hash-16"))

    out = embed_texts(["c", "a b"], no_encoder, EmbeddingCache(tmp_path, "hash-16"))
    assert out.shape == (2, 16)
    assert EmbeddingCache(tmp_path, "hash-16").dim == 16  # the dimension comes from the file


def test_models_do_not_share_entries_and_names_must_match(tmp_path):
    embed_texts(["same text"], counting_encoder([]), EmbeddingCache(tmp_path, "hash-16"))
    calls = []
    embed_texts(["same text"], counting_encoder(calls, name="other-model"), EmbeddingCache(tmp_path, "other-model"))
    assert calls == ["same text"]
    with pytest.raises(EncoderError, match="encoder 'other-model' does not match the cache's model 'hash-16'"):
        embed_texts(["unseen"], counting_encoder([], name="other-model"), EmbeddingCache(tmp_path, "hash-16"))


def test_dimension_mismatch_and_a_corrupt_file_name_the_file(tmp_path):
    embed_texts(["x"], counting_encoder([]), EmbeddingCache(tmp_path, "hash-16"))
    path = EmbeddingCache(tmp_path, "hash-16").path
    with pytest.raises(EncoderError, match=rf"{path.name}: tensors 'keys' / 'emb' are \[\[1, 32\], \[1, 16\]\]; "
                                           r"expected \[M, 32\] and \[M, 32\] \(model 'hash-16'\): delete the file"):
        EmbeddingCache(tmp_path, "hash-16", dim=32)
    with pytest.raises(EncoderError, match=rf"encoder 'hash-16' gives 32-d embeddings but the cache {path} holds 16-d"):
        embed_texts(["y"], counting_encoder([], dim=32), EmbeddingCache(tmp_path, "hash-16"))
    assert len(EmbeddingCache(tmp_path, "hash-16")) == 1  # the file was left as it was
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(EncoderError, match=rf"{path.name}: corrupt or unreadable safetensors file"):
        EmbeddingCache(tmp_path, "hash-16")


def test_build_tensors_uses_the_cache_and_pads(tmp_path):
    recs = [LabelRecord("a", "q one", ["p1", "p2", "p3"], [0.1, 0.5, 0.0]),
            LabelRecord("b", "q two", ["p2"], [0.2])]
    calls = []
    t = build_tensors(recs, counting_encoder(calls), EmbeddingCache(tmp_path, "hash-16"))
    assert sorted(calls) == sorted({"q one", "q two", "p1", "p2", "p3"})
    assert t.mask.tolist() == [[True, True, True], [True, False, False]]
    assert torch.allclose(t.deltas, torch.tensor([[0.1, 0.5, 0.0], [0.2, 0.0, 0.0]]))
    ref = torch.nn.functional.normalize(hash_embed(["q two", "p2"], 16), dim=-1)
    b = t.batch(torch.tensor([1]))
    assert b.E_p.shape == (1, 1, 16)  # trimmed to the longest record in the batch
    assert torch.allclose(b.e_q[0], ref[0], atol=1e-6) and torch.allclose(b.E_p[0, 0], ref[1], atol=1e-6)
    calls.clear()
    build_tensors(recs, counting_encoder(calls), EmbeddingCache(tmp_path, "hash-16"))
    assert calls == []
