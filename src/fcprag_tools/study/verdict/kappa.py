"""Why this kappa: the trainer's risk rule and its figures per kappa.

With kappa "auto" the trainer chooses the total scale on the training questions' measured scale labels: the largest
mean gain over PRAG's sum among scale 1 and the scales whose share of questions losing more than ``loss_margin``
(by its 95% Wilson upper bound, or the observed share with ``scale_bound`` "observed") is at most
``max_loss_share``; ties go to the smaller scale (``fcprag_plugin.training.selection``, with the arguments it
recorded in ``training_args.json``). :func:`rule_figures` recomputes those figures from the labels; the same rule
read on the held-out scale rows (:func:`held_out_gains`) describes them, it decides nothing.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from fcprag_plugin.training.stats import wilson_interval
from .records import ControllerRecord, ScaleLabel, ScoredRows, suffix


def rule_of(args: Mapping[str, Any]) -> dict[str, Any]:
    """The risk rule in trainer arguments ``args`` (``TrainArgs`` fields)."""
    return {"max_loss_share": float(args["scale_max_loss_share"]), "loss_margin": float(args["scale_loss_margin"]),
            "bound": args.get("scale_bound", "upper"), "metric": args.get("scale_metric", "label")}


def question_gains(labels: Sequence[ScaleLabel], metric: str) -> list[dict[float, float]]:
    """Per question (a label's ``group``, records averaged), its gain at each measured scale in ``metric``."""
    sums: dict[str, dict[float, list[float]]] = {}
    for lab in labels:
        gains = lab.f1_gains if metric == "f1" else lab.gains
        per = sums.setdefault(lab.group, {})
        for s, g in (gains or {}).items():
            per.setdefault(float(s), []).append(float(g))
    return [{s: sum(v) / len(v) for s, v in per.items()} for per in sums.values() if per]


def rule_figures(gains: Sequence[Mapping[float, float]], rule: Mapping[str, Any]) -> dict[str, Any]:
    """The rule's figures on per-question ``gains`` (``{scale: gain over PRAG's sum}``, a scale may be missing;
    scale 1 gains 0 when not measured): per kappa its mean gain, the questions losing more than the margin, their
    share, the share's 95% upper bound and whether the rule allows it; and the kappa it chooses."""
    n = len(gains)
    measured = {float(s) for g in gains for s in g}
    kappas = []
    for s in sorted(measured | {1.0}):
        vals = [g[s] if s in g else 0.0 if s not in measured else None for g in gains]  # scale 1: 0 by definition
        vals = [v for v in vals if v is not None]
        losing = sum(v < -rule["loss_margin"] for v in vals)
        upper = wilson_interval(losing, n)[1]
        tested = upper if rule["bound"] == "upper" else losing / n if n else 1.0
        kappas.append({"kappa": s, "mean_gain": sum(vals) / len(vals) if vals else None, "losing": losing,
                       "share": losing / n if n else None, "upper_bound": upper,
                       "allowed": s == 1.0 or tested <= rule["max_loss_share"]})
    ok = [k for k in kappas if k["allowed"] and k["mean_gain"] is not None]
    best = max(ok, key=lambda k: (k["mean_gain"], -k["kappa"])) if ok else None
    return {"questions": n, "kappas": kappas, "rule_kappa": best["kappa"] if best else 1.0}


def held_out_gains(rows: ScoredRows, keys: Sequence[str], setting: str) -> list[dict[float, float]]:
    """Per held-out question of ``keys``, the gold log-lik. gain of each ``scale:<s>`` row of ``setting`` scored on
    all of them over PRAG's sum there (empty without such a row)."""
    sfx = suffix(setting)
    scales = {}
    for name in dict.fromkeys(n for _, n in rows.scores):
        hit = re.fullmatch(r"scale:([0-9.eE+-]+)" + re.escape(sfx), name)
        if hit and all(rows.has(q, name) for q in keys):
            scales[name] = float(hit.group(1))
    return [{s: rows.score(q, n).logprob - rows.score(q, f"prag_sum{sfx}").logprob for n, s in scales.items()}
            for q in keys] if scales else []


def kappa_rule(ctrl: ControllerRecord, rows: ScoredRows, keys: Sequence[str], setting: str, *, given: bool,
               default_args: Mapping[str, Any]) -> dict[str, Any]:
    """``summary.json``'s ``kappa_rule`` of a setting: the rule, its figures on the training labels (``training``,
    or ``why_absent``), and the same rule read on the held-out scale rows (``held_out``, descriptive)."""
    cv_scale = (ctrl.cv or {}).get("scale") or {}
    out: dict[str, Any] = {"trainer_kappa": cv_scale.get("kappa"), "chosen_by": cv_scale.get("chosen_by"),
                           "rule": None, "rule_from": None, "training": None, "why_absent": None, "held_out": None}
    args = ctrl.args
    if given:
        out["why_absent"] = "a given controller: its kappa was chosen where it was trained"
        return out
    if args is not None and args.get("kappa") != "auto":
        out["why_absent"] = f"the trainer's kappa was fixed at {args.get('kappa')} (no rule chose it)"
        return out
    out["rule"] = rule_of(args if args is not None else default_args)
    out["rule_from"] = "training_args.json" if args is not None else "the trainer's defaults"
    gains = question_gains(ctrl.labels or (), out["rule"]["metric"])
    if args is None or not gains:
        files = ((f"labels{suffix(setting)}.jsonl", gains), ("the trainer's training_args.json", args))
        missing = [n for n, have in files if not have]
        kept = f"neither {missing[0]} nor {missing[1]}" if len(missing) > 1 else f"no {missing[0]}"
        out["why_absent"] = f"this folder keeps {kept}"
    else:
        out["training"] = rule_figures(gains, out["rule"])
    if out["rule"]["metric"] == "label":
        held = held_out_gains(rows, keys, setting)
        out["held_out"] = rule_figures(held, out["rule"]) if held else None
    return out
