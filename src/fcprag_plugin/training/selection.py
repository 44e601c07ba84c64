"""Model selection and a verdict that selection never saw (``docs/label-format.md``, "Model selection and the
verdict").

The gain of merge weights ``w~`` over PRAG's sum is split in two parts, each estimated per record on held-out
questions:

    scale        PRAG's sum times the controller's total T = mean_i w~_i, against the sum: m(T) - m(1), measured
                 when the labels carry scale measurements (``scales`` / ``metric_at_scales``), else the first-order
                 extrapolation (T - 1) sum_i delta_i (labelled as such: it favours any T > 1 when most deltas are
                 positive)
    reweighting  w~ against uniform weights at the same total: sum_i (w~_i - T) delta_i (first order; a contrast,
                 so the sign of the deltas' mean does not bias it)

Nested grouped cross-validation: in each outer fold the epoch count is chosen on an inner split of the outer
training questions and ``kappa`` on all of them; the held-out questions are scored with those choices only. The
95% CIs resample questions (groups); a part is *shown* when its Bonferroni-adjusted CI (two parts: 97.5%) lies
above 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from .data import LabelTensors
from .evaluation import collect_outputs
from .targets import best_kappa

logger = logging.getLogger(__name__)

CV_NAME = "cv.json"
CV_PARTIAL_NAME = "cv.partial.json"  # the folds an interrupted cross-validation finished (select's on_fold)
BOOTSTRAP = 2000
PARTS = 2  # scale and reweighting: the Bonferroni factor of the "shown" decisions
CI_METHOD = f"percentile bootstrap over questions (groups), {BOOTSTRAP} resamples"


@dataclass(frozen=True)
class ScaleRule:
    """How ``kappa`` is chosen from measured scales: the largest mean gain over training questions among the scales
    where at most ``max_loss_share`` of the questions lose more than ``loss_margin`` (in the label metric)."""

    max_loss_share: float = 0.1
    loss_margin: float = 0.1


def group_kfold(groups: Sequence[str], k: int, seed: int) -> list[list[int]]:
    """Row indices of ``k`` folds such that all rows of a group are in one fold.

    Groups are shuffled (seeded) and dealt to the folds largest-first onto the fold with the fewest rows, so folds
    are balanced in records. Fewer than ``k`` groups give fewer (non-empty) folds.
    """
    by_group: dict[str, list[int]] = {}
    for i, gk in enumerate(groups):
        by_group.setdefault(gk, []).append(i)
    keys = list(by_group)
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    order = sorted((keys[i] for i in perm), key=lambda g: -len(by_group[g]))  # stable: shuffled within a size
    folds: list[list[int]] = [[] for _ in range(min(k, len(keys)))]
    for gk in order:
        min(folds, key=len).extend(by_group[gk])
    return [sorted(f) for f in folds]


def bootstrap_ci(values: torch.Tensor, groups: Sequence[str], seed: int, level: float = 0.95,
                 n_boot: int = BOOTSTRAP) -> tuple[float, float]:
    """Percentile-bootstrap CI at ``level`` of the record mean of ``values [R]``, resampling whole groups."""
    index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    gid = torch.tensor([index[g] for g in groups])
    G = len(index)
    sums = torch.zeros(G, dtype=torch.float64).index_add_(0, gid, values.to(torch.float64))
    counts = torch.bincount(gid, minlength=G).to(torch.float64)
    idx = torch.randint(0, G, (n_boot, G), generator=torch.Generator().manual_seed(seed))
    means = sums[idx].sum(1) / counts[idx].sum(1)
    q = (1 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([q, 1 - q], dtype=torch.float64)).tolist()
    return lo, hi


def group_means(values: torch.Tensor, groups: Sequence[str]) -> torch.Tensor:
    """``values [R, ...]`` averaged per group (NaN rows ignored) -> ``[G, ...]`` in first-appearance order."""
    keys = list(dict.fromkeys(groups))
    index = {g: i for i, g in enumerate(keys)}
    gid = torch.tensor([index[g] for g in groups])
    ok = ~torch.isnan(values)
    sums = torch.zeros(len(keys), *values.shape[1:], dtype=torch.float64).index_add_(0, gid,
                                                                                  values.nan_to_num(0.0).double())
    counts = torch.zeros_like(sums).index_add_(0, gid, ok.double())
    return sums / counts  # NaN where a group has no measurement


def choose_scale(scales: torch.Tensor, gains: torch.Tensor, groups: Sequence[str], rule: ScaleRule
                 ) -> tuple[float, dict[str, Any]]:
    """``kappa`` from measured gains ``[R, S]`` at ``scales [S]`` (NaN: unmeasured) by ``rule`` over the questions
    (groups) that have measurements; scale 1 (PRAG's sum, gain 0) is always a candidate. Returns ``(kappa,
    {"grid", "mean_gain", "loss_share", "at_grid_edge", "questions"})``; ties go to the smaller scale."""
    per_q = group_means(gains, groups)
    per_q = per_q[~torch.isnan(per_q).all(1)]
    grid = scales.tolist()
    if 1.0 not in grid:
        grid, per_q = grid + [1.0], torch.cat([per_q, torch.zeros(len(per_q), 1, dtype=per_q.dtype)], 1)
    mean = per_q.nanmean(0)
    loss = (per_q < -rule.loss_margin).double().mean(0)
    feasible = [j for j in range(len(grid)) if float(loss[j]) <= rule.max_loss_share]
    best = max(feasible, key=lambda j: (float(mean[j]), -grid[j]))
    kappa = grid[best]
    edge = kappa != 1.0 and kappa in (max(grid), min(grid))
    order = sorted(range(len(grid)), key=grid.__getitem__)
    return kappa, {"grid": [grid[j] for j in order], "mean_gain": [float(mean[j]) for j in order],
                   "loss_share": [float(loss[j]) for j in order], "at_grid_edge": edge, "questions": len(per_q)}


def scale_gain(data: LabelTensors, total: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Per record, the gain of PRAG's sum times ``total [R]`` over the sum, and whether it was measured.

    Measured when every total is 1 or on the records' grid of scales: then a record without measurements gets NaN
    (left out of the part: the labels measured other records of its question); otherwise the first-order
    ``(total - 1) sum_i delta_i`` for every record."""
    t = total.double()
    on_grid = data.scale_gains is not None and all(v == 1.0 or v in data.scales.tolist() for v in t.unique().tolist())
    if not on_grid:
        return (t - 1) * (data.deltas.double() * data.mask).sum(1), bool((t == 1.0).all())
    out = torch.full((len(data),), float("nan"), dtype=torch.float64)
    for j, s in enumerate(data.scales.tolist()):
        out[t == s] = data.scale_gains[t == s, j]
    out[t == 1.0] = 0.0
    return out, True


def reweighting_gain(w_tilde: torch.Tensor, data: LabelTensors) -> torch.Tensor:
    """Per record, ``sum_i (w~_i - T) delta_i`` with ``T`` the mean of ``w~ [R, N]`` over the real passages: the
    first-order gain of the weights over uniform weights at the same total."""
    m = data.mask.double()
    wt = w_tilde.double() * m
    total = wt.sum(1, keepdim=True) / m.sum(1, keepdim=True)
    return ((wt - total) * m * data.deltas.double()).sum(1)


def totals(w_tilde: torch.Tensor, data: LabelTensors) -> torch.Tensor:
    """The total scale ``T = mean_i w~_i`` of each record (``[R]``)."""
    m = data.mask.double()
    return (w_tilde.double() * m).sum(1) / m.sum(1)


def fold_kappa(data: LabelTensors, args: Any, rule: ScaleRule) -> tuple[float, str, dict[str, Any] | None]:
    """The global scale chosen on ``data``, how, and the grid behind it: ``args.kappa`` when it is a number, else
    by ``rule`` on the measured scales (the grid: :func:`choose_scale`'s info), else the first-order optimum of the
    risk objective for uniform weights (no grid)."""
    if args.kappa != "auto":
        return float(args.kappa), "fixed", None
    if data.scale_gains is not None and bool((~torch.isnan(data.scale_gains)).any()):
        kappa, grid = choose_scale(data.scales, data.scale_gains, data.groups, rule)
        return kappa, "measured", grid
    return (best_kappa(data.mask.to(torch.float32), data.deltas, data.mask, args.risk_lambda_for(data)),
            "first_order", None)


def _from_json(values: Any) -> torch.Tensor:
    """A (nested) list written by ``write_json`` back to float64, its nulls to NaN."""
    back = lambda v: [back(x) for x in v] if isinstance(v, list) else float("nan" if v is None else v)  # noqa: E731
    return torch.tensor(back(values), dtype=torch.float64)


def read_cv_partial(out: Any) -> dict[str, Any] | None:
    """The folds an interrupted cross-validation in run directory ``out`` finished (``{"key", "n_folds",
    "folds"}``), or None when there are none or the file is unreadable (cut off mid-write: nothing to go on from)."""
    try:
        got = json.loads((Path(out) / CV_PARTIAL_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and isinstance(got.get("folds"), list) else None


def part_summary(values: torch.Tensor, groups: Sequence[str], seed: int) -> dict[str, Any]:
    """Mean, 95% CI, the Bonferroni-adjusted CI and whether that one lies above 0, over the non-NaN records."""
    ok = ~torch.isnan(values)
    v, g = values[ok], [gr for gr, k in zip(groups, ok.tolist()) if k]
    if not len(v):
        return {"gain": None, "ci95": None, "ci_adjusted": None, "shown": False, "n_records": 0}
    lo, hi = bootstrap_ci(v, g, seed)
    alo, ahi = bootstrap_ci(v, g, seed, level=1 - 0.05 / PARTS)
    return {"gain": float(v.mean()), "ci95": [lo, hi], "ci_adjusted": [alo, ahi], "shown": alo > 0,
            "n_records": int(ok.sum())}


def select(data: LabelTensors, args: Any, embedding_model: str, trainer: Callable[..., Any],
           rule: ScaleRule = ScaleRule(), progress: bool = False, done: Sequence[dict[str, Any]] = (),
           on_fold: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Nested grouped CV (module docstring) -> a JSON-ready dict: the epoch count and ``kappa`` to ship, the two
    parts with their CIs, what to ship (``learned`` only when the reweighting part is shown or
    ``args.keep_network``) and the verdict of the shipped controller against PRAG's sum.

    ``args`` is the run's ``TrainArgs``; ``trainer(train_data, None, None, args, embedding_model)`` builds one
    fold's trainer (passed in so that this module does not import the one that imports it). Each fold depends only
    on its own seed, so a CV can stop and go on: ``on_fold(results)`` is called with the JSON-ready results of the
    folds finished so far after each fold, and ``done`` (such a list, from the same data and ``args``) skips them.
    """
    t0 = time.perf_counter()
    folds = group_kfold(data.groups, args.cv_folds, args.seed)
    if len(folds) < 2:
        raise ValueError(f"cross-validation needs at least 2 groups (questions), got {len(folds)}")
    E, R = args.epochs, len(data)
    curve = torch.zeros(E + 1, R, dtype=torch.float64)  # held-out reweighting gain after e epochs (for the count)
    rw = torch.full((R,), float("nan"), dtype=torch.float64)  # nested: each fold's own epoch choice
    scale = torch.full((R,), float("nan"), dtype=torch.float64)
    fold_epochs, fold_kappas, scale_measured = [], [], True
    fold_args = dataclasses.replace(args, cv_folds=0)
    results: list[dict[str, Any]] = []
    with tqdm(total=len(folds) * E, unit="epoch", desc=f"nested {len(folds)}-fold CV", dynamic_ncols=True,
              disable=not progress) as bar:
        for f, held in enumerate(folds):
            if f < len(done) and done[f].get("held") == held:  # finished by an interrupted run
                r = done[f]
                curve[:, held], rw[held], scale[held] = (_from_json(r[k]) for k in ("curve", "reweighting", "scale"))
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
            total = totals(w_held, held_data) if args.controller.get("query_scale") else \
                torch.full((len(held),), kappa, dtype=torch.float64)
            scale[held], measured = scale_gain(held_data, total)
            scale_measured &= measured
            fold_epochs.append(e_f)
            fold_kappas.append(kappa)
            results.append({"held": held, "curve": curve[:, held].tolist(), "reweighting": rw[held].tolist(),
                            "scale": scale[held].tolist(), "measured": measured, "epochs": e_f, "kappa": kappa})
            if on_fold is not None:
                on_fold(results)
    pooled = curve.mean(1)
    epochs = int(torch.argmax(pooled))  # first maximum: the fewest epochs among ties (0 = uniform weights)
    kappa, how, grid = fold_kappa(data, args, rule)
    out: dict[str, Any] = {
        "method": "nested grouped CV: epochs chosen on an inner split, kappa on the outer training questions",
        "folds": len(folds), "n_records": R, "n_groups": len(set(data.groups)), "max_epochs": E,
        "objective": args.objective, "selected_epochs": epochs, "fold_epochs": fold_epochs,
        "scale": {**part_summary(scale, data.groups, args.seed), "kappa": kappa, "chosen_by": how,
                  "measured": scale_measured, "fold_kappas": fold_kappas,
                  "at_grid_edge": bool(grid and grid["at_grid_edge"]), "grid": grid,
                  "rule": dataclasses.asdict(rule) if how == "measured" else None},
        "reweighting": {**part_summary(rw, data.groups, args.seed), "first_order": True},
        "curve": [float(v) for v in pooled], "ci_method": CI_METHOD,
        "metric": "per record: scale m(T) - m(1) (measured, or (T - 1) sum delta first order) plus reweighting "
                  "sum_i (w~_i - T) delta_i (first order), on held-out questions",
    }
    shipped = "learned" if out["reweighting"]["shown"] or args.keep_network else "scale_only"
    ship_kappa = kappa if out["scale"]["shown"] or args.kappa != "auto" else 1.0
    total = (scale if ship_kappa != 1.0 else torch.zeros(R, dtype=torch.float64)) + \
        (rw if shipped == "learned" else torch.zeros(R, dtype=torch.float64))
    summary = part_summary(total, data.groups, args.seed)
    out.update(shipped=shipped, kappa=ship_kappa, gain=summary["gain"], ci95=summary["ci95"],
               verdict="better_than_uniform" if summary["ci95"] and summary["ci95"][0] > 0 else "unproven",
               seconds=round(time.perf_counter() - t0, 3))
    logger.info("%s", "\n".join(verdict_lines(out)))
    return out


def _part(p: dict[str, Any]) -> str:
    if p["gain"] is None:
        return "not measured"
    lo, hi = p["ci95"]
    return f"{p['gain']:+.4g} per record, 95% CI [{lo:+.4g}, {hi:+.4g}]"


def verdict_lines(cv: dict[str, Any]) -> list[str]:
    """The verdict in plain words (the CLI's last lines): the total against PRAG's sum, its two parts, what was
    shipped and why."""
    s, r = cv["scale"], cv["reweighting"]
    how = {"measured": "chosen on measured scales", "first_order": "chosen by the first-order extrapolation (no "
           "scale measurements in the labels)", "fixed": "fixed by the caller"}[s["chosen_by"]]
    edge = " It sits at the edge of the measured grid: a larger scale may do better." if s["at_grid_edge"] else ""
    lines = [f"Held-out, selection-unbiased ({cv['folds']}-fold nested CV over {cv['n_groups']} questions):",
             f"  scale part (PRAG's sum times kappa = {s['kappa']:.4g}, {how}): {_part(s)}; "
             + ("measured" if s["measured"] else "first-order extrapolation") + (
                 " - shown" if s["shown"] else " - NOT shown") + "." + edge,
             f"  reweighting part (learned weights vs the same total, first order): {_part(r)}"
             + (" - shown." if r["shown"] else " - NOT shown.")]
    what = ("the learned controller" if cv["shipped"] == "learned" else
            f"a scale-only controller (PRAG's sum times {cv['kappa']:.4g}, no network)")
    why = "" if cv["shipped"] == "learned" or r["shown"] else " because the reweighting part was not shown"
    total = "NOT shown to beat PRAG's sum" if cv["verdict"] == "unproven" else "better than PRAG's sum"
    gain = "" if cv["gain"] is None else f": {cv['gain']:+.4g} per record, 95% CI [{cv['ci95'][0]:+.4g}, " \
                                        f"{cv['ci95'][1]:+.4g}]"
    lines.append(f"Saved {what}{why}; it is {total}{gain}."
                 + (" (Scale 1 with uniform weights is PRAG's own merge.)" if what.endswith("times 1, no network)")
                    else ""))
    return lines
