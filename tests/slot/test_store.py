"""AdapterStore: contents equal the library loader, LRU eviction by bytes, mtime invalidation, clear errors."""

import logging
import os

import pytest
import torch

from fcprag_plugin import AdapterError, LoraAdapter
from fcprag_plugin.slot import AdapterStore, pack_adapter, read_adapter_dir
from fcprag_plugin.slot.store import _mmap_tensors
from helpers import make_adapter_dir


def assert_equal_adapters(got: LoraAdapter, want: LoraAdapter):
    assert set(got.modules) == set(want.modules)
    for k, w in want.modules.items():
        g = got.modules[k]
        assert torch.equal(g.A, w.A) and torch.equal(g.B, w.B) and g.scaling == w.scaling, k


@pytest.fixture
def dirs(tmp_path):
    return [make_adapter_dir(tmp_path / f"p{i}", seed=i) for i in range(4)]


def test_packed_equals_loader(tmp_path):
    d = make_adapter_dir(tmp_path / "mixed", r=3, alpha=12, seed=5, rank_pattern={"down_proj": 1},
                         alpha_pattern={"down_proj": 7})
    want = LoraAdapter.from_pretrained(d)
    store = AdapterStore()
    packed = store.get(d)
    assert packed.source == str(d)
    assert_equal_adapters(packed.to_lora(), want)
    # layout: one group per (pattern, shape), layers in order; the down_proj group is rank-1 with alpha 7
    pats = [g.pattern for g in packed.layout.groups]
    assert pats == sorted(pats) and all(len(g.names) == 2 for g in packed.layout.groups)
    down = pats.index("model.layers.*.mlp.down_proj")
    assert packed.groups[down].rank == 1 and packed.groups[down].scale == 7.0
    assert packed.layout is pack_adapter(want).layout  # interned: same modules -> same layout object
    assert packed.nbytes == want.num_bytes()


def test_lru_eviction_by_byte_budget(dirs):
    one = AdapterStore().get(dirs[0]).nbytes
    store = AdapterStore(budget_bytes=2 * one + one // 2)  # room for two
    for d in dirs[:3]:
        store.get(d)
    assert store.keys() == [str(dirs[1]), str(dirs[2])]  # dirs[0] was the least recently used
    assert store.stats.evictions == 1 and store.stats.misses == 3 and store.nbytes == 2 * one
    assert store.get(dirs[1]) is store.get(dirs[1])  # hits return the cached object
    assert store.stats.hits == 2
    store.get(dirs[0])  # evicts dirs[2], now the least recently used
    assert store.keys() == [str(dirs[1]), str(dirs[0])]
    assert dirs[2] not in store and dirs[0] in store
    assert store.nbytes <= store.budget_bytes
    assert store.invalidate(dirs[0]) and not store.invalidate(dirs[0]) and len(store) == 1
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def test_larger_than_budget_is_returned_not_cached(dirs, caplog):
    store = AdapterStore(budget_bytes=100)
    with caplog.at_level(logging.WARNING, logger="fcprag_plugin"):
        packed = store.get(dirs[0])
    assert packed.nbytes > 100 and len(store) == 0 and store.stats.uncached == 1
    assert str(dirs[0]) in caplog.text and "more than the store's whole budget of 100 bytes" in caplog.text


def test_mtime_invalidation(tmp_path):
    d = make_adapter_dir(tmp_path / "p", seed=1)
    store = AdapterStore()
    old = store.get(d)
    st = os.stat(d / "adapter_model.safetensors")
    make_adapter_dir(d, seed=2)  # rewritten in place (same size): only the mtime tells
    os.utime(d / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    new = store.get(d)
    assert new is not old and store.stats.reloads == 1 and len(store) == 1
    assert_equal_adapters(new.to_lora(), LoraAdapter.from_pretrained(d))
    assert not torch.equal(new.groups[0].A, old.groups[0].A)
    # a config change (e.g. alpha) is noticed too
    cfg = d / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"lora_alpha": 32', '"lora_alpha": 64'))
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert store.get(d).groups[0].scale == 32.0 and store.stats.reloads == 2


def test_check_mtime_off_trusts_the_cache(tmp_path):
    d = make_adapter_dir(tmp_path / "p", seed=1)
    store = AdapterStore(check_mtime=False)
    old = store.get(d)
    make_adapter_dir(d, seed=2)
    os.utime(d / "adapter_model.safetensors", ns=(0, 10**18))
    assert store.get(d) is old


def test_dtype_placement(dirs):
    packed = AdapterStore(dtype=torch.float64, device="cpu").get(dirs[0])
    assert packed.dtype == torch.float64 and packed.device == torch.device("cpu")
    want = LoraAdapter.from_pretrained(dirs[0])
    k = packed.layout.groups[0].names[0]
    assert torch.equal(packed.to_lora()[k].A, want[k].A.double())


def test_errors_name_the_file(tmp_path, dirs):
    store = AdapterStore()
    with pytest.raises(AdapterError, match=r"nowhere: adapter directory not found"):
        store.get(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match=r"empty/adapter_config.json: adapter config not found"):
        store.get(tmp_path / "empty")
    (dirs[1] / "adapter_model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(AdapterError, match=r"p1/adapter_model.safetensors: corrupt or unreadable safetensors"):
        store.get(dirs[1])
    (dirs[2] / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"p2: no adapter weights found"):
        read_adapter_dir(dirs[2])
    with pytest.raises(AdapterError, match="budget_bytes must be a non-negative integer, got -1"):
        AdapterStore(budget_bytes=-1)
    assert len(store) == 0


def _rewrite(d, edit):
    from safetensors.torch import load_file, save_file

    f = d / "adapter_model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


def test_bulk_value_checks_name_the_key(tmp_path, caplog):
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    bad = make_adapter_dir(tmp_path / "nan", seed=1)
    _rewrite(bad, lambda sd: sd[key].__setitem__((3, 1), float("nan")))
    with pytest.raises(AdapterError, match=r"nan: key 'model.layers.1.mlp.up_proj.lora_B.weight' has 1 non-finite"):
        AdapterStore().get(bad)
    inf = make_adapter_dir(tmp_path / "inf", seed=1)
    _rewrite(inf, lambda sd: sd[key.replace("lora_B", "lora_A")].__setitem__((0, 0), float("-inf")))
    with pytest.raises(AdapterError, match=r"key 'model.layers.1.mlp.up_proj.lora_A.weight' has 1 non-finite"):
        AdapterStore().get(inf)
    big = make_adapter_dir(tmp_path / "big", seed=1)
    _rewrite(big, lambda sd: sd[key].__setitem__((0, 0), 1e30))
    with pytest.raises(AdapterError, match=r"big: modules 'model.layers.\*.mlp.up_proj' overflow torch.float16"):
        AdapterStore(dtype=torch.float16).get(big)
    zero = make_adapter_dir(tmp_path / "zero", seed=1, zero_b=True)
    with caplog.at_level(logging.WARNING, logger="fcprag_plugin"):
        AdapterStore().get(zero)
    assert "zero: every lora_B is zero" in caplog.text


def test_mapped_reader_equals_library_loader(tmp_path):
    """The memory-mapped fast path and the safe_open fallback give the library loader's tensors."""
    for name, kw in {"bf16": dict(dtype=torch.bfloat16), "f32": {}}.items():
        d = make_adapter_dir(tmp_path / name, seed=4, **kw)
        got = read_adapter_dir(d)
        assert_equal_adapters(got, LoraAdapter.from_pretrained(d))
        mapped = _mmap_tensors(d / "adapter_model.safetensors")  # the fast path, not a silent fallback
        assert len(mapped) == 12 and len({t.untyped_storage().data_ptr() for t in mapped.values()}) == 1
        assert got.dtype == (torch.bfloat16 if name == "bf16" else torch.float32)
    # an integer tensor is not for the fast path: the fallback loads it and the loader names it
    d = make_adapter_dir(tmp_path / "int", seed=4)
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    _rewrite(d, lambda sd: sd.__setitem__(key, torch.ones(2, 32, dtype=torch.int64)))
    with pytest.raises(AdapterError, match=r"key 'model.layers.0.mlp.gate_proj.lora_A.weight' has dtype torch.int64"):
        AdapterStore().get(d)
