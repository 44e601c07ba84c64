"""Terminal text of a training run and of an evaluation: the metrics table, the verdict in plain words and the last
lines of ``fcprag train``."""

from __future__ import annotations

import argparse
import math
import shlex
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
    """A run's ``metrics.json`` (``TrainResult.metrics``) as text: the metrics table on the training records,
    followed by the verdict in plain words when cross-validation ran."""
    t = format_table(metrics["train"], "training set")
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


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` / ``option=VALUE``."""
    out, skip = [], False
    for w in argv:
        if skip or w.startswith(option + "="):
            skip = False
            continue
        if w == option:
            skip = True
            continue
        out.append(w)
    return out


# the label metrics fcprag labels build writes, in words: what one unit of "gain" is
METRIC_UNITS = {"answer_logprob": "mean log-likelihood of the gold answer's tokens", "f1": "answer F1 (0 to 1)",
                "em": "exact match (0 or 1)"}


def closing_lines(res, args: argparse.Namespace, train_set) -> list[str]:
    """The last lines of ``fcprag train``: the one gain to quote, with its unit and its two parts, what "first
    order" means, what was saved and the command that uses the controller (and, when the defaults end in PRAG's
    own merge, the flag to try)."""
    metrics = sorted({r.metric for r in train_set.records if r.metric})
    unit = " / ".join(METRIC_UNITS.get(m, f"the label metric '{m}'") for m in metrics) or "the label metric"
    cv, cfg = res.metrics.get("cv"), res.controller.config
    lines = [f"In short (unit: {unit}, per record, over PRAG's sum of the passage updates):"]
    if cv is None:
        lines.append("  no gain was measured (--cv-folds 0): the controller says it is unproven wherever it is used")
    else:
        s, r = cv["scale"], cv["reweighting"]

        def part(p: dict, counted: bool) -> str:
            return ("not measured" if p["gain"] is None else f"{p['gain']:+.4g}") + (
                "" if counted else " (not in the saved controller: not shown)")

        gain = "+0 (nothing shipped but PRAG's sum)" if cv["gain"] is None else \
            f"{cv['gain']:+.4g}, 95% CI [{cv['ci95'][0]:+.4g}, {cv['ci95'][1]:+.4g}]"
        scale = "kappa 1: PRAG's own scale, +0" if s["kappa"] == 1.0 else \
            f"PRAG's sum times kappa {s['kappa']:.4g}: {part(s, cv['kappa'] != 1.0)}"
        lines += [f"  gain {gain} on held-out questions; its parts: scale ({scale}), reweighting "
                  f"{part(r, cv['shipped'] == 'network')}",
                  "  first order: estimated from the leave-one-out deltas as if the passages' effects added up, "
                  "without running the fused model (the reweighting part always; the scale part unless the labels "
                  "measured scales). The table's 'gain' row is that estimate on the training records, in sample."]
    what = "a scale-only controller (no network, no encoder)" if cfg.controller_mode == "uniform" else \
        "the learned controller"
    lines.append(f"Saved {what} with kappa {cfg.kappa:.4g} to {res.out} (config.json, model.safetensors; "
                 "training_args.json, metrics.json, train_log.jsonl" + (", cv.json" if cv else "")
                 + (", plots/" if args.plots else "") + ").")
    ranks = " --retrieval-rank R" if "retrieval_rank" in cfg.side_features else ""
    lines.append(f"Use it: fcprag fuse --controller {shlex.quote(str(res.out))} --query TEXT --adapter DIR "
                 f"--passage TEXT{ranks} (one --adapter/--passage{'/--retrieval-rank' if ranks else ''} per "
                 f"passage) --out FUSED, or in PRAG's loop: fcprag run prag --controller "
                 f"{shlex.quote(str(res.out))} -- src/inference.py ARGS...")
    if cfg.controller_mode == "uniform" and cfg.kappa == 1.0 and args.kappa != "auto":
        again = shlex.join(["fcprag", *_without_option(args.argv, "--kappa"), "--kappa", "auto"])
        lines.append(f"This is PRAG's own merge (scale-only, kappa 1): to let the scale be chosen from the labels, "
                     f"add --kappa auto: {again}")
    return lines
