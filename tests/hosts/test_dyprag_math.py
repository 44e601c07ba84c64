"""The DyPRAG shim's math: alignment check and the weighted ``separate`` / ``delta`` aggregations, against
float64 references written out here."""

from __future__ import annotations

import re

import pytest
import torch

from fcprag_plugin.errors import HookError
from fcprag_plugin.hosts import _dyprag_math as dm

PFX = "base_model.model.model.layers.{i}.mlp.{p}"


def make_outputs(n: int, r: int = 2, d_in: int = 5, d_out: int = 7, batch: tuple = (), seed: int = 0,
                 dtype=torch.float32) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(n):
        o = {}
        for i in range(2):
            for p in ("gate_proj", "down_proj"):
                o[PFX.format(i=i, p=p) + ".lora_A.weight"] = torch.randn(*batch, r, d_in, generator=g).to(dtype)
                o[PFX.format(i=i, p=p) + ".lora_B.weight"] = torch.randn(*batch, d_out, r, generator=g).to(dtype)
        outs.append(o)
    return outs


def dyprag_mean(outs):
    return {k: torch.stack([o[k] for o in outs]).mean(dim=0) for k in outs[0]}


def weights(n, seed=1):
    w = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.1
    return (w / w.sum()).tolist()


def modules(outs):
    return sorted({k.rsplit(".", 2)[0] for k in outs[0]})


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("batch", [(), (1,)])
def test_separate_is_weighted_sum_of_factors(n, batch):
    outs, u = make_outputs(n, batch=batch), weights(n)
    got = dm.aggregate(outs, u, "separate")
    assert list(got) == list(outs[0])
    for k in outs[0]:
        ref = sum(w * o[k].double() for w, o in zip(u, outs))
        assert got[k].dtype == torch.float32 and got[k].shape == outs[0][k].shape
        torch.testing.assert_close(got[k].double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4, 5])
@pytest.mark.parametrize("batch", [(), (1,)])
def test_delta_is_exact_weighted_mean_of_updates(n, batch):
    outs, u = make_outputs(n, r=3, batch=batch), weights(n, seed=n)
    got = dm.aggregate(outs, u, "cat")
    assert list(got) == list(outs[0])
    for m in modules(outs):
        a, b = got[m + ".lora_A.weight"], got[m + ".lora_B.weight"]
        assert a.shape == (*batch, 3 * n, 5) and b.shape == (*batch, 7, 3 * n)
        ref = sum(w * (o[m + ".lora_B.weight"].double() @ o[m + ".lora_A.weight"].double()) for w, o in zip(u, outs))
        torch.testing.assert_close((b @ a).double(), ref, rtol=1e-5, atol=1e-5)
    if n > 1:  # differs from DyPRAG's (mean B)(mean A): the cross terms
        mean = dyprag_mean(outs)
        m = modules(outs)[0]
        uni = dm.aggregate(outs, [1 / n] * n, "cat")
        assert not torch.allclose(uni[m + ".lora_B.weight"] @ uni[m + ".lora_A.weight"],
                                  mean[m + ".lora_B.weight"] @ mean[m + ".lora_A.weight"], atol=1e-3)


def test_dtype_and_device_are_kept():
    outs = make_outputs(3, dtype=torch.bfloat16)
    for mode in dm.DYPRAG_MODES:
        got = dm.aggregate(outs, weights(3), mode)
        assert all(v.dtype == torch.bfloat16 for v in got.values())


def test_weight_count_must_match():
    with pytest.raises(HookError, match="2 weights for 3 passages"):
        dm.aggregate(make_outputs(3), [0.5, 0.5], "separate")


def test_unknown_mode():
    with pytest.raises(HookError, match="mode 'svd'"):
        dm.aggregate(make_outputs(2), weights(2), "svd")


def test_delta_needs_lora_pairs():
    outs = make_outputs(2)
    odd = [{**o, "some.bias": torch.full((3,), float(i + 1))} for i, o in enumerate(outs)]
    with pytest.raises(HookError, match="key 'some.bias'"):
        dm.aggregate(odd, weights(2), "cat")
    sep = dm.aggregate(odd, weights(2), "separate")  # separate weights any key, the bias included
    torch.testing.assert_close(sep["some.bias"], torch.full((3,), weights(2)[0] * 1 + weights(2)[1] * 2))
    half = [{k: v for k, v in o.items() if not k.endswith("layers.0.mlp.gate_proj.lora_B.weight")} for o in outs]
    with pytest.raises(HookError, match=r"module '.*layers\.0\.mlp\.gate_proj' has only"):
        dm.aggregate(half, weights(2), "cat")
    bad = [dict(o) for o in outs]
    k = PFX.format(i=1, p="down_proj") + ".lora_B.weight"
    for o in bad:
        o[k] = torch.zeros(7, 4)
    with pytest.raises(HookError, match=r"layers\.1\.mlp\.down_proj.*do not form B @ A"):
        dm.aggregate(bad, weights(2), "cat")


# ----------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("n", [1, 3, 5])
def test_alignment_accepts_dyprag_mean(n):
    """DyPRAG's mean and the same mean in another summation order pass; the same dict moved by more than the
    stated tolerance (8 ulps of the dtype at the inputs' largest magnitude) is refused."""
    outs = make_outputs(n)
    assert dm.check_alignment(outs, dyprag_mean(outs), n, "q") is None
    other = {k: sum(o[k] for o in reversed(outs)) / n for k in outs[0]}
    # the reordered sum is within the tolerance; an independent float64 check of that premise:
    for k in outs[0]:
        scale = float(torch.stack([o[k] for o in outs]).abs().max())
        gap = float((other[k].double() - torch.stack([o[k].double() for o in outs]).mean(0)).abs().max())
        assert gap <= 8 * torch.finfo(torch.float32).eps * scale
    assert dm.check_alignment(outs, other, n, "q") is None
    k = next(iter(outs[0]))
    scale = float(torch.stack([o[k] for o in outs]).abs().max())
    moved = {**other, k: other[k] + 64 * torch.finfo(torch.float32).eps * scale}
    with pytest.raises(HookError, match=rf"key '{re.escape(k)}'.*not the plain mean of the {n}"):
        dm.check_alignment(outs, moved, n, "q")


def test_alignment_count_mismatch():
    outs = make_outputs(3)
    with pytest.raises(HookError, match=r"captured 3 ParameterTranslator output\(s\).*2 passage\(s\).*'what\?'"):
        dm.check_alignment(outs, dyprag_mean(outs[:2]), 2, "what?")


def test_alignment_not_the_mean():
    outs = make_outputs(3)
    merged = dyprag_mean(outs)
    k = PFX.format(i=1, p="gate_proj") + ".lora_A.weight"
    merged[k] = merged[k] + 1e-3
    with pytest.raises(HookError, match=rf"key '{k}'.*not the plain mean of the 3"):
        dm.check_alignment(outs, merged, 3)
    summed = {k: torch.stack([o[k] for o in outs]).sum(0) for k in outs[0]}
    with pytest.raises(HookError, match="not the plain mean"):
        dm.check_alignment(outs, summed, 3)
    shifted = dyprag_mean(make_outputs(3, seed=9))  # the right count, someone else's outputs
    with pytest.raises(HookError, match="not the plain mean"):
        dm.check_alignment(outs, shifted, 3)


def test_alignment_keys_and_shapes():
    outs = make_outputs(2)
    merged = dyprag_mean(outs)
    k = next(iter(merged))
    fewer = {kk: v for kk, v in merged.items() if kk != k}
    with pytest.raises(HookError, match=rf"output 0 does not have the keys.*unexpected \['{k}'\]"):
        dm.check_alignment(outs, fewer, 2)
    with pytest.raises(HookError, match=rf"key '{k}': ParameterTranslator output 0 has shape \[2, 5\] but "
                                        r"delta_inject got \[1, 2, 5\]"):
        dm.check_alignment(outs, {**merged, k: merged[k][None]}, 2)
    with pytest.raises(HookError, match="call 1 returned a list"):
        dm.check_alignment([outs[0], [1, 2]], merged, 2)
    with pytest.raises(HookError, match=rf"key '{k}' given to delta_inject is a str"):
        dm.check_alignment(outs, {**merged, k: "x"}, 2)
    with pytest.raises(HookError, match="non-empty dict"):
        dm.check_alignment([], {}, 0)


def test_alignment_nan_in_same_place_is_accepted():
    """A NaN in a translator output passes when DyPRAG's mean has it at the same place, and is refused elsewhere."""
    outs = make_outputs(2)
    k = next(iter(outs[0]))
    outs[0][k][0, 0] = float("nan")
    merged = dyprag_mean(outs)
    assert torch.isnan(merged[k][0, 0]) and dm.check_alignment(outs, merged, 2) is None
    elsewhere = merged[k].clone()
    elsewhere[0, 0], elsewhere[1, 1] = 0.0, float("nan")
    with pytest.raises(HookError, match="not the plain mean"):
        dm.check_alignment(outs, {**merged, k: elsewhere}, 2)
