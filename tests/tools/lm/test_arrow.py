"""Our Arrow routing (``fcprag_tools.lm.arrow``) against PEFT's own ``create_arrow_model`` on the same adapters:
the same prototypes, the same top-k routing per token and layer, the same logits (float32, within 2e-5); a batch
of sequences with their own adapter sets equals each sequence alone; the model is left as it was.

PEFT's Arrow exists from PEFT 0.18 (the latest stack); on the pinned stacks (PEFT 0.13.2) the comparisons with
PEFT skip, and the prototype is checked against a dense SVD instead."""

from __future__ import annotations

import warnings

import pytest
import torch

from fcprag_plugin.adapter import LoraAdapter, LoraModule
from fcprag_plugin.errors import MergeError
from fcprag_tools.lm import arrow
from helpers import assert_bit_identical, make_adapter_dir, random_adapter, state_snapshot, tiny_model

try:
    from peft import ArrowConfig, create_arrow_model
except ImportError:  # PEFT < 0.18
    ArrowConfig = create_arrow_model = None
needs_peft_arrow = pytest.mark.skipif(create_arrow_model is None,
                                      reason="this PEFT has no Arrow (ArrowConfig / create_arrow_model: PEFT >= 0.18)")
LOGIT_TOL = 2e-5  # float32 logits of a 2-layer model: ours add sum_e c_e s_e B_e (A_e x), PEFT sums per expert


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def world(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"arrow-{kind}")
    dirs = [make_adapter_dir(root / f"a{i}", kind, r=2, alpha=32, seed=10 + i) for i in range(4)]  # PRAG's layout
    return {"kind": kind, "dirs": dirs, "model": tiny_model(kind, seed=3),
            "ads": [LoraAdapter.from_pretrained(d) for d in dirs]}


def _ids(n: int, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (n, length), generator=torch.Generator().manual_seed(seed))


def _peft(model, dirs, top_k, ids):
    """PEFT's Arrow on ``dirs``: the logits, each Arrow layer's input and prototypes; the model unloaded after."""
    cfg = ArrowConfig(top_k=top_k, router_temperature=1.0, rng_seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = create_arrow_model(model, [str(d) for d in dirs], cfg)
    inputs, layers = {}, {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_arrow"):
            layers[name] = mod
            mod.register_forward_pre_hook(lambda m, a, n=name: inputs.__setitem__(n, a[0].detach().float()))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        protos = {n: m.lora_arrow["arrow_router"].prototypes.float().clone() for n, m in layers.items()}
    finally:
        wrapped.unload()
    return logits, inputs, protos


@needs_peft_arrow
@pytest.mark.parametrize("n_ads,top_k", [(4, 3), (3, 3), (4, 2), (2, 2)])
def test_routed_logits_prototypes_and_routing_equal_peft(world, n_ads, top_k):
    model, dirs, ads = world["model"], world["dirs"][:n_ads], world["ads"][:n_ads]
    ids = _ids(2)
    snap = state_snapshot(model)
    with torch.no_grad():
        base = model(input_ids=ids).logits
    ref, inputs, peft_protos = _peft(model, dirs, top_k, ids)
    assert_bit_identical(model, snap)
    with torch.no_grad(), arrow.arrow_routing(model, [ads, ads], arrow.ArrowSettings(top_k=top_k)):
        ours = model(input_ids=ids).logits
    assert (ref - base).abs().max() > 100 * LOGIT_TOL  # the routed adapters move the logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=LOGIT_TOL)
    mine = arrow.prototypes(ads)
    key = lambda n: n.removeprefix("base_model.model.")  # noqa: E731
    assert {key(n) for n in peft_protos} == set(mine[0])
    for name, P in peft_protos.items():
        ours_p = torch.stack([m[key(name)] for m in mine])
        torch.testing.assert_close(ours_p, P, rtol=0, atol=1e-6)
        # the same adapters chosen for every token of this layer (from PEFT's inputs and PEFT's prototypes)
        x = inputs[name]
        want = (x @ P.T).abs().topk(top_k, dim=-1).indices.sort(-1).values
        c = arrow.route(x, ours_p, torch.ones(2, n_ads, dtype=torch.bool), arrow.rank_drop([top_k] * 2), 1.0)
        got = (c > 0).nonzero()[:, -1].view(*x.shape[:2], top_k)
        assert torch.equal(got, want), name


@needs_peft_arrow
def test_a_batch_of_own_adapter_sets_equals_each_alone_and_peft(world):
    """Three sequences, each with its own adapters (4, 2 and 3 of them: k_b = 3, 2, 3), one shared: in one forward,
    each equals its own forward alone and PEFT's Arrow over its adapters."""
    model, dirs, ads = world["model"], world["dirs"], world["ads"]
    sets = [[0, 1, 2, 3], [2, 3], [1, 3, 0]]
    ids = _ids(3, seed=1)
    mask = torch.ones_like(ids)
    snap = state_snapshot(model)
    with torch.no_grad(), arrow.arrow_routing(model, [[ads[i] for i in s] for s in sets]):
        batch = model(input_ids=ids, attention_mask=mask).logits
    for b, s in enumerate(sets):
        with torch.no_grad(), arrow.arrow_routing(model, [[ads[i] for i in s]]):
            alone = model(input_ids=ids[b:b + 1]).logits
        ref, _, _ = _peft(model, [dirs[i] for i in s], min(3, len(s)), ids[b:b + 1])
        torch.testing.assert_close(batch[b:b + 1], alone, rtol=0, atol=1e-5)
        torch.testing.assert_close(alone, ref, rtol=0, atol=LOGIT_TOL)
    assert_bit_identical(model, snap)


def test_batched_equals_alone_and_nothing_stays_installed(world):
    """On every stack: a mixed batch equals each sequence alone; weights bit-identical, no hook left, also after an
    error inside the block; the routed update is not zero."""
    model, ads = world["model"], world["ads"]
    sets = [[ads[0], ads[1], ads[2]], [ads[3]], [ads[1], ads[3]]]
    ids = _ids(3, seed=2)
    snap = state_snapshot(model)
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    with torch.no_grad():
        base = model(input_ids=ids).logits
        with arrow.arrow_routing(model, sets):
            batch = model(input_ids=ids).logits
        for b, s in enumerate(sets):
            with arrow.arrow_routing(model, [s]):
                torch.testing.assert_close(batch[b:b + 1], model(input_ids=ids[b:b + 1]).logits, rtol=0, atol=1e-5)
        with pytest.raises(RuntimeError, match="boom"), arrow.arrow_routing(model, sets):
            raise RuntimeError("boom")
        assert (batch - base).abs().max() > 1e-3
        assert torch.equal(model(input_ids=ids).logits, base)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    assert_bit_identical(model, snap)


def test_one_adapter_routes_all_its_weight_and_equals_plain_lora(world):
    """With one adapter the softmax gives it coefficient 1: the routed model is that adapter's LoRA (an independent
    reference: the dense update added to each target weight of a copy)."""
    import copy

    model, ad = world["model"], world["ads"][0]
    ids = _ids(2, seed=3)
    dense = copy.deepcopy(model)
    table = dict(dense.named_modules())
    with torch.no_grad():
        for name, m in ad.modules.items():
            table[name].weight += m.delta()
        want = dense(input_ids=ids).logits
        with arrow.arrow_routing(model, [[ad], [ad]]):
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_prototype_is_the_top_right_singular_vector_and_is_cached(world):
    """An adapter whose B A has a clear top singular value: the prototype is its top right singular vector (up to
    sign) from a dense SVD; asked again, the same tensors come back (computed once per adapter)."""
    model = world["model"]
    ad = random_adapter(model, 2, seed=7)
    g = torch.Generator().manual_seed(8)
    for m in ad.modules.values():
        q, _ = torch.linalg.qr(torch.randn(m.in_features, 2, generator=g))
        m.A = torch.diag(torch.tensor([3.0, 1.0])) @ q.T  # singular values of B A: 3x those of B's columns
        m.B = torch.linalg.qr(torch.randn(m.out_features, 2, generator=g))[0]
    first = arrow.prototypes([ad])[0]
    for name, m in ad.modules.items():
        v = torch.linalg.svd(m.B.double() @ m.A.double()).Vh[0]
        assert abs(float(first[name].double() @ v)) == pytest.approx(1.0, abs=1e-6), name
    again = arrow.prototypes([ad, ad])
    assert all(again[0][n] is first[n] and again[1][n] is first[n] for n in first)


def test_adapters_on_other_modules_are_refused(world):
    model, ads = world["model"], world["ads"]
    part = LoraAdapter({n: LoraModule(m.A, m.B, m.scaling) for n, m in list(ads[1].modules.items())[:2]},
                       source="partial")
    with pytest.raises(MergeError, match="same modules: partial"):
        with arrow.arrow_routing(model, [[ads[0], part]]):
            pass
    with pytest.raises(MergeError, match="no adapters"):
        with arrow.arrow_routing(model, [[ads[0]], []]):
            pass
    with pytest.raises(MergeError, match="top_k"):
        arrow.ArrowSettings(top_k=0)
