"""TextEncoder: offline model resolution, normalization, LRU cache."""

import pytest
import torch

from fcprag_plugin.encoding import DEFAULT_MODEL, TextEncoder, fallback_model_path, resolve_model
from fcprag_plugin.errors import EncoderError


def _counting_encoder(dim=8, cache_size=8192):
    calls = []

    def fn(texts):
        calls.append(list(texts))
        return torch.stack([torch.arange(dim, dtype=torch.float32) + len(t) for t in texts])

    return TextEncoder.from_function(fn, dim, "count", cache_size=cache_size), calls


def test_cache_avoids_reencoding_and_normalizes():
    enc, calls = _counting_encoder()
    a = enc.encode(["x", "yy", "x"])
    b = enc.encode(["yy", "zzz"])
    assert calls == [["x", "yy"], ["zzz"]]
    torch.testing.assert_close(a[1], b[0])
    torch.testing.assert_close(a.norm(dim=-1), torch.ones(3))


def test_lru_evicts_oldest():
    enc, calls = _counting_encoder(cache_size=2)
    enc.encode(["a", "b"])
    enc.encode(["a"])  # a is now most recent
    enc.encode(["c"])  # evicts b
    enc.encode(["a", "b"])
    assert calls[-1] == ["b"]


def test_bad_encoder_output_and_input():
    enc = TextEncoder.from_function(lambda t: torch.zeros(len(t), 3), 4, "bad")
    with pytest.raises(EncoderError, match=r"'bad' returned shape \[1, 3\], expected \[1, 4\]"):
        enc.encode(["a"])
    with pytest.raises(EncoderError, match=r"text 1 is a int"):
        enc.encode(["a", 3])


def test_resolution_prefers_explicit_then_default_then_fallback(tmp_path):
    name, path = resolve_model(tmp_path)
    assert path == str(tmp_path)
    name, path = resolve_model(None)
    if name == DEFAULT_MODEL:  # the paper's model happens to be cached on this machine
        return
    assert path == fallback_model_path() and "all-MiniLM-L6-v2" in name


@pytest.mark.integration
def test_packaged_fallback_model_offline():
    enc = TextEncoder()
    e = enc.encode(["Paris is the capital of France.", "The capital of France is Paris.", "Bananas are yellow."])
    assert e.shape == (3, enc.dim) and enc.dim in (384, 768)
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(3), atol=1e-5, rtol=0)
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.2


def test_unloadable_model_named(tmp_path):
    (tmp_path / "junk").mkdir()
    with pytest.raises(EncoderError, match=r"cannot load embedding model .*junk"):
        TextEncoder(tmp_path / "junk")


def test_recorded_fallback_name_resolves_offline():
    """A controller trained offline records the fallback's hub name; loading it later must stay offline."""
    from fcprag_plugin.encoding import FALLBACK_NAME, _local_hub_snapshot

    if _local_hub_snapshot(FALLBACK_NAME) is not None or fallback_model_path() is None:
        pytest.skip("the hub copy is cached here, or the fallback package is missing")
    name, path = resolve_model(FALLBACK_NAME)
    assert name == FALLBACK_NAME and path == fallback_model_path()
