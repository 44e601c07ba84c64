"""Model selection and a verdict that selection never saw: nested grouped cross-validation of the gain over PRAG's
sum, split in parts (scale, reweighting, per-query scale) estimated per record on held-out questions, with
bootstrap CIs over questions and Bonferroni-adjusted "shown" decisions. The method and its rationale:
``docs/label-format.md``, "Starting point, model selection and the verdict"."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..fileio import read_json_if_present
from .data import LabelTensors
from .evaluation import collect_outputs
from .stats import BOOTSTRAP, bootstrap_ci, group_kfold, group_means, loss_share, wilson_interval
from . import query_scale as qs

logger = logging.getLogger(__name__)

CV_NAME = "cv.json"
CV_PARTIAL_NAME = "cv.partial.json"  # the folds an interrupted cross-validation finished (select's on_fold)
PARTS = 2  # scale and reweighting: the Bonferroni factor of the "shown" decisions (3 with the per-query scale)
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
    grid, per_q = qs.grid_with_sum(scales, per_q[~torch.isnan(per_q).all(1)])
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


def has_measured(data: LabelTensors, metric: str) -> bool:
    """Whether ``data`` carries measured scale gains in ``metric`` for at least one record."""
    g = data.gains(metric)
    return g is not None and bool((~torch.isnan(g)).any())


def fold_kappa(data: LabelTensors, args: Any, rule: ScaleRule) -> tuple[float, str, dict[str, Any] | None]:
    """``(kappa, how, grid)`` on ``data``: ``args.kappa`` if a number (``"fixed"``), else :func:`choose_scale` on the
    gains in ``args.scale_metric`` (``"measured"``), else 1 (``"no_scales"``)."""
    if args.kappa != "auto":
        return float(args.kappa), "fixed", None
    if has_measured(data, args.scale_metric):
        kappa, grid = choose_scale(data.scales, data.gains(args.scale_metric), data.groups, rule)
        return kappa, "measured", grid
    return 1.0, "no_scales", None


def _from_json(values: Any) -> torch.Tensor:
    """A (nested) list written by ``write_json`` back to float64, its nulls to NaN."""
    return torch.from_numpy(np.array(values, dtype=np.float64))


def read_cv_partial(out: Any) -> dict[str, Any] | None:
    """``{"key", "n_folds", "folds"}`` of an interrupted cross-validation in run ``out``; None if none or unreadable."""
    try:
        got = read_json_if_present(Path(out) / CV_PARTIAL_NAME, ValueError)
    except (OSError, ValueError):
        return None
    return got if got is not None and isinstance(got.get("folds"), list) else None


def part_summary(values: torch.Tensor, groups: Sequence[str], seed: int, parts: int = PARTS) -> dict[str, Any]:
    """Mean, 95% CI and Bonferroni-adjusted CI (over ``parts``; ``shown``: above 0) of the non-NaN records."""
    ok = ~torch.isnan(values)
    v, g = values[ok], [gr for gr, k in zip(groups, ok.tolist()) if k]
    if not len(v):
        return {"gain": None, "ci95": None, "ci_adjusted": None, "shown": False, "n_records": 0}
    lo, hi = bootstrap_ci(v, g, seed)
    alo, ahi = bootstrap_ci(v, g, seed, level=1 - 0.05 / parts)
    return {"gain": float(v.mean()), "ci95": [lo, hi], "ci_adjusted": [alo, ahi], "shown": alo > 0,
            "n_records": int(ok.sum())}


@dataclass
class HeldOut:
    """What the outer folds measured per record on their held-out questions (NaN until its fold ran) and what
    each fold chose; ``results`` are the finished folds as ``select``'s ``on_fold`` gets them."""

    curve: torch.Tensor  # [E + 1, R]: the reweighting gain after e epochs (for the pooled count)
    rw: torch.Tensor  # [R]: the reweighting gain at the fold's own epoch choice (nested)
    scale: dict[str, torch.Tensor]  # metric -> [R]: the scale part at the fold's kappa
    q_gain: torch.Tensor  # [R]: the per-query scale against the sum
    q_global: torch.Tensor  # [R]: the fold's global kappa against the sum
    epochs: list[int] = field(default_factory=list)
    kappas: list[float] = field(default_factory=list)
    heads: list[Any] = field(default_factory=list)  # the per-query scale's choices per fold
    measured: bool = True  # every fold's scale part measured in the scale metric
    results: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def empty(cls, records: int, epochs: int, metrics: Any) -> "HeldOut":
        nan = lambda: torch.full((records,), float("nan"), dtype=torch.float64)  # noqa: E731
        return cls(torch.zeros(epochs + 1, records, dtype=torch.float64), nan(), {m: nan() for m in metrics}, nan(),
                   nan())

    def restore(self, r: dict[str, Any], per_query: bool) -> None:
        """Take fold result ``r`` (as written by :meth:`record`) of an interrupted run."""
        held = r["held"]
        self.curve[:, held], self.rw[held] = _from_json(r["curve"]), _from_json(r["reweighting"])
        for m in self.scale:
            self.scale[m][held] = _from_json(r["scale"][m])
        if per_query:
            self.q_gain[held], self.q_global[held] = _from_json(r["q_gain"]), _from_json(r["q_global"])
            self.heads.append(r["head"])
        self.measured &= bool(r["measured"])
        self.epochs.append(int(r["epochs"]))
        self.kappas.append(float(r["kappa"]))
        self.results.append(r)

    def record(self, held: list[int], epochs: int, kappa: float, measured: bool, per_query: bool) -> None:
        """Close the fold holding out ``held``: its choices and its JSON-ready result."""
        self.epochs.append(epochs)
        self.kappas.append(kappa)
        self.results.append({
            "held": held, "curve": self.curve[:, held].tolist(), "reweighting": self.rw[held].tolist(),
            "scale": {m: v[held].tolist() for m, v in self.scale.items()}, "measured": measured, "epochs": epochs,
            "kappa": kappa,
            **({"q_gain": self.q_gain[held].tolist(), "q_global": self.q_global[held].tolist(),
                "head": self.heads[-1] if len(self.heads) == len(self.epochs) else None} if per_query else {})})


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


def _fold_query_scale(rest_data: LabelTensors, held_data: LabelTensors, held: list[int], kappa: float, metric: str,
                      rule: ScaleRule, seed: int, out: HeldOut) -> None:
    """The per-query scale fitted on the fold's training questions, measured on its held-out ones, into ``out``."""
    head, info = qs.fit_query_scale(rest_data, metric, kappa, rule, seed)
    chosen = qs.choose(head, held_data)
    out.q_gain[held] = scale_gain(held_data, chosen, metric)[0]
    out.q_global[held] = scale_gain(held_data, torch.full((len(held),), kappa, dtype=torch.float64), metric)[0]
    out.heads.append({"l2": info["l2"], "rho": info["rho"],
                      "chosen": {repr(v): int((chosen == v).sum()) for v in info["grid"] if int((chosen == v).sum())}})


def _outer_fold(data: LabelTensors, args: Any, f: int, folds: list[list[int]], embedding_model: str,
                trainer: Callable[..., Any], rule: ScaleRule, per_query: bool, out: HeldOut, bar: Any) -> None:
    """Outer fold ``f``: epochs chosen on an inner split of its training questions, kappa (and the per-query scale)
    on all of them, each part measured on its held-out questions into ``out``."""
    held, metric = folds[f], args.scale_metric
    rest = sorted(set(range(len(data))) - set(held))
    inner = group_kfold([data.groups[i] for i in rest], len(folds), args.seed + 1 + f)
    # one question left to train on: its epochs are chosen on itself, still never on the held-out ones
    inner_val = [rest[i] for i in inner[0]] if len(inner) > 1 else []
    inner_train = sorted(set(rest) - set(inner_val))
    tr = trainer(data.subset(inner_train), None, None, replace(args, cv_folds=0), embedding_model)
    rest_data, held_data, val_data = data.subset(rest), data.subset(held), data.subset(inner_val or rest)
    kappa = fold_kappa(rest_data, args, rule)[0]
    e_f, held_w = _epoch_curves(tr, val_data, held_data, args.epochs, args.eval_batch_size, bar)
    for e, w in enumerate(held_w):
        out.curve[e, held] = reweighting_gain(w, held_data)
    w_held = held_w[e_f] * kappa
    out.rw[held] = reweighting_gain(w_held, held_data)
    # w~ sums to N, so the total is kappa exactly (up to rounding); a per-query scale makes it vary
    total = totals(w_held, held_data) if args.controller.get("calib_scale") else \
        torch.full((len(held),), kappa, dtype=torch.float64)
    measured: dict[str, bool] = {}
    for m in out.scale:
        out.scale[m][held], measured[m] = scale_gain(held_data, total, m)
    out.measured &= measured[metric]
    if per_query and has_measured(rest_data, metric):
        _fold_query_scale(rest_data, held_data, held, kappa, metric, rule, args.seed + f, out)
    out.record(held, e_f, kappa, measured[metric], per_query)


def _query_part(data: LabelTensors, args: Any, rule: ScaleRule, out: HeldOut, parts: int,
                scale_share: float | None) -> dict[str, Any]:
    """The per-query scale part against the folds' global kappa, and whether it keeps the risk rule: its held-out
    loss share's upper bound within the rule, or no larger than the global scale's share ``scale_share``."""
    q_part = {**part_summary(out.q_gain - out.q_global, data.groups, args.seed, parts), "measured": True,
              "metric": args.scale_metric, "against": "the global kappa chosen on the same training folds",
              "vs_sum": part_summary(out.q_gain, data.groups, args.seed, parts),
              "held_out_loss_share": {**loss_share(out.q_gain, data.groups, rule.loss_margin),
                                      "allowed": rule.max_loss_share},
              "folds": out.heads}
    ls = q_part["held_out_loss_share"]
    q_part["keeps_rule"] = ls["share"] is not None and (ls["ci95"][1] <= rule.max_loss_share
                                                        or ls["share"] <= (scale_share or 0.0))
    return q_part


def _report(data: LabelTensors, args: Any, rule: ScaleRule, out: HeldOut, folds: int, metrics: list[str],
            per_query: bool) -> dict[str, Any]:
    """The cross-validation's JSON-ready dict without what ships (:func:`_ship`) and its time."""
    pooled = out.curve.mean(1)
    kappa, how, grid = fold_kappa(data, args, rule)
    parts = PARTS + bool(per_query)
    sc = out.scale[args.scale_metric]
    report: dict[str, Any] = {
        "method": "nested grouped CV: epochs chosen on an inner split, kappa (and the per-query scale) on the "
                  "outer training questions",
        "folds": folds, "n_records": len(data), "n_groups": len(set(data.groups)), "max_epochs": args.epochs,
        "objective": args.objective,
        "selected_epochs": int(torch.argmax(pooled)),  # first maximum: the fewest epochs among ties (0 = uniform)
        "fold_epochs": out.epochs, "scale_metric": args.scale_metric,
        "scale": {**part_summary(sc, data.groups, args.seed, parts), "kappa": kappa, "chosen_by": how,
                  "metric": args.scale_metric, "measured": out.measured and how != "no_scales",
                  "fold_kappas": out.kappas, "at_grid_edge": bool(grid and grid["at_grid_edge"]), "grid": grid,
                  "rule": asdict(rule) if how == "measured" else None,
                  "held_out_loss_share": {**loss_share(sc, data.groups, rule.loss_margin),
                                          "allowed": rule.max_loss_share, "margin": rule.loss_margin},
                  "by_metric": {m: part_summary(out.scale[m], data.groups, args.seed, parts) for m in metrics}},
        "reweighting": {**part_summary(out.rw, data.groups, args.seed, parts), "first_order": True,
                        "measured": False},
        "curve": [float(v) for v in pooled], "ci_method": CI_METHOD,
        "loss_share_ci_method": "Wilson score interval (95%) over questions",
        "metric": "per record, on held-out questions: scale m(kappa) - m(1) (measured on the labels' scale grid), "
                  "reweighting sum_i (w~_i - T) delta_i (first order, deltas taken at PRAG's sum), per-query "
                  "scale m(s_q) - m(kappa) (measured)",
    }
    if per_query:
        report["query_scale"] = _query_part(data, args, rule, out, parts,
                                            report["scale"]["held_out_loss_share"]["share"])
    return report


def _ship(report: dict[str, Any], data: LabelTensors, args: Any, out: HeldOut) -> None:
    """Add to ``report`` what ships (see :func:`select`), at which kappa, and its verdict."""
    ship_kappa = report["scale"]["kappa"] if report["scale"]["shown"] or args.kappa != "auto" else 1.0
    q_part = report.get("query_scale")
    if args.keep_network:
        shipped = "network"
    elif q_part is not None and q_part["shown"] and q_part["keeps_rule"]:
        shipped = "query_scale"
    else:
        shipped = "scale_only" if ship_kappa != 1.0 else "prag_sum"
    zero = torch.zeros(len(data), dtype=torch.float64)
    total = out.q_gain if shipped == "query_scale" else \
        (out.scale[args.scale_metric] if ship_kappa != 1.0 else zero) + \
        (out.rw if shipped == "network" and args.scale_metric == "label" else zero)
    summary = part_summary(total, data.groups, args.seed)
    report.update(shipped=shipped, kappa=ship_kappa, gain=summary["gain"], ci95=summary["ci95"],
                  verdict="better_than_uniform" if summary["ci95"] and summary["ci95"][0] > 0 else "unproven")


def select(data: LabelTensors, args: Any, embedding_model: str, trainer: Callable[..., Any],
           rule: ScaleRule = ScaleRule(), progress: bool = False, done: Sequence[dict[str, Any]] = (),
           on_fold: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Nested grouped CV -> a JSON-ready dict (``cv.json``): epochs and ``kappa`` to ship, the parts with their CIs,
    what ships (``network`` with ``keep_network``, else ``query_scale`` if shown within the risk rule, else
    ``scale_only``; ``prag_sum`` at kappa 1) and its verdict. ``trainer(train_data, None, None, args, embedding_model)``
    builds a fold's trainer; ``on_fold(results)`` gets the finished folds after each fold, ``done`` skips them."""
    t0 = time.perf_counter()
    folds = group_kfold(data.groups, args.cv_folds, args.seed)
    if len(folds) < 2:
        raise ValueError(f"cross-validation needs at least 2 groups (questions), got {len(folds)}")
    metric = args.scale_metric
    metrics = [m for m in SCALE_METRICS if data.gains(m) is not None]
    per_query = args.kappa == "auto" and args.per_query_scale and has_measured(data, metric)
    out = HeldOut.empty(len(data), args.epochs, {metric, *metrics})
    with tqdm(total=len(folds) * args.epochs, unit="epoch", desc=f"nested {len(folds)}-fold CV",
              dynamic_ncols=True, disable=not progress) as bar:
        for f, held in enumerate(folds):
            if f < len(done) and done[f].get("held") == held:  # finished by an interrupted run
                out.restore(done[f], per_query)
                bar.update(args.epochs)
                continue
            _outer_fold(data, args, f, folds, embedding_model, trainer, rule, per_query, out, bar)
            if on_fold is not None:
                on_fold(out.results)
    report = _report(data, args, rule, out, len(folds), metrics, per_query)
    _ship(report, data, args, out)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    logger.info("cross-validation: ships %s at kappa %.4g, gain %s, %s", report["shipped"], report["kappa"],
                report["gain"], report["verdict"])
    return report
