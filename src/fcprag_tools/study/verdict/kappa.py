"""Why this kappa: the trainer's risk rule and its figures per kappa.

With kappa "auto" the trainer chooses the total scale on the training questions' measured scale labels: the largest
mean gain over PRAG's sum among scale 1 and the scales whose share of questions losing more than ``loss_margin``
(by the upper end of its two-sided 95% Wilson interval, or the observed share with ``scale_bound`` "observed") is
at most ``max_loss_share``; ties go to the smaller scale (``fcprag_plugin.training.selection``, with the arguments
it recorded in ``training_args.json``). :func:`rule_figures` recomputes those figures from the labels; the same rule
read on the held-out scale rows (:func:`held_out_gains`) describes them, it decides nothing.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from fcprag_plugin.training.stats import wilson_interval
from .records import ControllerRecord, KappaFigures, KappaRule, Rule, RuleFigures, ScaleLabel, ScoredRows, suffix


def rule_of(args: Mapping[str, Any]) -> Rule:
    """The risk rule in trainer arguments ``args`` (``TrainArgs`` fields)."""
    return Rule(float(args["scale_max_loss_share"]), float(args["scale_loss_margin"]),
                args.get("scale_bound", "upper"), args.get("scale_metric", "label"))


def question_gains(labels: Sequence[ScaleLabel], metric: str) -> list[dict[float, float]]:
    """Per question (a label's ``group``, records averaged), its gain at each measured scale in ``metric``."""
    sums: dict[str, dict[float, list[float]]] = {}
    for lab in labels:
        gains = lab.f1_gains if metric == "f1" else lab.gains
        per = sums.setdefault(lab.group, {})
        for s, g in (gains or {}).items():
            per.setdefault(float(s), []).append(float(g))
    return [{s: sum(v) / len(v) for s, v in per.items()} for per in sums.values() if per]


def rule_figures(gains: Sequence[Mapping[float, float]], rule: Rule, left_out: Mapping[str, int] | None = None
                 ) -> RuleFigures:
    """The rule's figures on per-question ``gains`` (``{scale: gain over PRAG's sum}``, a scale may be missing;
    scale 1 gains 0 when not measured): per kappa its mean gain, the questions losing more than the margin, their
    share, the upper end of the share's 95% Wilson interval and whether the rule allows it; and the kappa it
    chooses."""
    n = len(gains)
    measured = {float(s) for g in gains for s in g}
    kappas = []
    for s in sorted(measured | {1.0}):
        vals = [g[s] if s in g else 0.0 if s not in measured else None for g in gains]  # scale 1: 0 by definition
        vals = [v for v in vals if v is not None]
        losing = sum(v < -rule.loss_margin for v in vals)
        upper = wilson_interval(losing, n)[1]
        tested = upper if rule.bound == "upper" else losing / n if n else 1.0
        kappas.append(KappaFigures(s, sum(vals) / len(vals) if vals else None, losing, losing / n if n else None,
                                   upper, s == 1.0 or tested <= rule.max_loss_share))
    ok = [k for k in kappas if k.allowed and k.mean_gain is not None]
    best = max(ok, key=lambda k: (k.mean_gain, -k.kappa)) if ok else None
    return RuleFigures(n, tuple(kappas), best.kappa if best else 1.0, dict(left_out or {}))


def held_out_gains(rows: ScoredRows, keys: Sequence[str], setting: str
                   ) -> tuple[list[dict[float, float]], dict[str, int]]:
    """``(per held-out question of keys, the gold log-lik. gain of each scale:<s> row of setting scored on all of
    them over PRAG's sum there; the scale rows scored on only some of them: {row: questions lacking it})``; the
    gains are empty without such a row."""
    sfx = suffix(setting)
    scales, partial = {}, {}
    for name in dict.fromkeys(n for _, n in rows.scores):
        hit = re.fullmatch(r"scale:([0-9.eE+-]+)" + re.escape(sfx), name)
        lacking = sum(not rows.has(q, name) for q in keys) if hit else 0
        if hit and not lacking:
            scales[name] = float(hit.group(1))
        elif hit and lacking < len(keys):
            partial[name] = lacking
    gains = [{s: rows.score(q, n).logprob - rows.score(q, f"prag_sum{sfx}").logprob for n, s in scales.items()}
             for q in keys] if scales else []
    return gains, partial


def _held_out(rows: ScoredRows, keys: Sequence[str], setting: str, rule: Rule
              ) -> tuple[RuleFigures | None, str | None]:
    """The rule read on the held-out scale rows of ``setting``, or why it is not."""
    if rule.metric != "label":
        return None, "the rule reads F1 gains, and a held-out scale row's gain is read in gold log-lik. here"
    held, partial = held_out_gains(rows, keys, setting)
    if held:
        return rule_figures(held, rule, partial), None
    rows_ = f"`scale:<s>{suffix(setting)}` row"
    return None, (f"no {rows_} is on every held-out question ("
                  + ", ".join(f"`{r}` missing on {k}" for r, k in partial.items()) + ")" if partial else
                  f"this study scored no {rows_}s")


def kappa_rule(ctrl: ControllerRecord, rows: ScoredRows, keys: Sequence[str], setting: str, *, given: bool,
               default_args: Mapping[str, Any]) -> KappaRule:
    """``summary.json``'s ``kappa_rule`` of a setting: the rule, its figures on the training labels (``training``,
    or ``why_absent``), and the same rule read on the held-out scale rows (``held_out``, descriptive, or
    ``held_out_why``)."""
    cv_scale = (ctrl.cv or {}).get("scale") or {}
    chose = (cv_scale.get("kappa"), cv_scale.get("chosen_by"))
    args = ctrl.args
    if given:
        return KappaRule(*chose, why_absent="a given controller: its kappa was chosen where it was trained")
    if args is not None and args.get("kappa") != "auto":
        return KappaRule(*chose, why_absent=f"the trainer's kappa was fixed at {args.get('kappa')} (no rule chose it)")
    rule = rule_of(args if args is not None else default_args)
    rule_from = "training_args.json" if args is not None else "the trainer's defaults"
    gains = question_gains(ctrl.labels or (), rule.metric)
    training, why = None, None
    if args is None or not gains:
        files = ((f"labels{suffix(setting)}.jsonl", gains), ("the trainer's training_args.json", args))
        missing = [n for n, have in files if not have]
        why = "this folder keeps " + (f"neither {missing[0]} nor {missing[1]}" if len(missing) > 1 else
                                      f"no {missing[0]}")
    else:
        training = rule_figures(gains, rule)
    held, held_why = _held_out(rows, keys, setting, rule)
    return KappaRule(*chose, rule, rule_from, training, why, held, held_why)
