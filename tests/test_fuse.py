"""fuse(): adapters from paths / objects / live names, controller weights, merged update, input errors."""

import pytest
import torch

from fcprag_plugin import FusionController, FusionInputError, LoraAdapter, fuse, fuse_into
from fcprag_plugin import activate
from helpers import dense_reference, make_adapter_dir, tiny_model

GATE = "model.layers.0.mlp.gate_proj"
PASSAGES = ["paris is the capital of france", "bananas are yellow fruit", "the eiffel tower is in paris"]
QUERY = "what is the capital of france"


def test_uniform_by_default_is_prags_sum(adapter_dirs):
    res = fuse(adapter_dirs, QUERY, PASSAGES)
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    assert res.merge_weights == [1.0, 1.0, 1.0] and res.g == 0.0 and res.controller_mode == "uniform"
    for name in ads[0].modules:
        torch.testing.assert_close(res.adapter[name].delta(torch.float64), dense_reference(ads, [1, 1, 1], name))


def test_controller_weights_drive_the_merge(adapter_dirs, encoder16, tmp_path):
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    res = fuse(adapter_dirs, QUERY, PASSAGES, controller=ctrl, encoder=encoder16)
    # independent: recompute weights from the encoder embeddings by hand
    e_q = encoder16.encode([QUERY])[0]
    E = encoder16.encode(PASSAGES)
    s = (1 + E @ e_q) / 2
    w = 0.9 * torch.softmax(s / 0.05, 0) + 0.1 / 3
    wt = 3 * w / w.sum()
    torch.testing.assert_close(torch.tensor(res.merge_weights), wt, rtol=1e-5, atol=1e-6)
    assert abs(sum(res.merge_weights) - 3) < 1e-4 and max(res.merge_weights) > 1.2
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    torch.testing.assert_close(res.adapter[GATE].delta(torch.float64), dense_reference(ads, wt.tolist(), GATE),
                               rtol=1e-5, atol=1e-6)
    # a controller directory works the same as the object
    ctrl.save_pretrained(tmp_path / "ctrl")
    again = fuse(adapter_dirs, QUERY, PASSAGES, controller=tmp_path / "ctrl", encoder=encoder16)
    assert again.merge_weights == res.merge_weights


def test_adapter_objects_and_live_names(adapter_dirs):
    from peft import PeftModel

    pm = PeftModel.from_pretrained(tiny_model(), str(adapter_dirs[0]), adapter_name="0")
    pm.load_adapter(str(adapter_dirs[1]), adapter_name="1")
    obj = LoraAdapter.from_pretrained(adapter_dirs[2])
    res = fuse(["0", "1", obj], QUERY, PASSAGES, model=pm)
    ref = fuse(adapter_dirs, QUERY, PASSAGES)
    torch.testing.assert_close(res.adapter[GATE].delta(), ref.adapter[GATE].delta())


def test_separate_and_svd_modes(adapter_dirs):
    sep = fuse(adapter_dirs, QUERY, PASSAGES, mode="separate")
    assert sep.mode == "separate" and sep.adapter[GATE].rank == 2
    svd = fuse(adapter_dirs, QUERY, PASSAGES, mode="svd", rank=3)
    assert svd.adapter[GATE].rank == 3 and 0 <= svd.info["rel_error"] < 1


@pytest.mark.parametrize("adapters,query,passages,msg", [
    (["a", "b"], QUERY, ["x"], r"2 adapters but 1 passages"),
    ([], QUERY, [], r"adapters is empty"),
    (["a"], "", ["x"], r"query must be a non-empty string"),
    (["a"], "   ", ["x"], r"query must be a non-empty string"),
    (["a", "b"], QUERY, ["x", " "], r"passage 1 must be a non-empty string"),
    (["a"], QUERY, "x", r"passages must be a list"),
    ("a", QUERY, ["x"], r"adapters must be a list"),
])
def test_input_errors(adapters, query, passages, msg):
    with pytest.raises(FusionInputError, match=msg):
        fuse(adapters, query, passages)


def test_bad_adapter_type():
    with pytest.raises(FusionInputError, match=r"adapter 0 is a int"):
        fuse([3], QUERY, ["x"])


def test_fuse_into_equals_materialised_merge(adapter_dirs, encoder16):
    """fuse_into() switches the model's slot on; outputs equal activating the merged adapter."""
    from fcprag_plugin import activate
    from helpers import assert_bit_identical, state_snapshot

    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    model = tiny_model()
    snap = state_snapshot(model)
    x = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        base = model(x).logits
        for mode in ("cat", "separate"):
            ref = fuse(adapter_dirs, QUERY, PASSAGES, controller=ctrl, encoder=encoder16, mode=mode)
            with activate(model, ref.adapter):
                want = model(x).logits
            with fuse_into(model, adapter_dirs, QUERY, PASSAGES, controller=ctrl, encoder=encoder16,
                           mode=mode) as res:
                assert res.active and res.merge_weights == ref.merge_weights
                got = model(x).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert torch.equal(model(x).logits, base)  # switched off on leaving the block
    assert_bit_identical(model, snap)


def test_fuse_into_refuses_merge_options_and_svd(adapter_dirs):
    from fcprag_plugin import MergeError

    with pytest.raises(FusionInputError, match=r"fuse_into: unexpected option\(s\) \['rank'\]"):
        fuse_into(tiny_model(), adapter_dirs, QUERY, PASSAGES, mode="svd", rank=4)
    with pytest.raises(MergeError, match=r"mode 'svd' is not supported"):
        fuse_into(tiny_model(), adapter_dirs, QUERY, PASSAGES, mode="svd")
    with pytest.raises(TypeError, match=r"use_slot"):
        fuse(adapter_dirs, QUERY, PASSAGES, use_slot=True)  # cat takes no such option


@pytest.mark.parametrize("ranks", [(2, 4), (4, 2)])
def test_fuse_into_mixed_ranks_in_any_order(tmp_path, ranks):
    """The slot fuse_into() creates is sized for the fusion's largest rank, whatever the adapters' order."""
    dirs = [make_adapter_dir(tmp_path / f"a{i}", r=r, seed=i) for i, r in enumerate(ranks)]
    ads = [LoraAdapter.from_pretrained(d) for d in dirs]
    model = tiny_model()
    x = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        with fuse_into(model, dirs, QUERY, PASSAGES[:2]) as res:
            got = model(x).logits
            live = res.slot.current_adapter()
        for name in ads[0].modules:  # the slot holds exactly sum_i s_i B_i A_i
            torch.testing.assert_close(live[name].delta(torch.float64), dense_reference(ads, [1, 1], name),
                                       rtol=1e-5, atol=1e-6)
        ref = fuse(dirs, QUERY, PASSAGES[:2])
        with activate(model, ref.adapter):
            want = model(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_duplicate_adapter_paths_warn_once(adapter_dirs, caplog):
    """Issue 13: a repeated adapter path counts twice (like PRAG); fuse() says so, once per fusion."""
    with caplog.at_level("WARNING", logger="fcprag_plugin"):
        res = fuse([adapter_dirs[0], adapter_dirs[1], adapter_dirs[0]], QUERY, PASSAGES)
    warnings = [r for r in caplog.records if "more than once" in r.getMessage()]
    assert len(warnings) == 1 and str(adapter_dirs[0].resolve()) in warnings[0].getMessage()
    ads = [LoraAdapter.from_pretrained(d) for d in (adapter_dirs[0], adapter_dirs[1], adapter_dirs[0])]
    torch.testing.assert_close(res.adapter[GATE].delta(torch.float64), dense_reference(ads, [1, 1, 1], GATE))
    caplog.clear()
    with caplog.at_level("WARNING", logger="fcprag_plugin"):
        fuse(adapter_dirs, QUERY, PASSAGES)
    assert not [r for r in caplog.records if "more than once" in r.getMessage()]


def test_uniform_fusion_json_is_strict(adapter_dirs):
    """Without a controller there is no temperature: tau is None in memory and null in to_json (strict JSON)."""
    import json

    res = fuse(adapter_dirs, QUERY, PASSAGES)
    text = json.dumps(res.to_json(), allow_nan=False)
    assert json.loads(text)["tau"] is None
    assert res.tau is None


def test_scale_only_controller_is_kappa_times_the_sum_and_builds_no_encoder(adapter_dirs, tmp_path, monkeypatch):
    import fcprag_plugin.encoding as encoding

    def no_encoder(*a, **k):
        raise AssertionError("a scale-only controller must not load a sentence encoder")

    monkeypatch.setattr(encoding, "get_encoder", no_encoder)
    monkeypatch.setattr(encoding, "TextEncoder", no_encoder)
    ctrl = FusionController.scale_only(1.75, embed_dim=384, embedding_model="nowhere/no-such-model")
    assert ctrl.score_net is None and ctrl.calib_net is None and sum(p.numel() for p in ctrl.parameters()) == 0
    saved = ctrl.save_pretrained(tmp_path / "scale")
    assert (saved / "model.safetensors").stat().st_size < 200  # no network on disk either
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    for c in (ctrl, saved):
        res = fuse(adapter_dirs, QUERY, PASSAGES, controller=c)
        assert res.merge_weights == [1.75] * 3 and res.g == 0.0 and res.tau is None
        for name in ads[0].modules:  # exactly kappa times PRAG's sum, against a dense reference
            torch.testing.assert_close(res.adapter[name].delta(torch.float64), dense_reference(ads, [1.75] * 3, name),
                                       rtol=1e-5, atol=1e-6)  # float32 factors against a float64 reference
