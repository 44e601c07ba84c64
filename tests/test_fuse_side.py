"""Side features end to end: fuse(), the slot path, the shims' WeightProvider, and kappa."""

import dataclasses

import pytest
import torch

from fcprag_plugin import FusionController, fuse, fuse_into
from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.controller import ControllerConfig
from fcprag_plugin.errors import ControllerError
from fcprag_plugin.hosts.base import WeightProvider
from helpers import dense_reference, tiny_model

Q = "who wrote the novel"
PS = ["the novel was written by a poet", "a river in france", "a band from ohio"]


def side_controller(*names):
    return FusionController(ControllerConfig(embed_dim=16, score_hidden=[8], calib_hidden=8, init="random", seed=4,
                                             side_features=list(names))).eval()


def test_fuse_passes_ranks_and_computes_adapter_stats(adapter_dirs, encoder16):
    ctrl = side_controller("retrieval_rank", "adapter_stats")
    ranks = [3.0, 1.0, 2.0]
    got = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16, retrieval_ranks=ranks)
    loaded = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    ref = ctrl.predict(Q, PS, encoder16, retrieval_ranks=ranks, adapter_stats=loaded).merge_weights[0].tolist()
    assert got.merge_weights == ref
    other = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16, retrieval_ranks=[1.0, 2.0, 3.0])
    assert other.merge_weights != got.merge_weights  # the ranks reach the controller
    # the merged update is the dense sum with those weights
    m = next(iter(got.adapter.modules))
    upd = got.adapter[m].scaling * got.adapter[m].B.double() @ got.adapter[m].A.double()
    assert torch.allclose(upd, dense_reference(loaded, ref, m), atol=1e-6)


def test_fuse_on_the_slot_gives_the_same_side_feature_weights(adapter_dirs, encoder16):
    ctrl = side_controller("retrieval_rank", "adapter_stats")
    ranks = [2.0, 3.0, 1.0]
    plain = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16, retrieval_ranks=ranks)
    with fuse_into(tiny_model(), adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16,
                   retrieval_ranks=ranks) as slot:
        assert slot.merge_weights == pytest.approx(plain.merge_weights, abs=1e-6)


def test_a_missing_optional_side_feature_is_equal_for_every_passage_and_logged_once(adapter_dirs, encoder16,
                                                                                     caplog):
    ctrl = side_controller("retrieval_score")
    given = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16, retrieval_scores=[0.4, 0.4, 0.4])
    varied = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16, retrieval_scores=[0.9, 0.1, 0.4])
    assert given.merge_weights != varied.merge_weights  # the feature matters when it varies
    with caplog.at_level("WARNING", logger="fcprag_plugin"):
        for _ in range(2):
            missing = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16)
            assert missing.merge_weights == given.merge_weights  # no scores: the same for every passage
    said = [r.getMessage() for r in caplog.records if "retrieval_score" in r.getMessage()]
    assert len(said) == 1 and "taken as equal for every passage" in said[0]
    strict = FusionController(dataclasses.replace(ctrl.config, side_optional=[])).eval()
    with pytest.raises(ControllerError, match=r"pass retrieval_scores= \(one value per passage\)"):
        fuse(adapter_dirs, Q, PS, controller=strict, encoder=encoder16)


def test_controllers_without_side_features_ignore_the_arguments(adapter_dirs, encoder16):
    ctrl = side_controller()
    a = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16)
    b = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16, retrieval_ranks=[3.0, 2.0, 1.0],
             retrieval_scores=[0.1, 0.2, 0.3])
    assert a.merge_weights == b.merge_weights


def test_merge_hook_gives_positions_as_ranks_and_reads_adapters_lazily(adapter_dirs, encoder16):
    ctrl = side_controller("retrieval_rank", "adapter_stats")
    loaded = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    calls = []
    hook = WeightProvider(controller=ctrl, encoder=encoder16)
    fw = hook.weights(Q, PS, adapters=lambda: calls.append(1) or loaded)
    ref = ctrl.predict(Q, PS, encoder16, retrieval_ranks=[1.0, 2.0, 3.0], adapter_stats=loaded)
    assert list(fw.merge_weights) == ref.merge_weights[0].tolist() and calls == [1]
    plain = WeightProvider(controller=side_controller(), encoder=encoder16)
    plain.weights(Q, PS, adapters=lambda: calls.append(2) or loaded)
    assert calls == [1]  # not read when the controller has no adapter_stats


def test_a_uniform_controller_with_kappa_scales_the_uniform_merge(adapter_dirs):
    ctrl = FusionController.uniform(embed_dim=16, kappa=2.0)
    got = fuse(adapter_dirs, Q, PS, controller=ctrl)
    assert got.merge_weights == [2.0, 2.0, 2.0]
    loaded = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    for m in got.adapter.modules:
        upd = got.adapter[m].scaling * got.adapter[m].B.double() @ got.adapter[m].A.double()
        assert torch.allclose(upd, dense_reference(loaded, [2.0] * 3, m), atol=1e-6)
    assert fuse(adapter_dirs, Q, PS, controller=FusionController.uniform(embed_dim=16)).merge_weights == [1.0] * 3


def test_fcprag_fuse_passes_retrieval_ranks(adapter_dirs, encoder16, tmp_path, monkeypatch, capsys):
    import json

    from fcprag_tools import cli

    ctrl = side_controller("retrieval_rank")
    d = ctrl.save_pretrained(tmp_path / "ctrl")
    monkeypatch.setattr("fcprag_plugin.encoding.get_encoder", lambda *a, **k: encoder16)
    monkeypatch.setattr(FusionController, "encoder", property(lambda self: encoder16))
    base = ["fuse", *sum((["--adapter", str(a)] for a in adapter_dirs), []), *sum((["--passage", p] for p in PS), []),
            "--query", Q, "--controller", str(d)]
    assert cli.main(base + ["--retrieval-rank", "2", "--retrieval-rank", "3", "--retrieval-rank", "1",
                            "--out", str(tmp_path / "o")]) == 0
    got = json.loads((tmp_path / "o" / "fusion.json").read_text())["merge_weights"]
    ref = ctrl.predict(Q, PS, encoder16, retrieval_ranks=[2.0, 3.0, 1.0]).merge_weights[0].tolist()
    assert got == pytest.approx(ref, abs=1e-6)
    capsys.readouterr()
    assert cli.main(base + ["--retrieval-rank", "1", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "--retrieval-rank" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o2").exists()
