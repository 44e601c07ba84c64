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
