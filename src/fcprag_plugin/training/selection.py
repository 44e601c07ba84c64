"""Model selection and a verdict that selection never saw: nested grouped cross-validation of the gain over PRAG's
sum, split in two parts (scale, reweighting) estimated per record on held-out questions, with bootstrap CIs over
questions and Bonferroni-adjusted "shown" decisions. The method and its rationale:
``docs/label-format.md``, "Starting point, model selection and the verdict"."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

import torch

from ..progress import progress_bar
from .data import LabelTensors
from .evaluation import collect_outputs
from .stats import BOOTSTRAP, bootstrap_ci, group_kfold, group_means, loss_share, wilson_interval

logger = logging.getLogger(__name__)

CV_NAME = "cv.json"
PARTS = 2  # scale and reweighting: the Bonferroni factor of the "shown" decisions
CI_METHOD = f"percentile bootstrap over questions (groups), {BOOTSTRAP} resamples"
SCALE_METRICS = ("label", "f1")
BOUNDS = ("upper", "observed")


@dataclass(frozen=True)
class ScaleRule:
    """``kappa`` from measured scales: the largest mean gain among scale 1 and the scales whose share of questions
    losing more than ``loss_margin`` (``bound``: its 95% Wilson ``"upper"`` bound or ``"observed"``) is at most
    ``max_loss_share``."""

    max_loss_share: float = 0.1
    loss_margin: float = 0.1
    bound: str = "upper"


def choose_scale(scales: torch.Tensor, gains: torch.Tensor, groups: Sequence[str], rule: ScaleRule
                 ) -> tuple[float, dict[str, Any]]:
    """``kappa`` by ``rule`` from measured gains ``[R, S]`` at ``scales [S]`` (NaN: unmeasured; scale 1 always a
    candidate, ties to the smaller) and ``{"grid", "mean_gain", "loss_share", "loss_share_ci95", "bound",
    "at_grid_edge", "questions"}``."""
    per_q = group_means(gains, groups)
    grid, per_q = scales.tolist(), per_q[~torch.isnan(per_q).all(1)]
    if 1.0 not in grid:  # PRAG's sum itself: gain 0
        grid, per_q = grid + [1.0], torch.cat([per_q, torch.zeros(len(per_q), 1, dtype=per_q.dtype)], 1)
    order = sorted(range(len(grid)), key=grid.__getitem__)
    grid, per_q = [grid[j] for j in order], per_q[:, order]
    mean, n = per_q.nanmean(0).tolist(), len(per_q)
    lost = (per_q < -rule.loss_margin).sum(0).tolist()
    ci = [list(wilson_interval(int(k), n)) for k in lost]
    tested = [ci[j][1] if rule.bound == "upper" else lost[j] / n for j in range(len(grid))]
    feasible = [j for j in range(len(grid)) if grid[j] == 1.0 or tested[j] <= rule.max_loss_share]
    kappa = grid[max(feasible, key=lambda j: (mean[j], -grid[j]))]
    return kappa, {"grid": grid, "mean_gain": mean, "loss_share": [k / n for k in lost], "loss_share_ci95": ci,
                   "bound": rule.bound, "at_grid_edge": kappa != 1.0 and kappa in (grid[0], grid[-1]),
                   "questions": n}


def scale_gain(data: LabelTensors, total: torch.Tensor, metric: str = "label") -> tuple[torch.Tensor, bool]:
    """``([R], measured)``: the gain in ``metric`` (``"label"`` / ``"f1"``) of PRAG's sum times ``total [R]`` over
    the sum; measured when every total is 1 or on the scale grid (NaN: no measurement), else the label metric's
    first-order ``(total - 1) sum_i delta_i`` (F1: NaN)."""
    t = total.double()
    gains = data.gains(metric)
    on_grid = gains is not None and all(v == 1.0 or v in data.scales.tolist() for v in t.unique().tolist())
    if not on_grid:
        if bool((t == 1.0).all()):
            return torch.zeros(len(data), dtype=torch.float64), True
        if metric == "f1":
            return torch.full((len(data),), float("nan"), dtype=torch.float64), False
        return (t - 1) * (data.deltas.double() * data.mask).sum(1), False
    out = torch.full((len(data),), float("nan"), dtype=torch.float64)
    for j, s in enumerate(data.scales.tolist()):
        out[t == s] = gains[t == s, j]
    out[t == 1.0] = 0.0
    return out, True


def totals(w_tilde: torch.Tensor, data: LabelTensors) -> torch.Tensor:
    """The total scale ``T = mean_i w~_i`` of each record (``[R]``)."""
    m = data.mask.double()
    return (w_tilde.double() * m).sum(1) / m.sum(1)


def reweighting_gain(w_tilde: torch.Tensor, data: LabelTensors) -> torch.Tensor:
    """Per record, ``sum_i (w~_i - T) delta_i`` with ``T`` the mean of ``w~ [R, N]`` over the real passages
    (:func:`totals`): the first-order gain of the weights over uniform weights at the same total."""
    m = data.mask.double()
    return ((w_tilde.double() * m - totals(w_tilde, data).unsqueeze(1)) * m * data.deltas.double()).sum(1)


def fold_kappa(data: LabelTensors, args: Any, rule: ScaleRule) -> tuple[float, str, dict[str, Any] | None]:
    """``(kappa, how, grid)`` on ``data``: ``args.kappa`` if a number (``"fixed"``), else :func:`choose_scale` on the
    label metric's measured gains (``"measured"``), else 1 (``"no_scales"``)."""
    if args.kappa != "auto":
        return float(args.kappa), "fixed", None
    gains = data.gains("label")
    if gains is not None and bool((~torch.isnan(gains)).any()):  # a record with a measured scale
        kappa, grid = choose_scale(data.scales, gains, data.groups, rule)
        return kappa, "measured", grid
    return 1.0, "no_scales", None


def part_summary(values: torch.Tensor, groups: Sequence[str], seed: int) -> dict[str, Any]:
    """Mean, 95% CI and Bonferroni-adjusted CI (over the :data:`PARTS`; ``shown``: above 0) of the non-NaN records."""
    ok = ~torch.isnan(values)
    v, g = values[ok], [gr for gr, k in zip(groups, ok.tolist()) if k]
    if not len(v):
        return {"gain": None, "ci95": None, "ci_adjusted": None, "shown": False, "n_records": 0}
    lo, hi = bootstrap_ci(v, g, seed)
    alo, ahi = bootstrap_ci(v, g, seed, level=1 - 0.05 / PARTS)
    return {"gain": float(v.mean()), "ci95": [lo, hi], "ci_adjusted": [alo, ahi], "shown": alo > 0,
            "n_records": int(ok.sum())}


def _epoch_curves(tr: Any, val_data: LabelTensors, held_data: LabelTensors, epochs: int, batch_size: int,
                  bar: Any) -> tuple[int, list[torch.Tensor]]:
    """Train ``tr`` epoch by epoch: ``(e_f, held_w)``, the epoch count (0 .. ``epochs``) with the best mean
    reweighting gain on ``val_data`` (the fewest among ties) and ``w~`` of ``held_data`` after each epoch count."""
    val_curve, held_w = [], []
    for e in range(epochs + 1):
        if e > 0:
            tr.train_epoch()
            bar.update(1)
        w_val = collect_outputs(tr.controller, val_data, batch_size)["wt"]
        val_curve.append(float(reweighting_gain(w_val, val_data).mean()))
        held_w.append(collect_outputs(tr.controller, held_data, batch_size)["wt"])
    return max(range(epochs + 1), key=lambda e: (val_curve[e], -e)), held_w


def _outer_fold(data: LabelTensors, args: Any, f: int, folds: list[list[int]], embedding_model: str,
                trainer: Callable[..., Any], rule: ScaleRule, metrics: Sequence[str], bar: Any) -> dict[str, Any]:
    """Outer fold ``f``: epochs chosen on an inner split of its training questions, kappa on all of them, each part
    measured on its held-out questions: ``{"held", "curve" [E + 1, n], "reweighting" [n], "scale" {metric: [n]},
    "measured", "epochs", "kappa"}``."""
    held = folds[f]
    rest = sorted(set(range(len(data))) - set(held))
    inner = group_kfold([data.groups[i] for i in rest], len(folds), args.seed + 1 + f)
    # one question left to train on: its epochs are chosen on itself, still never on the held-out ones
    inner_val = [rest[i] for i in inner[0]] if len(inner) > 1 else []
    inner_train = sorted(set(rest) - set(inner_val))
    tr = trainer(data.subset(inner_train), replace(args, cv_folds=0), embedding_model)
    rest_data, held_data, val_data = data.subset(rest), data.subset(held), data.subset(inner_val or rest)
    kappa = fold_kappa(rest_data, args, rule)[0]
    e_f, held_w = _epoch_curves(tr, val_data, held_data, args.epochs, args.eval_batch_size, bar)
    w_held = held_w[e_f] * kappa
    # w~ sums to N, so the total is kappa exactly (up to rounding); the calibration net's scale c makes it vary
    total = totals(w_held, held_data) if args.controller.get("calib_scale") else \
        torch.full((len(held),), kappa, dtype=torch.float64)
    scale = {m: scale_gain(held_data, total, m) for m in metrics}
    return {"held": held, "curve": torch.stack([reweighting_gain(w, held_data) for w in held_w]),
            "reweighting": reweighting_gain(w_held, held_data),
            "scale": {m: g for m, (g, _) in scale.items()}, "measured": scale["label"][1],
            "epochs": e_f, "kappa": kappa}


def _report(data: LabelTensors, args: Any, rule: ScaleRule, results: list[dict[str, Any]], metrics: list[str]
            ) -> dict[str, Any]:
    """The cross-validation's JSON-ready dict from the folds' ``results`` without what ships (:func:`_ship`)."""
    nan = lambda: torch.full((len(data),), float("nan"), dtype=torch.float64)  # noqa: E731
    curve, rw = torch.zeros(args.epochs + 1, len(data), dtype=torch.float64), nan()
    scales = {m: nan() for m in results[0]["scale"]}
    for r in results:  # each record is held out in one fold
        held = r["held"]
        curve[:, held], rw[held] = r["curve"], r["reweighting"]
        for m, v in scales.items():
            v[held] = r["scale"][m]
    pooled = curve.mean(1)
    kappa, how, grid = fold_kappa(data, args, rule)
    sc = scales["label"]
    measured = all(r["measured"] for r in results) and how != "no_scales"
    report: dict[str, Any] = {
        "method": "nested grouped CV: epochs chosen on an inner split, kappa on the outer training questions",
        "folds": len(results), "n_records": len(data), "n_groups": len(set(data.groups)), "max_epochs": args.epochs,
        "objective": args.objective,
        "selected_epochs": int(torch.argmax(pooled)),  # first maximum: the fewest epochs among ties (0 = uniform)
        # kappa is chosen on the label metric (files of earlier versions may say "f1")
        "fold_epochs": [int(r["epochs"]) for r in results], "scale_metric": "label",
        "scale": {**part_summary(sc, data.groups, args.seed), "kappa": kappa, "chosen_by": how,
                  "metric": "label", "measured": measured,
                  "fold_kappas": [float(r["kappa"]) for r in results],
                  "at_grid_edge": bool(grid and grid["at_grid_edge"]), "grid": grid,
                  "rule": asdict(rule) if how == "measured" else None,
                  "held_out_loss_share": {**loss_share(sc, data.groups, rule.loss_margin),
                                          "allowed": rule.max_loss_share, "margin": rule.loss_margin},
                  "by_metric": {m: part_summary(scales[m], data.groups, args.seed) for m in metrics}},
        "reweighting": {**part_summary(rw, data.groups, args.seed), "first_order": True, "measured": False},
        "curve": [float(v) for v in pooled], "ci_method": CI_METHOD,
        "loss_share_ci_method": "Wilson score interval (95%) over questions",
        "metric": "per record, on held-out questions: scale m(kappa) - m(1) (measured on the labels' scale grid), "
                  "reweighting sum_i (w~_i - T) delta_i (first order, deltas taken at PRAG's sum)",
    }
    _ship(report, data, args, rw, sc)
    return report


def _ship(report: dict[str, Any], data: LabelTensors, args: Any, rw: torch.Tensor, sc: torch.Tensor) -> None:
    """Add to ``report`` what ships (see :func:`select`), at which kappa, and its verdict."""
    ship_kappa = report["scale"]["kappa"] if report["scale"]["shown"] or args.kappa != "auto" else 1.0
    shipped = "network" if args.keep_network else "scale_only" if ship_kappa != 1.0 else "prag_sum"
    zero = torch.zeros(len(data), dtype=torch.float64)
    total = (sc if ship_kappa != 1.0 else zero) + (rw if shipped == "network" else zero)
    summary = part_summary(total, data.groups, args.seed)
    report.update(shipped=shipped, kappa=ship_kappa, gain=summary["gain"], ci95=summary["ci95"],
                  verdict="better_than_uniform" if summary["ci95"] and summary["ci95"][0] > 0 else "unproven")


def select(data: LabelTensors, args: Any, embedding_model: str, trainer: Callable[..., Any],
           rule: ScaleRule = ScaleRule(), progress: bool = False) -> dict[str, Any]:
    """Nested grouped CV -> a JSON-ready dict (``cv.json``): epochs and ``kappa`` to ship, the parts with their CIs,
    what ships (``network`` with ``keep_network``, else ``scale_only``; ``prag_sum`` at kappa 1) and its verdict.
    ``trainer(train_data, args, embedding_model)`` builds a fold's trainer (``controller``, ``train_epoch()``)."""
    t0 = time.perf_counter()
    folds = group_kfold(data.groups, args.cv_folds, args.seed)
    if len(folds) < 2:
        raise ValueError(f"cross-validation needs at least 2 groups (questions), got {len(folds)}")
    metrics = [m for m in SCALE_METRICS if data.gains(m) is not None]
    with progress_bar(f"nested {len(folds)}-fold CV", len(folds) * args.epochs, unit="epoch", enabled=progress) \
            as bar:
        results = [_outer_fold(data, args, f, folds, embedding_model, trainer, rule,
                               list(dict.fromkeys(["label", *metrics])), bar) for f in range(len(folds))]
    report = _report(data, args, rule, results, metrics)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    logger.info("cross-validation: ships %s at kappa %.4g, gain %s, %s", report["shipped"], report["kappa"],
                report["gain"], report["verdict"])
    return report
