"""Mixed batches: one forward with a per-sample mixture equals running every sample alone with its own merge."""

import pytest
import torch

from fcprag_plugin import MergeError, WeightedAdapterMerger, activate
from fcprag_plugin.slot import FusedSlot
from fcprag_tools.lm.mixed import union_weights
from helpers import logits, make_adapter_dir, random_adapter, tiny_model

B, T = 3, 8


@pytest.fixture
def batch():
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_mixed_cat_equals_per_sample(kind, batch):
    model = tiny_model(kind)
    union = [random_adapter(model, r, seed=30 + i, alpha=4 * (i + 1)) for i, r in enumerate([2, 1, 4, 2])]
    W = torch.tensor([[1.3, 0.0, 0.7, 0.2],   # each row: that sample's w~ over the union (0 = not used)
                      [0.0, 2.0, 0.0, 0.0],
                      [0.5, 0.5, 0.5, 1.5]])
    slot = FusedSlot(model, union[0], max_adapters=5, max_rank=4)
    base = logits(model, batch)
    with slot.mixed(union, W):
        got = logits(model, batch)
    assert torch.equal(logits(model, batch), base)  # off again after the block
    for b in range(B):
        used = [i for i in range(4) if W[b, i] != 0]
        ads, w = [union[i] for i in used], W[b, used].tolist()
        with slot.fused(ads, w):  # the sample alone through the slot
            alone = logits(model, batch[b:b + 1])
        with activate(model, WeightedAdapterMerger("cat").merge(ads, w).adapter):  # and through the reference
            ref = logits(model, batch[b:b + 1])
        torch.testing.assert_close(got[b:b + 1], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[b:b + 1], ref, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[b:b + 1], base[b:b + 1], atol=1e-3)
    slot.remove()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_mixed_separate_equals_per_sample(kind, batch):
    model = tiny_model(kind)
    union = [random_adapter(model, 2, seed=40 + i, alpha=8 * (i + 1)) for i in range(4)]
    mask = torch.tensor([[True, True, False, True], [False, True, True, False], [True, True, True, True]])
    W = torch.tensor([[1.2, 0.9, 0.0, 0.9], [0.0, 1.5, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    slot = FusedSlot(model, union[0], max_adapters=4, max_rank=2)
    with slot.mixed(union, W, mode="separate", mask=mask):
        got = logits(model, batch)
    for b in range(B):
        used = mask[b].nonzero()[:, 0].tolist()
        ads, w = [union[i] for i in used], W[b, used].tolist()  # separate divides by this sample's N_b
        with activate(model, WeightedAdapterMerger("separate").merge(ads, w).adapter):
            ref = logits(model, batch[b:b + 1])
        torch.testing.assert_close(got[b:b + 1], ref, rtol=1e-5, atol=1e-5)


def test_generate_with_mixed_batch():
    """generate() keeps the batch first (no beam expansion), so per-sample mixtures hold through decoding."""
    model = tiny_model("llama")
    union = [random_adapter(model, 2, seed=i, alpha=16) for i in range(3)]
    W = torch.tensor([[1.5, 0.5, 0.0], [0.0, 0.0, 3.0]])
    inp = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    slot = FusedSlot(model, union[0], max_adapters=3)
    with slot.mixed(union, W):
        got = model.generate(inp, **kw)
    for b in range(2):
        used = W[b].nonzero()[:, 0].tolist()
        with slot.fused([union[i] for i in used], W[b, used].tolist()):
            assert torch.equal(got[b:b + 1], model.generate(inp[b:b + 1], **kw))


def test_union_weights_from_paths(tmp_path):
    dirs = [make_adapter_dir(tmp_path / f"p{i}", seed=i) for i in range(3)]
    union, W, mask = union_weights([[dirs[0], dirs[1]], [str(dirs[1]), dirs[2]], [dirs[2]]],
                                   [[1.0, 2.0], [3.0, 4.0], [5.0]])
    assert union == [dirs[0], dirs[1], dirs[2]]
    assert W.tolist() == [[1.0, 2.0, 0.0], [0.0, 3.0, 4.0], [0.0, 0.0, 5.0]]
    assert mask.tolist() == [[True, True, False], [False, True, True], [False, False, True]]
    model = tiny_model("llama")
    slot = FusedSlot(model, ["gate_proj", "up_proj", "down_proj"], max_adapters=3, max_rank=2)
    x = torch.randint(0, 128, (3, 4))
    with slot.mixed(union, W, mask=mask):  # paths go through the slot's store
        got = logits(model, x)
    with slot.fused([dirs[2]], [5.0]):
        torch.testing.assert_close(got[2:], logits(model, x[2:]), rtol=1e-5, atol=1e-5)
    with pytest.raises(MergeError, match=r"sample 0 lists adapter .*p0.* twice"):
        union_weights([[dirs[0], dirs[0]]])
    with pytest.raises(MergeError, match="sample 1: 1 adapters but 2 weights"):
        union_weights([[dirs[0]], [dirs[1]]], [[1.0], [1.0, 2.0]])


def test_mixed_errors():
    model = tiny_model("llama")
    union = [random_adapter(model, 2, seed=i) for i in range(2)]
    slot = FusedSlot(model, union[0], max_adapters=2)
    with pytest.raises(MergeError, match=r"weights have shape \[2, 3\], expected \[B, 2\]"):
        slot.write_mixed(union, torch.ones(2, 3))
    with pytest.raises(MergeError, match=r"mask has shape \[1, 2\], expected \[2, 2\]"):
        slot.write_mixed(union, torch.ones(2, 2), mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(MergeError, match="sample 1 uses no adapter"):
        slot.write_mixed(union, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), mode="separate")
    with pytest.raises(MergeError, match="mode 'svd' is not supported"):
        slot.write_mixed(union, torch.ones(2, 2), mode="svd")
    with slot.mixed(union, torch.ones(2, 2)):
        with pytest.raises(MergeError, match=r"module 'model.layers.0.mlp.\w+_proj': the mixed batch has 2 samples "
                                             r"but the module's input has shape \[3, 4\]"):
            model(torch.zeros(3, 4, dtype=torch.long))
        with pytest.raises(MergeError, match="cannot be nested"):
            with slot.fused(union):
                pass
    assert not slot.active
