"""WeightedAdapterMerger modes against independent references, live activation, and error paths."""

import pytest
import torch

from fcprag_plugin import LoraAdapter, MergeError, WeightedAdapterMerger, activate
from fcprag_plugin.merge import MERGE_MODES, merge_adapters
from helpers import assert_bit_identical, dense_reference, make_adapter_dir, state_snapshot, tiny_model

GATE = "model.layers.0.mlp.gate_proj"


def _load(dirs):
    return [LoraAdapter.from_pretrained(d) for d in dirs]


@pytest.fixture
def mixed_rank_dirs(tmp_path):
    return [make_adapter_dir(tmp_path / f"p{i}", r=r, alpha=a, seed=10 + i)
            for i, (r, a) in enumerate([(2, 32), (4, 8), (1, 16)])]


def test_registry_has_modes():
    assert {"cat", "separate", "svd"} <= set(MERGE_MODES)


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.1235, 0.8864, 0.9901], [2.5, 0.0, 0.5]])
def test_cat_equals_dense_reference(mixed_rank_dirs, weights):
    ads = _load(mixed_rank_dirs)
    res = WeightedAdapterMerger("cat").merge(ads, weights)
    for name in ads[0].modules:
        m = res.adapter[name]
        assert m.rank == 2 + 4 + 1 and m.scaling == 1.0
        torch.testing.assert_close(m.delta(torch.float64), dense_reference(ads, weights, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [0.7, 1.6, 0.7]])
def test_cat_equals_peft_add_weighted_adapter(tmp_path, kind, weights):
    """PRAG's merge: peft's add_weighted_adapter(..., combination_type="cat") on the same stack."""
    from peft import PeftModel

    dirs = [make_adapter_dir(tmp_path / f"p{i}", kind=kind, seed=i) for i in range(3)]
    pm = PeftModel.from_pretrained(tiny_model(kind), str(dirs[0]), adapter_name="0")
    for i in (1, 2):
        pm.load_adapter(str(dirs[i]), adapter_name=str(i))
    pm.add_weighted_adapter(adapters=["0", "1", "2"], weights=weights, adapter_name="merge", combination_type="cat")
    peft_merged = LoraAdapter.from_peft_model(pm, "merge")
    ours = WeightedAdapterMerger("cat").merge(_load(dirs), weights).adapter
    assert set(peft_merged.modules) == set(ours.modules)
    for name in ours.modules:
        torch.testing.assert_close(ours[name].delta(), peft_merged[name].delta(), rtol=1e-5, atol=1e-6)


def test_cat_uniform_default_is_sum(adapter_dirs):
    ads = _load(adapter_dirs)
    res = WeightedAdapterMerger().merge(ads)
    assert res.merge_weights == (1.0, 1.0, 1.0)
    torch.testing.assert_close(res.adapter[GATE].delta(torch.float64), dense_reference(ads, [1, 1, 1], GATE))


def test_separate_equals_dyprag_mean_formula(adapter_dirs):
    """Uniform separate == DyPRAG: mean(B) @ mean(A) (with the per-adapter scaling folded into A)."""
    ads = _load(adapter_dirs)
    res = WeightedAdapterMerger("separate").merge(ads, [1.0, 1.0, 1.0])
    for name in ads[0].modules:
        s = ads[0][name].scaling
        mean_a = torch.stack([a[name].A.double() for a in ads]).mean(0)
        mean_b = torch.stack([a[name].B.double() for a in ads]).mean(0)
        torch.testing.assert_close(res.adapter[name].delta(torch.float64), s * mean_b @ mean_a, rtol=1e-5, atol=1e-6)


def test_separate_weighted_has_cross_terms(adapter_dirs):
    ads = _load(adapter_dirs)
    w = torch.tensor([1.5, 0.5, 1.0])
    u = (w / 3).double()
    res = WeightedAdapterMerger("separate").merge(ads, w)
    ref_a = sum(u[i] * ads[i][GATE].scaling * ads[i][GATE].A.double() for i in range(3))
    ref_b = sum(u[i] * ads[i][GATE].B.double() for i in range(3))
    torch.testing.assert_close(res.adapter[GATE].delta(torch.float64), ref_b @ ref_a, rtol=1e-5, atol=1e-6)
    # ...which is not the weighted mean of updates (the cross terms make the difference)
    mean_updates = dense_reference(ads, (u).tolist(), GATE)
    assert (res.adapter[GATE].delta(torch.float64) - mean_updates).abs().max() > 1e-3


def test_separate_rejects_mixed_ranks(mixed_rank_dirs):
    with pytest.raises(MergeError, match=r"'separate' needs equal ranks.*ranks \[2, 4, 1\]"):
        WeightedAdapterMerger("separate").merge(_load(mixed_rank_dirs))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_svd_matches_dense_truncated_svd(mixed_rank_dirs, k):
    ads = _load(mixed_rank_dirs)
    w = [1.2, 0.6, 1.1]
    res = WeightedAdapterMerger("svd", rank=k).merge(ads, w)
    num = den = 0.0
    for name in ads[0].modules:
        dense = dense_reference(ads, w, name)
        U, S, Vh = torch.linalg.svd(dense)
        best = (U[:, :k] * S[:k]) @ Vh[:k]
        got = res.adapter[name].delta(torch.float64)
        assert res.adapter[name].rank == k
        torch.testing.assert_close(got, best, rtol=1e-4, atol=1e-5)
        err = float((dense - got).norm())
        torch.testing.assert_close(torch.tensor(res.info["rel_error_per_module"][name]),
                                   torch.tensor(err / float(dense.norm())), rtol=1e-3, atol=1e-6)
        num, den = num + err ** 2, den + float(dense.norm()) ** 2
    assert res.info["rel_error"] == pytest.approx((num / den) ** 0.5, rel=1e-3, abs=1e-6)
    if k == 7:  # full rank: exact
        assert res.info["rel_error"] < 1e-6


def test_merged_adapter_save_roundtrip_in_peft(tmp_path, mixed_rank_dirs):
    from peft import PeftModel

    ads = _load(mixed_rank_dirs)
    res = WeightedAdapterMerger("cat").merge(ads, [0.5, 1.5, 1.0])
    out = res.adapter.save_pretrained(tmp_path / "merged")
    pm = PeftModel.from_pretrained(tiny_model(), str(out), adapter_name="m")
    live = LoraAdapter.from_peft_model(pm, "m")
    for name in ads[0].modules:
        torch.testing.assert_close(live[name].delta(torch.float64), dense_reference(ads, [0.5, 1.5, 1.0], name),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_activate_matches_peft_forward_and_restores_bit_for_bit(tmp_path, kind):
    from peft import PeftModel

    dirs = [make_adapter_dir(tmp_path / f"p{i}", kind=kind, seed=i) for i in range(3)]
    w = [1.3, 0.4, 1.3]
    merged = WeightedAdapterMerger("cat").merge(_load(dirs), w).adapter
    x = torch.randint(0, 128, (2, 7))
    base = tiny_model(kind)
    snap = state_snapshot(base)
    with torch.no_grad():
        plain = base(x).logits
        with activate(base, merged):
            ours = base(x).logits
        after = base(x).logits
    assert_bit_identical(base, snap)
    assert torch.equal(after, plain)
    # reference: peft's own merge of the same adapters, on a separate copy of the base model
    pm = PeftModel.from_pretrained(tiny_model(kind), str(dirs[0]), adapter_name="0")
    for i in (1, 2):
        pm.load_adapter(str(dirs[i]), adapter_name=str(i))
    pm.add_weighted_adapter(["0", "1", "2"], w, "merge", combination_type="cat")
    pm.set_adapter("merge")
    with torch.no_grad():
        ref = pm(x).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-3  # the adapter really did something


def test_activate_on_peft_model_hooks_base_layer(tmp_path, adapter_dirs):
    from peft import PeftModel

    ads = _load(adapter_dirs)
    merged = WeightedAdapterMerger("cat").merge(ads).adapter
    pm = PeftModel.from_pretrained(tiny_model(), str(adapter_dirs[0]), adapter_name="0")
    x = torch.randint(0, 128, (1, 5))
    snap = state_snapshot(pm)
    with torch.no_grad(), pm.disable_adapter():
        base_out = pm(x).logits
    with torch.no_grad():
        with pm.disable_adapter(), activate(pm, merged):
            ours = pm(x).logits
    plain = tiny_model()
    with torch.no_grad(), activate(plain, merged):
        ref = plain(x).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours, base_out)
    assert_bit_identical(pm, snap)


# ----------------------------------------------------------------------------- error paths
def test_weights_errors(adapter_dirs):
    ads = _load(adapter_dirs)
    m = WeightedAdapterMerger("cat")
    with pytest.raises(MergeError, match=r"finite.*nan"):
        m.merge(ads, [1.0, float("nan"), 1.0])
    with pytest.raises(MergeError, match=r"shape \[2\], expected \[3\]"):
        m.merge(ads, [1.0, 1.0])
    with pytest.raises(MergeError, match=r"N == 0"):
        m.merge([], [])


def test_unknown_mode():
    with pytest.raises(MergeError, match=r"unknown merge mode 'avg'.*cat"):
        WeightedAdapterMerger("avg")


def test_incompatible_targets_named(tmp_path):
    a = LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / "a"))
    b = LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / "b", targets=["gate_proj", "up_proj"]))
    with pytest.raises(MergeError, match=r"adapter 1 \(.*b\).*adapter 0 \(.*a\).*different modules.*down_proj"):
        merge_adapters([a, b], [1, 1])


def test_incompatible_shapes_named(tmp_path):
    a = LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / "a"))
    big = make_adapter_dir(tmp_path / "b", kind="llama")
    b = LoraAdapter.from_pretrained(big)
    b.modules[GATE].A = torch.randn(2, 40)
    b.modules[GATE].B = torch.randn(48, 2)
    with pytest.raises(MergeError, match=rf"module '{GATE}'.*\[48, 40\].*\[48, 32\]"):
        merge_adapters([a, b], [1, 1])


def test_activate_wrong_model_named(adapter_dirs):
    merged = WeightedAdapterMerger().merge(_load(adapter_dirs)).adapter
    other = tiny_model(hidden_size=64, intermediate_size=96)
    snap = state_snapshot(other)
    with pytest.raises(MergeError, match=r"module 'model\.layers\.0\.mlp\.down_proj'.*\[64, 96\].*\[32, 48\]"):
        activate(other, merged)
    x = torch.randint(0, 128, (1, 4))
    assert all(len(m._forward_hooks) == 0 for m in other.modules())  # nothing left behind
    assert_bit_identical(other, snap)
