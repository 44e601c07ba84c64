"""Model selection and a verdict that selection never saw: nested grouped cross-validation of the gain over PRAG's
sum, split in parts (scale, reweighting, per-query scale) estimated per record on held-out questions, with
bootstrap CIs over questions and Bonferroni-adjusted "shown" decisions. The method and its rationale:
``docs/label-format.md``, "Starting point, model selection and the verdict"."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

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
    back = lambda v: [back(x) for x in v] if isinstance(v, list) else float("nan" if v is None else v)  # noqa: E731
    return torch.tensor(back(values), dtype=torch.float64)


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
    E, R = args.epochs, len(data)
    metric = args.scale_metric
    metrics = [m for m in SCALE_METRICS if data.gains(m) is not None]
    nan = lambda: torch.full((R,), float("nan"), dtype=torch.float64)  # noqa: E731
    curve = torch.zeros(E + 1, R, dtype=torch.float64)  # held-out reweighting gain after e epochs (for the count)
    rw = nan()  # nested: each fold's own epoch choice
    scale = {m: nan() for m in {metric, *metrics}}  # the scale part at each fold's kappa, per metric
    per_query = args.kappa == "auto" and getattr(args, "per_query_scale", False) and has_measured(data, metric)
    q_gain, q_global = nan(), nan()  # per-query scale vs the sum, and the fold's global kappa vs the sum
    fold_epochs, fold_kappas, fold_heads, scale_measured = [], [], [], True
    fold_args = replace(args, cv_folds=0)
    results: list[dict[str, Any]] = []
    with tqdm(total=len(folds) * E, unit="epoch", desc=f"nested {len(folds)}-fold CV", dynamic_ncols=True,
              disable=not progress) as bar:
        for f, held in enumerate(folds):
            if f < len(done) and done[f].get("held") == held:  # finished by an interrupted run
                r = done[f]
                curve[:, held], rw[held] = _from_json(r["curve"]), _from_json(r["reweighting"])
                for m in scale:
                    scale[m][held] = _from_json(r["scale"][m])
                if per_query:
                    q_gain[held], q_global[held] = _from_json(r["q_gain"]), _from_json(r["q_global"])
                    fold_heads.append(r["head"])
                scale_measured &= bool(r["measured"])
                fold_epochs.append(int(r["epochs"]))
                fold_kappas.append(float(r["kappa"]))
                results.append(r)
                bar.update(E)
                continue
            rest = [i for i in range(R) if i not in set(held)]
            inner = group_kfold([data.groups[i] for i in rest], len(folds), args.seed + 1 + f)
            # one question left to train on: its epochs are chosen on itself, still never on the held-out ones
            inner_val = [rest[i] for i in inner[0]] if len(inner) > 1 else []
            inner_train = sorted(set(rest) - set(inner_val))
            tr = trainer(data.subset(inner_train), None, None, fold_args, embedding_model)
            rest_data, held_data, val_data = data.subset(rest), data.subset(held), data.subset(inner_val or rest)
            kappa = fold_kappa(rest_data, args, rule)[0]
            val_curve, held_w = [], []
            for e in range(E + 1):
                if e > 0:
                    tr.train_epoch()
                    bar.update(1)
                w_val = collect_outputs(tr.controller, val_data, args.eval_batch_size)["wt"]
                val_curve.append(float(reweighting_gain(w_val, val_data).mean()))
                held_w.append(collect_outputs(tr.controller, held_data, args.eval_batch_size)["wt"])
                curve[e, held] = reweighting_gain(held_w[-1], held_data)
            e_f = max(range(E + 1), key=lambda e: (val_curve[e], -e))  # fewest epochs among ties
            w_held = held_w[e_f] * kappa
            rw[held] = reweighting_gain(w_held, held_data)
            # w~ sums to N, so the total is kappa exactly (up to rounding); a per-query scale makes it vary
            total = totals(w_held, held_data) if args.controller.get("calib_scale") else \
                torch.full((len(held),), kappa, dtype=torch.float64)
            measured: dict[str, bool] = {}
            for m in scale:
                scale[m][held], measured[m] = scale_gain(held_data, total, m)
            scale_measured &= measured[metric]
            if per_query and has_measured(rest_data, metric):
                head, info = qs.fit_query_scale(rest_data, metric, kappa, rule, args.seed + f)
                chosen = qs.choose(head, held_data)
                q_gain[held] = scale_gain(held_data, chosen, metric)[0]
                q_global[held] = scale_gain(held_data, torch.full((len(held),), kappa, dtype=torch.float64),
                                            metric)[0]
                fold_heads.append({"l2": info["l2"], "rho": info["rho"],
                                   "chosen": {repr(v): int((chosen == v).sum()) for v in info["grid"]
                                              if int((chosen == v).sum())}})
            fold_epochs.append(e_f)
            fold_kappas.append(kappa)
            results.append({"held": held, "curve": curve[:, held].tolist(), "reweighting": rw[held].tolist(),
                            "scale": {m: v[held].tolist() for m, v in scale.items()}, "measured": measured[metric],
                            "epochs": e_f, "kappa": kappa,
                            **({"q_gain": q_gain[held].tolist(), "q_global": q_global[held].tolist(),
                                "head": fold_heads[-1] if len(fold_heads) == len(fold_epochs) else None}
                               if per_query else {})})
            if on_fold is not None:
                on_fold(results)
    pooled = curve.mean(1)
    epochs = int(torch.argmax(pooled))  # first maximum: the fewest epochs among ties (0 = uniform weights)
    kappa, how, grid = fold_kappa(data, args, rule)
    parts = PARTS + bool(per_query)
    sc = scale[metric]
    out: dict[str, Any] = {
        "method": "nested grouped CV: epochs chosen on an inner split, kappa (and the per-query scale) on the "
                  "outer training questions",
        "folds": len(folds), "n_records": R, "n_groups": len(set(data.groups)), "max_epochs": E,
        "objective": args.objective, "selected_epochs": epochs, "fold_epochs": fold_epochs,
        "scale_metric": metric,
        "scale": {**part_summary(sc, data.groups, args.seed, parts), "kappa": kappa, "chosen_by": how,
                  "metric": metric, "measured": scale_measured and how != "no_scales", "fold_kappas": fold_kappas,
                  "at_grid_edge": bool(grid and grid["at_grid_edge"]), "grid": grid,
                  "rule": asdict(rule) if how == "measured" else None,
                  "held_out_loss_share": {**loss_share(sc, data.groups, rule.loss_margin),
                                          "allowed": rule.max_loss_share, "margin": rule.loss_margin},
                  "by_metric": {m: part_summary(scale[m], data.groups, args.seed, parts) for m in metrics}},
        "reweighting": {**part_summary(rw, data.groups, args.seed, parts), "first_order": True,
                        "measured": False},
        "curve": [float(v) for v in pooled], "ci_method": CI_METHOD,
        "loss_share_ci_method": "Wilson score interval (95%) over questions",
        "metric": "per record, on held-out questions: scale m(kappa) - m(1) (measured on the labels' scale grid), "
                  "reweighting sum_i (w~_i - T) delta_i (first order, deltas taken at PRAG's sum), per-query "
                  "scale m(s_q) - m(kappa) (measured)",
    }
    q_part = None
    if per_query:
        q_part = {**part_summary(q_gain - q_global, data.groups, args.seed, parts), "measured": True,
                  "metric": metric, "against": "the global kappa chosen on the same training folds",
                  "vs_sum": part_summary(q_gain, data.groups, args.seed, parts),
                  "held_out_loss_share": {**loss_share(q_gain, data.groups, rule.loss_margin),
                                          "allowed": rule.max_loss_share},
                  "folds": fold_heads}
        ls = q_part["held_out_loss_share"]
        q_part["keeps_rule"] = ls["share"] is not None and ls["ci95"][1] <= rule.max_loss_share or (
            ls["share"] is not None and ls["share"] <= (out["scale"]["held_out_loss_share"]["share"] or 0.0))
        out["query_scale"] = q_part
    ship_kappa = kappa if out["scale"]["shown"] or args.kappa != "auto" else 1.0
    if args.keep_network:
        shipped = "network"
    elif q_part is not None and q_part["shown"] and q_part["keeps_rule"]:
        shipped = "query_scale"
    else:
        shipped = "scale_only" if ship_kappa != 1.0 else "prag_sum"
    zero = torch.zeros(R, dtype=torch.float64)
    total = q_gain if shipped == "query_scale" else \
        (sc if ship_kappa != 1.0 else zero) + (rw if shipped == "network" and metric == "label" else zero)
    summary = part_summary(total, data.groups, args.seed)
    out.update(shipped=shipped, kappa=ship_kappa, gain=summary["gain"], ci95=summary["ci95"],
               verdict="better_than_uniform" if summary["ci95"] and summary["ci95"][0] > 0 else "unproven",
               seconds=round(time.perf_counter() - t0, 3))
    logger.info("cross-validation: ships %s at kappa %.4g, gain %s, %s", shipped, ship_kappa, out["gain"],
                out["verdict"])
    return out
