"""weights.py: weigh (the one weighting call), the one weight check, FusionWeights from the controller to the logs,
strict JSON."""

import dataclasses
import json
import math

import pytest
import torch

from fcprag_plugin import FusionController, MergeError
from fcprag_plugin.fileio import finite_or_none
from fcprag_plugin.weights import FusionWeights, check_weights, is_uniform, weigh

PASSAGES = ["paris is the capital of france", "bananas are yellow fruit", "the eiffel tower is in paris"]
QUERY = "what is the capital of france"


def test_check_weights_rounds_like_float32_and_names_the_problem():
    assert check_weights(None, 3) == (1.0, 1.0, 1.0)
    assert check_weights([0.1, 2, 3.0], 3) == tuple(torch.tensor([0.1, 2, 3.0]).tolist())  # float32 values, floats
    assert check_weights(torch.tensor([0.5, 1.5], dtype=torch.float64), 2) == (0.5, 1.5)  # one type: a tuple
    with pytest.raises(MergeError, match=r"no adapters to merge \(N == 0\)"):
        check_weights([], 0)
    with pytest.raises(MergeError, match=r"shape \[2\], expected \[3\]"):
        check_weights([1.0, 2.0], 3)
    with pytest.raises(MergeError, match=r"shape \[1, 3\], expected \[3\]"):
        check_weights(torch.ones(1, 3), 3)
    with pytest.raises(MergeError, match="must be finite"):
        check_weights([1.0, float("nan")], 2)
    with pytest.raises(MergeError, match="must be finite"):
        check_weights([1.0, 1e39], 2)  # overflows float32


def test_uniform_is_decided_once_and_is_prags_merge():
    assert is_uniform(None) and is_uniform(FusionController.uniform(embed_dim=16))
    assert not is_uniform(FusionController.fixed(g=0.5, tau=0.1, embed_dim=16))
    fw = weigh(None, QUERY, PASSAGES)
    assert fw.tau is None and fw.g == 0.0 and fw.scores == (0.5, 0.5, 0.5)  # uniform: no temperature
    assert fw.merge_weights == (1.0, 1.0, 1.0) and fw.probabilities == pytest.approx((1 / 3,) * 3)
    assert fw.controller_mode == "uniform" and fw.uniform_merge and fw.n == 3
    ctrl = FusionController.uniform(embed_dim=16)
    assert weigh(ctrl, QUERY, PASSAGES) == fw  # the same weights, whatever says "uniform"


def test_from_the_controllers_prediction(encoder16):
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    fw = weigh(ctrl, QUERY, PASSAGES, encoder=encoder16)
    out = ctrl.predict(QUERY, PASSAGES, encoder16)  # independent: read the tensors directly
    assert list(fw.merge_weights) == out.merge_weights[0].tolist()
    assert list(fw.probabilities) == out.probabilities[0].tolist() and list(fw.scores) == out.scores[0].tolist()
    assert fw.g == float(out.g[0]) and fw.tau == float(out.tau[0]) and fw.controller_mode == "fixed"
    assert sum(fw.merge_weights) == pytest.approx(3, abs=1e-4) and not fw.uniform_merge
    with pytest.raises(dataclasses.FrozenInstanceError):
        fw.g = 0.0  # type: ignore[misc]


def test_to_json_is_strict():
    fw = FusionWeights.uniform(2)
    text = json.dumps(fw.to_json(), allow_nan=False)
    assert json.loads(text) == {"merge_weights": [1.0, 1.0], "probabilities": [0.5, 0.5], "scores": [0.5, 0.5],
                                "g": 0.0, "tau": None, "controller_mode": "uniform"}
    assert finite_or_none({"a": [1.0, float("inf"), (float("-inf"), 2)], "b": "x"}) == \
        {"a": [1.0, None, [None, 2]], "b": "x"}


def test_weigh_reads_adapters_only_when_needed_and_checks_the_recipe_once(tmp_path, encoder16):
    from fcprag_plugin import LoraAdapter
    from fcprag_plugin.features import adapter_recipe
    from helpers import make_adapter_dir

    ads = [LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"a{i}", seed=i)) for i in range(3)]
    calls = []

    def given():
        calls.append(1)
        return ads

    plain = FusionController.fixed(g=0.5, tau=0.1, embed_dim=16)
    assert weigh(plain, QUERY, PASSAGES, encoder=encoder16, adapters=given) == weigh(plain, QUERY, PASSAGES,
                                                                                    encoder=encoder16)
    assert calls == [] and not plain.needs_adapters  # nothing to read them for
    checked = FusionController.uniform(embed_dim=16, kappa=2.0)
    checked.config.trained_for = {"base_model": ["m"], "adapter_recipes": [adapter_recipe(ads[0])]}
    assert checked.needs_adapters
    for _ in range(2):
        assert weigh(checked, QUERY, PASSAGES, adapters=given) == FusionWeights.uniform(3, 2.0)
    assert calls == [1] and not checked.needs_adapters  # the recipe is checked once, on the controller
    # adapter statistics: read at every call (once each), and the weights are predict's with them
    stats = FusionController(embed_dim=16, score_hidden=[8], calib_hidden=8, side_features=["adapter_stats"], seed=0)
    calls.clear()
    fw = weigh(stats, QUERY, PASSAGES, encoder=encoder16, adapters=given)
    out = stats.predict(QUERY, PASSAGES, encoder16, adapter_stats=ads)
    assert calls == [1] and list(fw.merge_weights) == out.merge_weights[0].tolist()
    # a directory is read once per process and weighs as the object does
    stats.save_pretrained(tmp_path / "ctrl")
    assert weigh(tmp_path / "ctrl", QUERY, PASSAGES, encoder=encoder16, adapters=ads) == fw
