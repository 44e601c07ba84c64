"""training/selection.py: nested CV, the scale/reweighting split and its verdict, kappa from measured scales.

References are written out by hand here (loops over questions and scales), never with the module's helpers.
"""

import json
import math

import pytest
import torch

from fcprag_plugin import FusionController
from helpers import wilson_by_bisection
from fcprag_plugin.training import train_controller
from fcprag_plugin.training.data import build_tensors
from fcprag_plugin.controller import ControllerOutput
from fcprag_plugin.training.selection import ScaleRule, choose_scale, reweighting_gain, scale_gain, select
from fcprag_plugin.training import TrainArgs
from fcprag_tools.synthetic import synthetic_records, table_encoder
from fcprag_tools.train_report import train_table

# small and fast, but the nets move enough in 6 epochs to learn a planted signal (and to overfit noise)
QUICK = dict(epochs=6, lr=3e-3, controller={"score_hidden": [16], "calib_hidden": 8},
             progress=False, precision="fp32", threads=1, cache_dir="", objective="risk")
GRID = [0.5, 1.5, 2.0, 3.0, 4.0]


def train(tmp_path, kind, seed, **kw):
    recs, table = synthetic_records(120, 3, 8, kind=kind, noise=0.1, seed=seed, groups=120,
                                    scales=GRID if kind in ("scale", "noise") else None)
    return train_controller(recs, tmp_path / f"{kind}{seed}", encoder=table_encoder(table, "syn8"),
                            **{**QUICK, "kappa": "auto", **kw})


def test_choose_scale_against_a_hand_written_rule():
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([0.5, 1.5, 2.0, 3.0], dtype=torch.float64)
    gains = (torch.randn(60, 4, generator=gen, dtype=torch.float64) * torch.tensor([0.2, 0.1, 0.25, 0.6])
             + torch.tensor([-0.1, 0.1, 0.2, 0.25]))  # the larger scales gain more on average and risk more
    gains[3, :] = float("nan")  # a record without measurements
    groups = [f"q{i // 2}" for i in range(60)]  # two records per question
    chosen = set()
    for rule in (ScaleRule(0.1, 0.1), ScaleRule(0.3, 0.2), ScaleRule(0.45, 0.2), ScaleRule(1.0, 0.0),
                 ScaleRule(0.0, 5.0), ScaleRule(0.3, 0.2, "observed"), ScaleRule(0.2, 0.1, "observed")):
        best = (0.0, -1.0)  # (mean gain, -scale) of scale 1: PRAG's sum, always allowed
        for j, s in enumerate(scales.tolist()):
            per_q = {}
            for i, g in enumerate(groups):
                if not math.isnan(gains[i, j]):
                    per_q.setdefault(g, []).append(float(gains[i, j]))
            means = [sum(v) / len(v) for v in per_q.values()]
            lost = sum(m < -rule.loss_margin for m in means)
            share = lost / len(means) if rule.bound == "observed" else wilson_by_bisection(lost, len(means), True)
            if share <= rule.max_loss_share and (sum(means) / len(means), -s) > best:
                best = (sum(means) / len(means), -s)
        kappa, info = choose_scale(scales, gains, groups, rule)
        chosen.add(kappa)
        assert kappa == -best[1], rule
        assert info["grid"] == [0.5, 1.0, 1.5, 2.0, 3.0] and info["questions"] == 30
        assert info["at_grid_edge"] == (kappa in (0.5, 3.0))
        assert all(lo <= sh <= hi for sh, (lo, hi) in zip(info["loss_share"], info["loss_share_ci95"]))
    assert len(chosen) >= 3, chosen  # the rules above do not all agree: the test tells them apart
    # the upper bound is stricter than the observed share: here it stops one scale earlier
    assert choose_scale(scales, gains, groups, ScaleRule(0.3, 0.2))[0] < \
        choose_scale(scales, gains, groups, ScaleRule(0.3, 0.2, "observed"))[0]
    assert choose_scale(scales, gains, groups, ScaleRule(1.0, 0.0))[0] == 3.0  # no risk limit: the best mean
    assert choose_scale(scales, gains, groups, ScaleRule(0.0, 5.0, "observed"))[0] == 3.0  # no loss beyond 5
    # ... but no share is *shown* to be 0 from 30 questions: the upper bound allows only PRAG's sum
    assert choose_scale(scales, gains, groups, ScaleRule(0.0, 5.0))[0] == 1.0


def test_the_two_parts_against_their_formulas():
    recs, table = synthetic_records(12, (2, 4), 8, kind="scale", seed=2, groups=6, scales=GRID)
    data = build_tensors(recs, table_encoder(table, "syn8"))
    w = torch.rand(len(recs), data.mask.shape[1], generator=torch.Generator().manual_seed(1)) * data.mask
    got = reweighting_gain(w, data)
    for b, r in enumerate(recs):
        wb = w[b, : r.n].double().tolist()
        t = sum(wb) / r.n
        assert float(got[b]) == pytest.approx(sum((x - t) * d for x, d in zip(wb, r.deltas)), abs=1e-6)
    measured, all_measured = scale_gain(data, torch.full((len(recs),), 2.0))
    measured_at_2 = [r.metric_at_scales[GRID.index(2.0)] for r in recs]
    assert all_measured and measured.tolist() == pytest.approx(measured_at_2)
    off_grid, all_measured = scale_gain(data, torch.full((len(recs),), 2.5))  # not measured: first order
    assert not all_measured and off_grid.tolist() == pytest.approx([1.5 * sum(r.deltas) for r in recs], abs=1e-6)
    assert scale_gain(data, torch.ones(len(recs)))[0].tolist() == [0.0] * len(recs)  # scale 1 is the sum itself
    some = recs[:5] + [type(r)(id=r.id, query=r.query, passages=r.passages, deltas=r.deltas) for r in recs[5:]]
    part, measured = scale_gain(build_tensors(some, table_encoder(table, "syn8")), torch.full((12,), 2.0))
    assert measured and part[:5].tolist() == measured_at_2[:5] and torch.isnan(part[5:]).all()  # no extrapolation


def test_noise_labels_are_not_shown_at_more_than_the_nominal_rate(tmp_path):
    """20 label sets of pure noise (i.i.d. deltas, scale gains pure noise), kappa chosen too: at most 1 (5%) may be
    called better, in each part."""
    shown = []
    for seed in range(20):
        cv = train(tmp_path, "noise", 100 + seed).metrics["cv"]
        shown.append((cv["verdict"] == "better_than_uniform", cv["reweighting"]["shown"], cv["scale"]["shown"],
                      cv["shipped"]))
    assert sum(v[0] for v in shown) <= 1, shown
    assert all(sum(v[k] for v in shown) <= 1 for k in (1, 2)), shown
    assert sum(v[3] not in ("prag_sum", "scale_only") for v in shown) <= 1, shown


class RandomWeights(torch.nn.Module):
    """A stand-in controller whose weights are new random numbers after every epoch, unrelated to the labels:
    every epoch count is worth exactly nothing, and a selection that looks at the scored questions would find
    one that seems to help."""

    def __init__(self, seed):
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, e_q, E_p, mask=None, side=None):
        mask = torch.ones(E_p.shape[:2], dtype=torch.bool) if mask is None else mask
        w = (1 + 0.5 * torch.randn(E_p.shape[:2], generator=self.gen)).clamp_min(0.05) * mask
        w = w * mask.sum(1, keepdim=True) / w.sum(1, keepdim=True)
        zeros = torch.zeros(E_p.shape[0])
        return ControllerOutput(w / 3, zeros, zeros, w / 3, w, mask)


class RandomTrainer:
    risk_lambda = 1.0

    def __init__(self, data, args, name):
        self.controller = RandomWeights(len(data))

    def train_epoch(self):
        pass


def test_choosing_among_many_worthless_epoch_counts_is_not_called_a_gain():
    """Selection-unbiasedness itself: 10 epoch counts of random weights, 40 label sets; the nested choice may call
    the reweighting shown in at most 2 (5%). Choosing each fold's epochs on its own held-out questions (what the
    verdict did before) calls it shown in most of them on these data."""
    args = TrainArgs(epochs=10, cv_folds=5, kappa=1.0)
    shown = 0
    for seed in range(40):
        recs, table = synthetic_records(60, 3, 8, kind="noise", noise=0.1, seed=seed, groups=30)
        cv = select(build_tensors(recs, table_encoder(table, "syn8")), args, "syn8", RandomTrainer)
        shown += cv["reweighting"]["shown"]
    assert shown <= 2, shown


def test_labels_where_only_the_total_scale_helps(tmp_path):
    res = train(tmp_path, "scale", 7)
    cv = res.metrics["cv"]
    assert cv["scale"]["chosen_by"] == "measured" and cv["scale"]["measured"] and cv["kappa"] == 2.0
    assert cv["scale"]["shown"] and cv["scale"]["ci95"][0] > 0  # the scale part is above 0
    assert not cv["reweighting"]["shown"] and cv["reweighting"]["ci_adjusted"][0] <= 0  # the reweighting is not
    assert cv["shipped"] == "scale_only" and cv["verdict"] == "better_than_uniform"
    assert not cv["scale"]["at_grid_edge"]  # 2.0 is inside the grid
    saved = FusionController.from_pretrained(res.out)
    assert saved.config.controller_mode == "uniform" and saved.config.kappa == 2.0
    assert saved.score_net is None and saved.config.cv["shipped"] == "scale_only"
    text = train_table(res.metrics)
    assert "a scale-only controller (PRAG's sum times 2, no network)" in text
    assert "the learned network is not saved, because its reweighting part is first order, not a measurement" in text
    assert "measured" in text and "fcprag study" in text and "--keep-network" in text


def test_planted_passage_specific_labels(tmp_path):
    """The reweighting part is first order: even when it is "shown" the network ships only with keep_network."""
    res = train(tmp_path, "planted", 1, kappa=1.0)
    cv = res.metrics["cv"]
    assert cv["reweighting"]["shown"] and cv["reweighting"]["ci95"][0] > 0 and cv["reweighting"]["first_order"]
    assert not cv["reweighting"]["measured"] and cv["shipped"] == "prag_sum"  # scale-only at kappa 1
    text = train_table(res.metrics)
    assert "FIRST ORDER" in text and "fcprag study" in text
    assert FusionController.from_pretrained(res.out).config.controller_mode == "uniform"
    res = train(tmp_path, "planted", 1, kappa=1.0, keep_network=True, overwrite=True)
    cv = res.metrics["cv"]
    assert cv["reweighting"]["shown"] and cv["shipped"] == "network"
    assert cv["scale"]["gain"] == 0.0 and not cv["scale"]["shown"]  # kappa 1: no scale part at all
    assert cv["verdict"] == "better_than_uniform" and cv["gain"] == pytest.approx(cv["reweighting"]["gain"])
    assert len(cv["fold_epochs"]) == cv["folds"] and cv["curve"][0] == 0.0  # epoch 0 is uniform weights
    saved = json.loads((res.out / "config.json").read_text())["cv"]
    assert saved["reweighting"]["ci95"] == cv["reweighting"]["ci95"] and saved["shipped"] == "network"
    assert saved["reweighting"]["first_order"] and "because --keep-network asked for it" in train_table(res.metrics)


def test_without_scale_measurements_kappa_stays_1_and_the_grid_edge_is_flagged(tmp_path):
    recs, table = synthetic_records(120, 3, 8, kind="scale", noise=0.1, seed=5, groups=120, scales=[0.5, 1.5, 2.0],
                                    best_scale=4.0)  # the optimum lies beyond the grid
    res = train_controller(recs, tmp_path / "edge", encoder=table_encoder(table, "syn8"), kappa="auto", **QUICK)
    cv = res.metrics["cv"]
    assert cv["kappa"] == 2.0 and cv["scale"]["at_grid_edge"]
    assert "edge of the measured grid" in train_table(res.metrics)
    plain = [type(r)(id=r.id, query=r.query, passages=r.passages, deltas=r.deltas, group=r.group) for r in recs]
    res = train_controller(plain, tmp_path / "fo", encoder=table_encoder(table, "syn8"), kappa="auto", **QUICK)
    cv = res.metrics["cv"]  # every delta is positive: a first-order extrapolation would ask for a larger total
    assert cv["scale"]["chosen_by"] == "no_scales" and cv["kappa"] == 1.0 and not cv["scale"]["measured"]
    assert "no scale measurements in the labels" in train_table(res.metrics)
    assert FusionController.from_pretrained(res.out).config.kappa == 1.0


def test_keep_network_ships_the_learned_controller_and_warns(tmp_path):
    res = train(tmp_path, "noise", 3, keep_network=True, kappa=1.0)
    cv = res.metrics["cv"]
    assert cv["shipped"] == "network" and not cv["reweighting"]["shown"] and cv["verdict"] == "unproven"
    saved = FusionController.from_pretrained(res.out)
    assert saved.config.controller_mode == "learned"
    with pytest.warns(UserWarning, match="NOT shown to beat PRAG's sum"):
        assert saved.warn_if_unproven()
