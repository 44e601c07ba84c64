"""Terminal text of a training run and of an evaluation: the metrics table and the verdict in plain words."""

from __future__ import annotations

import math
from typing import Any


METRIC_KEYS = ("kl", "kl_nonflat", "top1", "spearman", "g_mean", "g_std", "tau_mean", "tau_std", "entropy_mean",
               "entropy_norm_mean", "gain")


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def format_table(metrics: dict[str, dict[str, Any]], title: str | None = None) -> str:
    """A plain-text table: one row per metric, one column per controller (learned first)."""
    names = list(metrics)
    rows = [("metric", *names)]
    for key in ("n", "n_nonflat", *METRIC_KEYS, "spearman_n"):
        rows.append((key, *(_fmt(metrics[n].get(key)) for n in names)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title] if title else []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def train_table(metrics: dict[str, Any]) -> str:
    """A run's ``metrics.json`` (``TrainResult.metrics``) as text: the metrics table (validation, else training
    set), followed by the verdict in plain words when cross-validation ran."""
    val = metrics.get("val")
    t = format_table(val, "validation") if val else format_table(metrics["train"], "training set")
    cv = metrics.get("cv")
    return t + ("\n\n" + "\n".join(verdict_lines(cv)) if cv else "")


def _part(p: dict[str, Any]) -> str:
    if p["gain"] is None:
        return "not measured"
    lo, hi = p["ci95"]
    return f"{p['gain']:+.4g} per record, 95% CI [{lo:+.4g}, {hi:+.4g}]"


def _share(ls: dict[str, Any]) -> str:
    if ls.get("share") is None:
        return "no question measured"
    lo, hi = ls["ci95"]
    return f"{100 * ls['share']:.0f}% of {ls['questions']} questions, 95% CI [{100 * lo:.0f}%, {100 * hi:.0f}%]"


MEASURE_HINT = ("to measure it, evaluate the controller by real forwards on held-out questions: "
                "fcprag study QUESTIONS --model MODEL --controller DIR --out OUT")


def verdict_lines(cv: dict[str, Any]) -> list[str]:
    """The verdict of a run's cross-validation (``metrics["cv"]``) in plain words (the CLI's last lines): the total
    against PRAG's sum, its parts, what was shipped and why."""
    s, r = cv["scale"], cv["reweighting"]
    metric = {"label": "the label metric", "f1": "F1"}.get(s.get("metric", "label"), "the label metric")
    how = {"measured": f"chosen on measured scales in {metric}",
           "no_scales": "no scale measurements in the labels, so PRAG's sum (build them with 'fcprag labels build "
                        "--scales')",
           "first_order": "chosen by the first-order extrapolation", "fixed": "fixed by the caller"}[s["chosen_by"]]
    edge = " It sits at the edge of the measured grid: a larger scale may do better." if s["at_grid_edge"] else ""
    lines = [f"Held-out, selection-unbiased ({cv['folds']}-fold nested CV over {cv['n_groups']} questions):",
             f"  scale part (PRAG's sum times kappa = {s['kappa']:.4g}, {how}): {_part(s)}; "
             + ("measured" if s["measured"] else "not measured") + (
                 " - shown" if s["shown"] else " - NOT shown") + "." + edge]
    for m, p in (s.get("by_metric") or {}).items():
        if m != s.get("metric", "label"):
            lines.append(f"    the same scale in {'F1' if m == 'f1' else 'the label metric'}: {_part(p)}")
    ls = s.get("held_out_loss_share")
    if ls and ls.get("share") is not None and s["chosen_by"] == "measured":
        lines.append(f"    questions losing more than {ls['margin']:g} at each fold's kappa (held out): {_share(ls)}; "
                     f"the rule allows {100 * ls['allowed']:.0f}%.")
    lines.append(f"  reweighting part (learned weights vs the same total): {_part(r)} - FIRST ORDER (a contrast of "
                 "leave-one-out deltas taken at PRAG's sum, total 1), not a measurement at the operating total.")
    shipped = cv["shipped"]  # one of SHIPS
    shipped = "scale_only" if shipped == "prag_sum" else shipped  # said as a scale-only controller at kappa 1
    what = {"network": f"the learned controller (network, kappa {cv['kappa']:.4g})",
            "scale_only": f"a scale-only controller (PRAG's sum times {cv['kappa']:.4g}, no network)"}[shipped]
    why = {"network": ", because --keep-network asked for it: its reweighting part is first order, not measured; "
                      + MEASURE_HINT,
           "scale_only": ": the learned network is not saved, because its reweighting part is first order, not a "
                         "measurement (--keep-network saves it; " + MEASURE_HINT + ")"}[shipped]
    total = "NOT shown to beat PRAG's sum" if cv["verdict"] == "unproven" else "better than PRAG's sum"
    gain = "" if cv["gain"] is None else f": {cv['gain']:+.4g} per record, 95% CI [{cv['ci95'][0]:+.4g}, " \
                                        f"{cv['ci95'][1]:+.4g}]"
    lines.append(f"Saved {what}{why}; it is {total}{gain}."
                 + (" (Scale 1 with uniform weights is PRAG's own merge.)" if what.endswith("times 1, no network)")
                    else ""))
    return lines
