"""The fused-weight route of FusedSlot: target modules compute with ``W + sum w~ s B A`` swapped in for ``weight``.

References are independent: a float64 copy of the model with ``W + sum_i w_i s_i B_i A_i`` written into it. The
base model must come back bit-identical, with its original ``Parameter`` objects, after a normal exit, an
exception and a KeyboardInterrupt (also one that lands half way through the swap).
"""

import copy
import logging

import pytest
import torch

from fcprag_plugin import FusionController, MergeError, fuse_into
from fcprag_plugin.slot import FusedSlot, fused, fused_weights
from helpers import dense_reference, random_adapter, tiny_model

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def dense64(model, adapters, weights):
    """A float64 copy of ``model`` (hooks dropped) whose target weights are ``W + sum_i w_i s_i B_i A_i``."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        m._forward_hooks.clear()
    ref = ref.to(torch.float64)
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for name in adapters[0].modules:
            mods[name].weight += dense_reference(adapters, weights, name)
    return ref


def targets(model, slot):
    table = dict(model.named_modules())
    return [table[n] for n in slot.layout.module_names]


def originals(model):
    """``(parameter object, clone)`` of every parameter, to check identity and bits afterwards."""
    return {n: (p, p.detach().clone()) for n, p in model.named_parameters()}


def assert_restored(model, before):
    now = dict(model.named_parameters())
    assert set(now) == set(before)
    for n, (obj, val) in before.items():
        assert now[n] is obj, f"parameter {n} is not the original object"
        assert torch.equal(now[n], val), f"parameter {n} changed"


def decode(model, x):
    """A prefill and one decoding step (what generate() does first); returns the step's logits."""
    out = model(x[:, :-1])
    return model(x[:, -1:], past_key_values=out.past_key_values).logits


@pytest.fixture(autouse=True)
def auto_on_cpu(monkeypatch):
    """Route 'auto' switches on accelerators only; these CPU tests check its logic with the CPU allowed."""
    monkeypatch.setattr(fused, "AUTO_ON_CPU", True)


@pytest.fixture
def x():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))


def setup(dtype, kind="llama", n=3):
    model = tiny_model(kind).to(dtype)
    ads = [random_adapter(model, 2, seed=i, alpha=8 + i) for i in range(n)]
    return model, ads, [0.7, 1.3, 0.4][:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["cat", "separate"])
def test_auto_switches_at_the_first_decoding_step_and_matches_the_dense_reference(x, dtype, mode):
    model, ads, w = setup(dtype)
    before = originals(model)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    want = dense64(model, ads, w) if mode == "cat" else None
    with torch.no_grad(), slot.fused(ads, w, mode):
        out = model(x[:, :-1])  # a prefill: the hooks
        first = model(x).logits  # no cache given (scoring): still the hooks
        assert not slot.on_weights and slot.active
        step = model(x[:, -1:], past_key_values=out.past_key_values).logits[:, -1]  # decoding: fused weights
        assert slot.on_weights and slot.active
        second = third = model(x).logits  # fused weights throughout
        assert not any(m._forward_hooks for m in targets(model, slot))  # no hook cost while on weights
        swapped = [m.weight for m in targets(model, slot)]
        assert all(p is not before[n + ".weight"][0] for n, p in zip(slot.layout.module_names, swapped))
    assert not slot.active and not slot.on_weights
    assert_restored(model, before)
    assert all(len(m._forward_hooks) == 1 for m in targets(model, slot))  # the hooks are back (switched off)
    torch.testing.assert_close(step, first[:, -1], **TOL[dtype])
    for got in (first, second, third):
        if mode == "cat":
            torch.testing.assert_close(got.double(), want(x).logits.double(), **TOL[dtype])
        else:
            torch.testing.assert_close(got, first, **TOL[dtype])  # separate: same merge, other route
    if mode == "separate":  # DyPRAG's product, densely: (sum u_i B_i)(sum u_i s_i A_i), u = w~/N
        ref = copy.deepcopy(model).to(torch.float64)
        mods = dict(ref.named_modules())
        u = [v / len(w) for v in w]
        with torch.no_grad():
            for name in ads[0].modules:
                B = sum(ui * a.modules[name].B.double() for ui, a in zip(u, ads))
                A = sum(ui * a.modules[name].scaling * a.modules[name].A.double() for ui, a in zip(u, ads))
                mods[name].weight += B @ A
        err = [(t.double() - ref(x).logits.double()).abs().max().item() for t in (first, third)]
        # the bfloat16 factor sums round before their product, on either route: no worse than the hooks
        assert err[1] <= (1e-4 if dtype == torch.float32 else 1.25 * err[0] + 1e-2), err
    with torch.no_grad():
        base = model(x).logits
        assert torch.equal(base, tiny_model("llama").to(dtype)(x).logits.double())
    slot.remove()
    assert_restored(model, before)
    assert not any(m._forward_hooks for m in model.modules())


def test_route_weights_is_exact_to_the_dtype_rounding(x):
    """Route 'weights' at write(): each fused weight is W + sum w s B A rounded once (float64 reference)."""
    model, ads, w = setup(torch.float32)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    slot.route = "weights"
    slot.write(ads, w)
    assert slot.on_weights
    table = dict(model.named_modules())
    for name in ads[0].modules:
        W = table[name].weight.detach()
        ref = (tiny_model("llama").get_submodule(name).weight.detach().double() + dense_reference(ads, w, name))
        ulp = torch.finfo(torch.float32).eps * ref.abs().max().item()
        torch.testing.assert_close(W.double(), ref, rtol=0, atol=4 * ulp)
    with torch.no_grad():
        want = dense64(tiny_model("llama"), ads, w)(x).logits.double()
        torch.testing.assert_close(model(x).logits.double(), want, rtol=1e-5, atol=1e-5)
    slot.write(ads[:1], [2.0])  # a new merge: back to the originals, then fused again
    with torch.no_grad():
        want = dense64(tiny_model("llama"), ads[:1], [2.0])(x).logits.double()
        torch.testing.assert_close(model(x).logits.double(), want, rtol=1e-5, atol=1e-5)
    slot.remove()
    with torch.no_grad():
        assert torch.equal(model(x).logits, tiny_model("llama")(x).logits.double())


def test_generate_through_fuse_matches_hooks_and_restores(x):
    """The user's call, fuse_into(model, ...) + generate: fused weights, the hooks' tokens, and the
    original parameters afterwards."""
    model, ads, _ = setup(torch.float32)
    before = originals(model)
    ctrl = FusionController.scale_only(1.5)
    q, ps = "what is the capital of france", ["paris is in france", "bananas are yellow", "the eiffel tower"]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with fuse_into(model, ads, q, ps, controller=ctrl) as res:
        got = model.generate(x, **kw)
        assert res.slot.on_weights
    assert_restored(model, before)
    res.slot.route = "hooks"
    with fuse_into(model, ads, q, ps, controller=ctrl) as res:
        hooks = model.generate(x, **kw)
        assert not res.slot.on_weights
    assert torch.equal(got, hooks)
    with torch.no_grad():
        want = dense64(model, ads, [1.5] * 3)(got[:, :-1]).logits[:, -1].double()
        res.slot.route = "weights"
        with fuse_into(model, ads, q, ps, controller=ctrl):
            torch.testing.assert_close(model(got[:, :-1]).logits[:, -1].double(), want, rtol=1e-4, atol=1e-4)
    assert_restored(model, before)
    res.slot.remove()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_or_interrupt_in_the_block_restores(x, exc):
    model, ads, w = setup(torch.float32)
    before = originals(model)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    with pytest.raises(exc):
        with torch.no_grad(), slot.fused(ads, w):
            decode(model, x)
            assert slot.on_weights
            raise exc("interrupted")
    assert not slot.active
    assert_restored(model, before)
    slot.remove()


def test_interrupt_half_way_through_the_swap_leaves_the_hooks_whole(x, monkeypatch):
    """A KeyboardInterrupt between two module swaps: every weight is put back and the merge stays on the hooks."""
    model, ads, w = setup(torch.float32)
    before = originals(model)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    calls = []

    def flaky_setattr(obj, name, value):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        setattr(obj, name, value)

    monkeypatch.setattr(fused_weights, "setattr", flaky_setattr, raising=False)
    slot.route = "weights"
    with pytest.raises(KeyboardInterrupt):
        slot.write(ads, w)
    monkeypatch.delattr(fused_weights, "setattr")
    assert slot.active and not slot.on_weights  # still the merge, through the hooks
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits.double(), dense64(tiny_model("llama"), ads, w)(x).logits.double(),
                                   rtol=1e-4, atol=1e-4)
    slot.deactivate()
    assert_restored(model, before)
    slot.remove()


def test_budget_too_small_falls_back_to_the_hooks_with_one_log_line(x, caplog):
    model, ads, w = setup(torch.float32)
    before = originals(model)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    slot.weights_budget = slot.weights_nbytes - 1
    caplog.set_level(logging.INFO, logger="fcprag_plugin")
    for _ in range(3):
        with torch.no_grad(), slot.fused(ads, w):
            decode(model, x)
            got = model(x).logits
            assert slot.active and not slot.on_weights
    lines = [r for r in caplog.records if "fused weights" in r.getMessage()]
    assert len(lines) == 1 and "budget" in lines[0].getMessage() and str(slot.weights_budget) in lines[0].getMessage()
    want = dense64(tiny_model("llama"), ads, w)(x).logits.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    slot.weights_budget = slot.weights_nbytes  # fits now
    with torch.no_grad(), slot.fused(ads, w):
        decode(model, x)
        assert slot.on_weights
    assert_restored(model, before)
    with pytest.raises(MergeError, match="weights_budget must be"):
        slot.weights_budget = -1
    slot.remove()


def test_grad_forwards_and_rank_transforms_keep_the_hooks(x):
    """Decoding with autograd on and per-sample transforms (mixed batches) never switch to fused weights."""
    model, ads, w = setup(torch.float32)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    with slot.fused(ads, w):
        decode(model, x)  # autograd on
        assert not slot.on_weights
    slot.write_mixed(ads, [w, w[::-1]])  # one mixture per sample of the batch of 2
    with torch.no_grad():
        decode(model, x)
    assert slot.active and not slot.on_weights
    slot.deactivate()
    slot.route = "bogus"
    with pytest.raises(MergeError, match=r"FusedSlot.route is 'bogus'; expected one of \['auto', 'hooks', 'weights'\]"):
        slot.write(ads, w)
    slot.remove()


def test_non_plain_weights_fall_back_to_the_hooks(x, caplog):
    """A weight that is not a plain floating-point nn.Parameter (quantised weights are Parameter subclasses)."""

    class QuantParam(torch.nn.Parameter):
        pass

    model, ads, w = setup(torch.float32)
    mod = model.get_submodule(next(iter(ads[0].modules)))
    mod.weight = QuantParam(mod.weight.detach().clone(), requires_grad=False)
    assert "QuantParam" in fused_weights.ineligible([mod])
    int_lin = torch.nn.Linear(4, 4)
    int_lin.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    assert "torch.int8" in fused_weights.ineligible([int_lin])
    caplog.set_level(logging.INFO, logger="fcprag_plugin")
    slot = FusedSlot(model, ads[0], max_adapters=3)
    with torch.no_grad(), slot.fused(ads, w):
        decode(model, x)
        got = model(x).logits
        assert not slot.on_weights
    assert sum("QuantParam" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(got.double(), dense64(model, ads, w)(x).logits.double(), rtol=1e-4, atol=1e-4)
    slot.remove()


def test_auto_keeps_the_hooks_on_the_cpu(x, monkeypatch):
    """Without AUTO_ON_CPU, route 'auto' on a CPU model keeps the hooks through a generate (the default there)."""
    monkeypatch.setattr(fused, "AUTO_ON_CPU", False)
    model, ads, w = setup(torch.float32)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    with torch.no_grad(), slot.fused(ads, w):
        decode(model, x)
        assert slot.active and not slot.on_weights
    slot.route = "weights"  # asked for explicitly: used on the CPU too
    with torch.no_grad(), slot.fused(ads, w):
        assert slot.on_weights
    slot.remove()
