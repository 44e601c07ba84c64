"""Renamed public names keep working for one release, each with a DeprecationWarning naming the new one; files
written before the renames still load."""

import importlib
import json
import sys

import pytest
import torch

from fcprag_plugin import FusionController, LoraAdapter, fuse
from fcprag_plugin.controller import ControllerConfig
from fcprag_plugin.merge import merge_adapters
from fcprag_plugin.slot import FusedSlot
from helpers import tiny_model

PASSAGES = ["paris is the capital of france", "bananas are yellow fruit", "the eiffel tower is in paris"]


def forget(old: str) -> None:
    """Drop an alias package from sys.modules, so that importing it runs (and warns) again."""
    for mod in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        del sys.modules[mod]


@pytest.mark.parametrize("old,new,name", [("fcprag_plugin.fast", "fcprag_plugin.slot", "FusedSlot"),
                                          ("fcprag_plugin.hooks", "fcprag_plugin.hosts", "WeightProvider"),
                                          ("fcprag_plugin.labels", "fcprag_tools.labels", "ManifestRecord")])
def test_old_package_names_warn_and_point_to_the_new_ones(old, new, name):
    forget(old)
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_old_submodules_and_mixed_batches_still_import():
    forget("fcprag_plugin.hooks")
    forget("fcprag_plugin.fast")
    with pytest.warns(DeprecationWarning):
        from fcprag_plugin.hooks import prag as old_prag
        import fcprag_plugin.fast as fast
    from fcprag_plugin.hosts import prag
    from fcprag_tools.mixed import fused_mixed

    assert old_prag is prag and fast.fused_mixed is fused_mixed and sys.modules["fcprag_plugin.hooks.prag"] is prag


def test_renamed_attributes_and_keywords_warn(adapter_dirs):
    res = fuse(adapter_dirs, "what is the capital", PASSAGES)
    with pytest.warns(DeprecationWarning, match="probabilities"):
        assert res.weights == res.probabilities == [1 / 3] * 3
    with pytest.warns(DeprecationWarning, match="controller_mode"):
        assert res.fusion_weights.mode == "uniform"
    with pytest.warns(DeprecationWarning, match="controller_mode"):
        cfg = ControllerConfig(embed_dim=16, mode="uniform")
    assert cfg.controller_mode == "uniform"
    with pytest.warns(DeprecationWarning, match="controller_mode"):
        assert cfg.mode == "uniform"
    out = FusionController.fixed(g=0.5, tau=0.1, embed_dim=16)(torch.randn(1, 16), torch.randn(1, 3, 16))
    with pytest.warns(DeprecationWarning, match="probabilities"):
        assert torch.equal(out.weights, out.probabilities)
    merged = merge_adapters([LoraAdapter.from_pretrained(d) for d in adapter_dirs], [0.5, 1.0, 2.0])
    with pytest.warns(DeprecationWarning, match="MergeResult.weights is now .merge_weights"):
        assert merged.weights == merged.merge_weights == (0.5, 1.0, 2.0)


def test_fused_slot_activate_is_write(adapter_dirs):
    model = tiny_model()
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    x = torch.randint(0, 128, (1, 5))
    slot = FusedSlot.for_model(model, ads[0], max_adapters=3)
    with torch.no_grad():
        slot.write(ads, [0.5, 1.0, 2.0])
        want = model(x).logits
        slot.deactivate()
        with pytest.warns(DeprecationWarning, match="FusedSlot.activate is now .write"):
            slot.activate(ads, [0.5, 1.0, 2.0])
        assert torch.equal(model(x).logits, want) and slot.merge_mode == "cat"
    slot.remove()


def test_a_controller_folder_written_before_the_renames_loads_and_warns(tmp_path):
    """config.json with the old key 'mode' and the old one-number verdict (no scale / reweighting parts)."""
    ctrl = FusionController(embed_dim=16, score_hidden=[8], calib_hidden=8, init="uniform")
    d = ctrl.save_pretrained(tmp_path / "old")
    cfg = json.loads((d / "config.json").read_text())
    cfg["mode"] = cfg.pop("controller_mode")
    cfg["cv"] = {"gain": 0.0002, "ci95": [-0.001, 0.002], "verdict": "unproven", "folds": 5, "selected_epochs": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    old = FusionController.from_pretrained(d)
    assert old.config.controller_mode == "learned" and old.config.cv["verdict"] == "unproven"
    with pytest.warns(UserWarning, match="NOT shown to beat PRAG's sum"):
        assert old.warn_if_unproven()
    from fcprag_plugin.training.selection import verdict_lines

    assert "first order, epochs chosen on the same data" in verdict_lines(cfg["cv"])[0]
    uniform = FusionController.uniform(embed_dim=16)  # an old uniform folder saved its (unused) networks too
    cfg_u = {**json.loads((ctrl.save_pretrained(tmp_path / "u") / "config.json").read_text())}
    cfg_u["controller_mode"] = "uniform"
    (tmp_path / "u" / "config.json").write_text(json.dumps(cfg_u))
    loaded = FusionController.from_pretrained(tmp_path / "u")
    assert loaded.score_net is None and loaded.config.controller_mode == uniform.config.controller_mode
