"""FusedSlot against the WeightedAdapterMerger reference and an independent dense ``W + sum w s B A`` model."""

import copy

import pytest
import torch

from fcprag_plugin import LoraAdapter, LoraModule, MergeError, WeightedAdapterMerger, activate
from fcprag_plugin.slot import AdapterStore, FusedSlot, pack_adapter
from helpers import (assert_bit_identical, dense_reference, logits, make_adapter_dir, random_adapter, state_snapshot,
                     tiny_model)


def plain_copy(model):
    ref = copy.deepcopy(model)
    for m in ref.modules():  # a deep copy would carry over (and share) an installed slot's hooks
        m._forward_hooks.clear()
    return ref


def dense_model(model, adapters, weights):
    """Independent reference: a copy of ``model`` whose weights are ``W + sum_i w_i s_i B_i A_i`` (float64 sum)."""
    ref = plain_copy(model)
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for name in adapters[0].modules:
            w = mods[name].weight
            w.copy_((w.double() + dense_reference(adapters, weights, name)).to(w.dtype))
    return ref


@pytest.fixture
def x():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))


def assert_same_adapter(got: LoraAdapter, want: LoraAdapter):
    """Bit-exact comparison of two merged adapters (cat keeps the rank layout; padding rows must be zero)."""
    assert set(got.modules) == set(want.modules)
    for k, w in want.modules.items():
        g = got.modules[k]
        r = w.rank
        assert torch.equal(g.A[:r], w.A), f"A of {k} differs"
        assert torch.equal(g.B[:, :r], w.B), f"B of {k} differs"
        assert g.scaling == w.scaling == 1.0
        assert not bool(g.A[r:].any()), f"padding rows of A of {k} are not zero"


@pytest.mark.parametrize("out_major", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [1, 3, 6])
def test_cat_equals_merger_and_dense(kind, n, x, out_major):
    model = tiny_model(kind)
    ranks = [1, 2, 4, 2, 1, 4][:n]
    ads = [random_adapter(model, r, seed=100 + i, alpha=[32, 8, 16, 3, 5, 7][i]) for i, r in enumerate(ranks)]
    w = torch.linspace(0.3, 1.7, n).tolist()
    slot = FusedSlot(model, ads[0], max_adapters=6, max_rank=4, out_major=out_major)
    with slot.fused(ads, w):
        got = logits(model, x)
        cur = slot.current_adapter()
    ref = WeightedAdapterMerger("cat").merge(ads, w).adapter
    # the slot's rows: adapter i at rows i*R..i*R+r_i, zeros elsewhere; compare block by block, bit for bit
    for k in ref.modules:
        row = 0
        for i, a in enumerate(ads):
            r = a.modules[k].rank
            assert torch.equal(cur[k].A[i * 4:i * 4 + r], ref[k].A[row:row + r])
            assert torch.equal(cur[k].B[:, i * 4:i * 4 + r], ref[k].B[:, row:row + r])
            assert not bool(cur[k].A[i * 4 + r:(i + 1) * 4].any())
            row += r
    with activate(model, ref):
        want = logits(model, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, logits(dense_model(model, ads, w), x), rtol=1e-4, atol=1e-4)
    slot.remove()


@pytest.mark.parametrize("out_major", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [2, 5])
def test_separate_equals_merger(kind, n, x, out_major):
    model = tiny_model(kind)
    ads = [random_adapter(model, 2, seed=200 + i, alpha=8 + 8 * i) for i in range(n)]
    w = torch.linspace(1.4, 0.6, n).tolist()
    slot = FusedSlot(model, ads[0], max_adapters=5, max_rank=4, out_major=out_major)
    slot.write(ads[:1] * 5, None)  # leave rows of a larger 'cat' merge behind: they must be zeroed
    with slot.fused(ads, w, mode="separate"):
        got = logits(model, x)
        cur = slot.current_adapter()
    ref = WeightedAdapterMerger("separate").merge(ads, w).adapter
    assert_same_adapter(cur, ref)
    with activate(model, ref):
        want = logits(model, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # independent check of the separate semantics: (sum u B)(sum u s A), u = w/N, applied densely
    u = [wi / n for wi in w]
    ref_model = plain_copy(model)
    mods = dict(ref_model.named_modules())
    with torch.no_grad():
        for k in ads[0].modules:
            Bs = sum(ui * a.modules[k].B.double() for ui, a in zip(u, ads))
            As = sum(ui * a.modules[k].scaling * a.modules[k].A.double() for ui, a in zip(u, ads))
            mods[k].weight.add_((Bs @ As).float())
    torch.testing.assert_close(got, logits(ref_model, x), rtol=1e-4, atol=1e-4)


def test_out_major_pack_holds_the_same_factors():
    model = tiny_model("llama")
    ad = random_adapter(model, 3, seed=5, rank_of=lambda n: 1 if ".0." in n else 3)
    rows, cols = pack_adapter(ad), pack_adapter(ad, out_major=True)
    for g_rows, g_cols in zip(rows.groups, cols.groups):
        assert torch.equal(g_rows.A, g_cols.A) and torch.equal(g_rows.BT, g_cols.BT)
        assert g_cols.BT.transpose(1, 2).is_contiguous() and g_rows.BT.is_contiguous()
    back = cols.to_lora()
    for k, m in ad.modules.items():
        assert torch.equal(back[k].A, m.A) and torch.equal(back[k].B, m.B) and back[k].scaling == m.scaling


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_activate_one_adapter_handle(x, dtype):
    """activate() keeps B out-major and takes its packed copy as the slot's buffers where it fits (here the
    gate/up groups; the down group has a smaller rank than the slot's R and gets its own buffers): the output is
    the dense reference, the adapter is not written, and the handle takes a later merge like any slot."""
    model = tiny_model("llama")
    snap = state_snapshot(model)
    a0 = random_adapter(model, 3, seed=1, rank_of=lambda n: 1 if "down" in n or ".0." in n else 3,
                        alpha_of=lambda n: 4.0 if "down" in n else 6.0)
    a1 = random_adapter(model, 3, seed=2, alpha=5)
    before = {k: (m.A.clone(), m.B.clone()) for k, m in a0.modules.items()}
    tol = dict(rtol=1e-4, atol=1e-4) if dtype is None else dict(rtol=0.05, atol=0.05)
    with activate(model, a0, dtype=dtype) as handle:
        torch.testing.assert_close(logits(model, x), logits(dense_model(model, [a0], [1.0]), x), **tol)
        if dtype is not None:  # the same buffer content as a default slot's (each value rounded once)
            plain = FusedSlot(plain_copy(model), a0, max_adapters=1, dtype=dtype).write([a0])
            assert_same_adapter(handle.current_adapter(), plain.current_adapter())
        handle.write([a1], [0.7])
        torch.testing.assert_close(logits(model, x), logits(dense_model(model, [a1], [0.7]), x), **tol)
    assert all(torch.equal(m.A, before[k][0]) and torch.equal(m.B, before[k][1]) for k, m in a0.modules.items())
    assert_bit_identical(model, snap)


def test_rank_and_alpha_patterns(x):
    """Per-module ranks / scalings inside one adapter (PEFT rank_pattern / alpha_pattern): padded, per-layer coef."""
    model = tiny_model("llama")
    a0 = random_adapter(model, 3, seed=1, rank_of=lambda n: 1 if ".0." in n else 3,
                        alpha_of=lambda n: 4.0 if "down" in n else (9.0 if ".1." in n else 6.0))
    a1 = random_adapter(model, 2, seed=2, alpha=5)
    w = [0.8, 1.3]
    slot = FusedSlot(model, a0, max_adapters=3)
    assert slot.max_rank == 3
    with slot.fused([a0, a1], w):
        got = logits(model, x)
    torch.testing.assert_close(got, logits(dense_model(model, [a0, a1], w), x), rtol=1e-4, atol=1e-4)
    with activate(model, WeightedAdapterMerger("cat").merge([a0, a1], w).adapter):
        torch.testing.assert_close(got, logits(model, x), rtol=1e-5, atol=1e-5)


def test_reuse_with_fewer_adapters_zeroes_leftovers(x):
    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i) for i in range(5)]
    want = logits(dense_model(model, ads[3:], [0.5, 1.5]), x)
    slot = FusedSlot(model, ads[0], max_adapters=5)
    slot.write(ads, [1.0, 2.0, 3.0, 4.0, 5.0])
    slot.write(ads[3:], [0.5, 1.5])  # replaces the 5-adapter merge while active
    torch.testing.assert_close(logits(model, x), want, rtol=1e-4, atol=1e-4)
    slot.deactivate()
    assert torch.equal(logits(model, x), logits(tiny_model("llama"), x))


def test_base_model_bit_identical_after_1000_cycles(x):
    model = tiny_model("qwen2")
    snap = state_snapshot(model)
    keys = list(model.state_dict())
    before = logits(model, x)
    hooks_before = {n: len(m._forward_hooks) for n, m in model.named_modules()}
    ads = [pack_adapter(random_adapter(model, 1 + i % 3, seed=i)) for i in range(6)]
    slot = FusedSlot(model, ads[0], max_adapters=4, max_rank=3)
    g = torch.Generator().manual_seed(0)
    for c in range(1000):
        n = 1 + c % 4
        idx = torch.randperm(6, generator=g)[:n].tolist()
        w = (torch.rand(n, generator=g) * 2).tolist()
        same_rank = len({ads[i].max_rank for i in idx}) == 1
        with slot.fused([ads[i] for i in idx], w, mode="separate" if c % 3 == 0 and same_rank else "cat"):
            if c % 250 == 0:
                fused = logits(model, x)
                assert not torch.equal(fused, before)
                assert list(model.state_dict()) == keys  # the slot adds no parameters or buffers
        assert not slot.active
        if c % 250 == 0:
            assert torch.equal(logits(model, x), before)  # deactivated: the base model, bit for bit
    slot.remove()
    assert_bit_identical(model, snap)
    assert {n: len(m._forward_hooks) for n, m in model.named_modules()} == hooks_before
    assert torch.equal(logits(model, x), before)


def test_peft_model_and_paths(tmp_path, x):
    """A PeftModel with its own active adapter: the slot adds on top; remove() restores it exactly."""
    from peft import PeftModel

    dirs = [make_adapter_dir(tmp_path / f"p{i}", seed=i) for i in range(3)]
    ads = [LoraAdapter.from_pretrained(d) for d in dirs]
    pm = PeftModel.from_pretrained(tiny_model("llama", seed=1234), str(dirs[0]))
    snap = state_snapshot(pm)
    before = logits(pm, x)
    store = AdapterStore()
    slot = FusedSlot(pm, ["gate_proj", "up_proj", "down_proj"], max_adapters=2, max_rank=2, store=store)
    assert set(slot.layout.module_names) == set(ads[0].modules)
    w = [0.9, 1.4]
    with slot.fused(dirs[1:], w):  # paths: read through the store
        got = logits(pm, x)
    assert store.stats.misses == 2
    # independent: base + dW0 (PEFT's active adapter) + w1 dW1 + w2 dW2, densely
    ref = dense_model(tiny_model("llama", seed=1234), ads, [1.0] + w)
    torch.testing.assert_close(got, logits(ref, x), rtol=1e-4, atol=1e-4)
    slot.remove()
    assert_bit_identical(pm, snap)
    assert torch.equal(logits(pm, x), before)


def test_generate_equals_reference():
    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i, alpha=16) for i in range(3)]
    w = [1.2, 0.3, 1.5]
    inp = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    slot = FusedSlot(model, ads[0], max_adapters=3)
    with slot.fused(ads, w):
        got = model.generate(inp, **kw)
    with activate(model, WeightedAdapterMerger("cat").merge(ads, w).adapter):
        want = model.generate(inp, **kw)
    assert torch.equal(got, want)
    base = model.generate(inp, **kw)
    slot.remove()
    assert torch.equal(model.generate(inp, **kw), base)


def test_resize_and_for_model(x):
    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i) for i in range(4)]
    slot = FusedSlot.for_model(model, ads[0], max_adapters=2)
    assert FusedSlot.for_model(model, ads[1], max_adapters=2) is slot
    with pytest.raises(MergeError, match=r"4 adapters do not fit this slot \(max_adapters K=2\).*resize\(4\)"):
        slot.write(ads, None)
    grown = FusedSlot.for_model(model, ads[0], max_adapters=4, max_rank=4)
    assert grown is slot and (slot.max_adapters, slot.max_rank) == (4, 4)
    w = [1.0, 0.5, 1.5, 0.25]
    with slot.fused(ads, w):
        torch.testing.assert_close(logits(model, x), logits(dense_model(model, ads, w), x), rtol=1e-4, atol=1e-4)
    assert sum(len(m._forward_hooks) for m in model.modules()) == 6  # still one hook per target module
    slot.remove()
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    assert FusedSlot.for_model(model, ads[0], max_adapters=1) is not slot


# ----------------------------------------------------------------------------- errors name the culprit
def test_errors():
    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i, source=f"adapter-{i}") for i in range(3)]
    slot = FusedSlot(model, ads[0], max_adapters=2, max_rank=2)
    with pytest.raises(MergeError, match=r"3 adapters do not fit this slot \(max_adapters K=2\)"):
        slot.write(ads, None)
    big = random_adapter(model, 4, seed=9, source="big-one")
    with pytest.raises(MergeError, match=r"adapter 1 \(big-one\) has rank 4 > the slot's max_rank R=2"):
        slot.write([ads[0], big], None)
    partial = random_adapter(model, 2, seed=3, targets=["gate_proj", "up_proj"], source="no-down")
    with pytest.raises(MergeError, match=r"adapter 0 \(no-down\) does not fit: missing modules \['model.layers.0.mlp.down_proj'"):
        slot.write([partial], None)
    with pytest.raises(MergeError, match=r"merge weights have shape \[3\], expected \[2\]"):
        slot.write(ads[:2], [1.0, 1.0, 1.0])
    with pytest.raises(MergeError, match="must be finite"):
        slot.write(ads[:2], [1.0, float("nan")])
    with pytest.raises(MergeError, match=r"mode 'svd' is not supported"):
        slot.write(ads[:2], None, mode="svd")
    with pytest.raises(MergeError, match="a list"):
        slot.write(ads[0], None)
    with pytest.raises(MergeError, match=r"N == 0"):
        slot.write([], None)
    with pytest.raises(MergeError, match="adapter 1 is a int"):
        slot.write([ads[0], 5], None)
    r1 = random_adapter(model, 1, seed=5, source="rank-one")
    with pytest.raises(MergeError, match=r"'separate' needs equal ranks.*\[2, 1\]"):
        slot.write([ads[0], r1], None, mode="separate")
    with slot.fused(ads[:2]):
        with pytest.raises(MergeError, match="cannot be nested"):
            with slot.fused(ads[:1]):
                pass
    with pytest.raises(MergeError, match="max_adapters must be a positive integer, got 0"):
        FusedSlot(model, ads[0], max_adapters=0)
    with pytest.raises(MergeError, match=r"target module name\(s\) \['q_projj'\] match no module"):
        FusedSlot(model, ["q_projj"], max_adapters=1)
    wrong = LoraAdapter({"model.layers.0.mlp.gate_proj": LoraModule(torch.zeros(2, 5), torch.zeros(7, 2))}, {}, "x")
    with pytest.raises(MergeError, match=r"module 'model.layers.0.mlp.gate_proj': model weight is \[48, 32\]"):
        FusedSlot(model, wrong, max_adapters=1)
    other = FusedSlot(model, ads[0], max_adapters=1)
    with pytest.raises(MergeError, match="no weighted merge"):
        other.current_adapter()
    other.remove()
    slot.remove()
    with pytest.raises(MergeError, match="was removed"):
        slot.write(ads[:1], None)


@pytest.mark.parametrize("form", ["list", "tensor", "tuple"])
def test_weights_round_like_the_merger(form):
    """Weights that are not float32 numbers: the slot must use the merger's float32 values, bit for bit."""
    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i, alpha=3 + i) for i in range(3)]
    w = [0.1, 1 / 3, 2 / 7]
    given = {"list": w, "tensor": torch.tensor(w, dtype=torch.float64), "tuple": tuple(w)}[form]
    slot = FusedSlot(model, ads[0], max_adapters=3)
    for mode in ("cat", "separate"):
        slot.write(ads, given, mode=mode)
        assert_same_adapter(slot.current_adapter(), WeightedAdapterMerger(mode).merge(ads, w).adapter)
    with pytest.raises(MergeError, match="must be finite"):
        slot.write(ads, [1.0, 1e39, 1.0])
    with pytest.raises(MergeError, match=r"merge weights have shape \[1, 3\], expected \[3\]"):
        slot.write(ads, [[1.0, 1.0, 1.0]])


def test_torch_compile_does_not_recompile_per_query():
    """Stable shapes: new adapters, N, weights and modes reuse the compiled graph (only 'off' is a second one)."""
    from torch._dynamo.testing import CompileCounter

    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i) for i in range(4)]
    slot = FusedSlot(model, ads[0], max_adapters=4)
    x = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    counter = CompileCounter()  # counts compiled frames (older transformers add graph breaks: > 1 per call)
    compiled = torch.compile(lambda inp: model(inp).logits, backend=counter)
    frames = []
    with torch.no_grad():
        for adapters, w, mode in [(ads[:2], [1.0, 0.5], "cat"), (ads[1:], [0.3, 0.5, 2.0], "cat"),
                                  (ads[:3], [1.0, 2.0, 0.5], "separate")]:
            slot.write(adapters, w, mode=mode)
            got = compiled(x)
            frames.append(counter.frame_count)
            # cat: the independent dense model; separate: the same slot run eagerly
            want = logits(dense_model(model, adapters, w), x) if mode == "cat" else model(x).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert frames[0] >= 1 and frames == [frames[0]] * 3  # no recompilation for new adapters / N / w / mode
        slot.deactivate()
        torch.testing.assert_close(compiled(x), model(x).logits, rtol=0, atol=0)
        off = counter.frame_count
        assert off > frames[0]  # 'off' is one more specialisation...
        slot.write(ads[:1], None)
        compiled(x)
        slot.deactivate()
        compiled(x)
    assert counter.frame_count == off  # ...compiled once, then both states are reused
    torch._dynamo.reset()


def test_bfloat16_model(x):
    """Buffers follow the model's dtype; the values are the float32 merge rounded once, like activate()."""
    model = tiny_model("qwen2").to(torch.bfloat16)
    ads = [random_adapter(model, r, seed=i, alpha=8) for i, r in enumerate([2, 1, 2])]
    w = [0.7, 1.2, 1.1]
    slot = FusedSlot(model, ads[0], max_adapters=3)
    assert all(s.A.dtype == torch.bfloat16 for s in slot._buffers.segments)
    with slot.fused(ads, w):
        got = logits(model, x)
        cur = slot.current_adapter()
    ref = WeightedAdapterMerger("cat").merge(ads, w).adapter
    for k in ref.modules:  # bf16 rounding of the same float32 merge, adapter by adapter
        row = 0
        for i, a in enumerate(ads):
            r = a.modules[k].rank
            assert torch.equal(cur[k].A[i * 2:i * 2 + r], ref[k].A[row:row + r].bfloat16().float())
            row += r
    with activate(model, ref):
        want = logits(model, x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # separate with bfloat16 adapters: summed in float32 scratch, rounded once
    b16 = [a.to(dtype=torch.bfloat16) for a in ads[::2]]
    with slot.fused(b16, w[::2], mode="separate"):
        got = logits(model, x)
        cur = slot.current_adapter()
    ref = WeightedAdapterMerger("separate").merge(b16, w[::2]).adapter
    for k in ref.modules:
        assert torch.equal(cur[k].A[:2], ref[k].A.bfloat16().float())
        assert torch.equal(cur[k].B[:, :2], ref[k].B.bfloat16().float())
    with activate(model, ref):
        want = logits(model, x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("mode", ["cat", "separate"])
def test_adapter_dtypes_round_like_the_merger(dtype, mode):
    """Adapters stored in another dtype: the float32 slot holds exactly the merger's float32 result."""
    model = tiny_model("llama")
    ads = [random_adapter(model, 2, seed=i, alpha=5 + i).to(dtype=dtype) for i in range(3)]
    w = [0.1, 1 / 3, 1.7]
    slot = FusedSlot(model, ads[0], max_adapters=3)
    slot.write([pack_adapter(a) for a in ads], w, mode=mode)
    assert_same_adapter(slot.current_adapter(), WeightedAdapterMerger(mode).merge(ads, w).adapter)


def test_slot_does_not_keep_the_model_alive():
    import gc
    import weakref

    model = tiny_model("llama")
    ad = random_adapter(model, 2, seed=0)
    slot = FusedSlot.for_model(model, ad, max_adapters=2)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and slot.model is None
    slot.remove()  # still safe
