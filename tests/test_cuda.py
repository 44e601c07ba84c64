"""The fusion on a CUDA model (skipped where torch sees no GPU; CI has none, the device checks run them).

The reference is computed independently on the CPU in float64: the dense update ``sum_i w~_i s_i B_i A_i`` added to
each target weight of a copy of the model.
"""

import copy

import pytest
import torch

from fcprag_plugin import FusionController, LoraAdapter, activate, fuse, fuse_into
from helpers import assert_bit_identical, dense_reference, state_snapshot, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PASSAGES = ["paris is the capital of france", "bananas are yellow fruit", "the eiffel tower is in paris"]
QUERY = "what is the capital of france"


def dense_logits(model, adapters, weights, x):
    """Logits of a float64 CPU copy of ``model`` with the dense merged update written into its weights."""
    ref = copy.deepcopy(model).to("cpu", torch.float64)
    table = dict(ref.named_modules())
    with torch.no_grad():
        for name in adapters[0].modules:
            table[name].weight += dense_reference(adapters, weights, name)
        return ref(x.cpu()).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_slot", [False, True])
def test_scale_only_fusion_on_cuda_matches_the_dense_reference(adapter_dirs, dtype, use_slot):
    model = tiny_model().to("cuda", dtype)
    snap = state_snapshot(model)
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    x = torch.randint(0, 128, (2, 7), device="cuda")
    want = dense_logits(model, ads, [1.5] * 3, x)
    ctrl = FusionController.scale_only(1.5)  # no encoder: nothing else to load on the GPU box
    with torch.no_grad():
        if use_slot:
            with fuse_into(model, adapter_dirs, QUERY, PASSAGES, controller=ctrl):
                got = model(x).logits
        else:
            res = fuse(adapter_dirs, QUERY, PASSAGES, controller=ctrl)
            with activate(model, res.adapter):
                got = model(x).logits
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.double().cpu(), want, **tol)
    assert_bit_identical(model, snap)  # the base weights were never written


def test_slot_separate_mode_on_cuda_equals_the_merged_adapter(adapter_dirs, encoder16):
    model = tiny_model().to("cuda")
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    x = torch.randint(0, 128, (1, 6), device="cuda")
    with torch.no_grad():
        ref = fuse(adapter_dirs, QUERY, PASSAGES, controller=ctrl, encoder=encoder16, mode="separate")
        with activate(model, ref.adapter):
            want = model(x).logits
        with fuse_into(model, adapter_dirs, QUERY, PASSAGES, controller=ctrl, encoder=encoder16, mode="separate"):
            got = model(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the fused-weight route on a GPU
def _params(model):
    return {n: (p, p.detach().clone()) for n, p in model.named_parameters()}


def _assert_restored(model, before):
    now = dict(model.named_parameters())
    for n, (obj, val) in before.items():
        assert now[n] is obj and torch.equal(now[n], val), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generation_on_fused_weights_matches_the_dense_reference_and_restores(adapter_dirs, dtype):
    """fuse_into(model, ...) + generate: the decoding steps run on fused weights (route auto); a decoding step's
    logits equal the float64 dense reference; afterwards the original Parameter objects, bit for bit."""
    model = tiny_model().to("cuda", dtype)
    before = _params(model)
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    x = torch.randint(0, 128, (2, 7), device="cuda")
    want = dense_logits(model, ads, [1.5] * 3, x)[:, -1]
    ctrl = FusionController.scale_only(1.5)
    tol = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        with fuse_into(model, adapter_dirs, QUERY, PASSAGES, controller=ctrl) as res:
            model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert res.slot.on_weights
            got = model(x).logits[:, -1]
        torch.testing.assert_close(got.double().cpu(), want, **tol)
        _assert_restored(model, before)
        res.slot.route = "hooks"
        with fuse_into(model, adapter_dirs, QUERY, PASSAGES, controller=ctrl):
            hooks = model(x).logits[:, -1]
        torch.testing.assert_close(got, hooks, **tol)
    _assert_restored(model, before)
    res.slot.remove()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_fused_weights_on_cuda_restore_after_an_interrupt(adapter_dirs, exc):
    model = tiny_model().to("cuda", torch.bfloat16)
    before = _params(model)
    x = torch.randint(0, 128, (1, 5), device="cuda")
    with pytest.raises(exc):
        with torch.no_grad(), fuse_into(model, adapter_dirs, QUERY, PASSAGES,
                                        controller=FusionController.scale_only(1.0)) as res:
            model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
            assert res.slot.on_weights
            raise exc("interrupted")
    assert not res.slot.active
    _assert_restored(model, before)
    res.slot.remove()


def test_fused_weights_over_budget_on_cuda_keep_the_hooks(adapter_dirs):
    model = tiny_model().to("cuda")
    before = _params(model)
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    x = torch.randint(0, 128, (1, 6), device="cuda")
    with torch.no_grad():
        res = fuse_into(model, adapter_dirs, QUERY, PASSAGES, controller=FusionController.scale_only(1.0))
        res.close()
        res.slot.weights_budget = 1024
        with fuse_into(model, adapter_dirs, QUERY, PASSAGES, controller=FusionController.scale_only(1.0)):
            out = model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
            assert res.slot.active and not res.slot.on_weights
            got = model(x).logits[:, -1]
    torch.testing.assert_close(got.double().cpu(), dense_logits(model, ads, [1.0] * 3, x)[:, -1], rtol=1e-4,
                               atol=1e-4)
    assert out.sequences.shape[1] == 9
    _assert_restored(model, before)
    res.slot.remove()
