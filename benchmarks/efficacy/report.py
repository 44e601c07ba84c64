"""The two-dataset efficacy study's report: ``docs/results/efficacy.md`` + ``efficacy.json`` + ``efficacy_*.png``.

    python benchmarks/efficacy/report.py [--out DIR] [--boot N]

Reads the committed caches under ``benchmarks/efficacy/cache/`` only (never loads a model, never reads ``work/``):
``scope.json``, ``analysis.json`` (the registered analysis, ``analysis.py``), ``controllers/*.json``,
``curve/*.json``, ``timings.jsonl`` and per dataset ``retrieval.jsonl``, ``adapters.jsonl``, ``labels_train.jsonl``,
``results_train.jsonl``, ``results_test.jsonl``, ``test_meta.jsonl``, ``timings.jsonl``; ``heldout/<file>/`` (the
output of ``run_all.py`` with the recommended controller, section 12). Whatever does not exist yet
is reported as not run, with the reason; nothing is estimated in its place.

- The primary and secondary comparisons are quoted from ``analysis.json`` (checked against the results it was
  computed from: a stale file is flagged).
- The descriptive tables use the same statistics (``analysis.outcome_table``: a learned configuration's value is the
  mean over its seeds, and a row scored twice counts as the mean of its values, as in the registered analysis;
  ``analysis.paired_bootstrap``: percentile CI, resampled within each dataset) with ``--boot`` resamples.
- A (method, condition, prompt) cell that does not cover every test question of its dataset(s) is a pass that did not
  finish: it is shown as not run with the questions it covered, never as a result (the plan's rule).
- ``benchmarks/efficacy/discussion.md`` (written by hand) is included once, verbatim.

"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import analysis  # noqa: E402
import common  # noqa: E402
from common import REPO, SEED, read_jsonl, versions, write_json  # noqa: E402

OUT_DIR = REPO / "docs" / "results"
DATASETS = analysis.DATASETS
CONDITIONS = ("clean", "replace", "repeat", "alt")
MODES = ("param", "combine")
DESC_BOOT = 2000  # resamples of the descriptive CIs (the registered ones in analysis.json use analysis.BOOT)
MARGIN = -0.01  # the plan's "never worse beyond noise" bar on the CI's lower bound
BASELINES = ("prag_sum", "average", "random", "best_kappa", "best_cos", "best_bm25")
NOT_SUMMED = ("progress", "adapters-bench", "bench-adapters")  # timings rows that are not stage runs

WHY = {
    "retrieval.jsonl": "the `prepare` stage has not written it",
    "adapters.jsonl": "the `adapters` stage has not logged any adapter",
    "labels_train.jsonl": "the `labels` stage has not written it yet",
    "results_train.jsonl": "the `labels` / `grids` stages have not scored any training row yet",
    "results_test.jsonl": "the `eval` stage has not scored any test row yet",
    "test_meta.jsonl": "the `eval` stage has not written it yet",
    "timings.jsonl": "no stage has recorded its wall-clock yet",
    "analysis.json": "the `analysis` stage has not run (`python benchmarks/efficacy/analysis.py`)",
    "controllers": "the `train` stage has not finished any controller run",
    "curve": "the `curve` stage (learning curve) has not run",
}


# ----------------------------------------------------------------------------- helpers
def mean(x: Sequence[float]) -> float:
    return sum(x) / len(x) if x else float("nan")


# ----------------------------------------------------------------------------- reading the caches
class Caches:
    """Every committed cache file the report reads, or None (with a "not run" line) where it does not exist."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.missing: list[str] = []
        self.notes: list[str] = []

    def _miss(self, rel: str, why: str) -> None:
        self.missing.append(f"`cache/{rel}`: not run ({why})")

    def jsonl(self, rel: str) -> list[dict[str, Any]] | None:
        p = self.root / rel
        if not p.is_file():
            self._miss(rel, WHY.get(Path(rel).name, "not written"))
            return None
        try:
            return read_jsonl(p)
        except SystemExit:  # a line being appended right now, or a damaged line: skip it, say so
            rows, bad = [], 0
            for line in p.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        bad += 1
            self.notes.append(f"`cache/{rel}`: {bad} unreadable line(s) skipped")
            return rows

    def json(self, rel: str, why: str | None = None) -> Any:
        p = self.root / rel
        if not p.is_file():
            self._miss(rel, why or WHY.get(Path(rel).name, "not written"))
            return None
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            self.notes.append(f"`cache/{rel}`: not valid JSON ({e.msg}); ignored")
            return None

    def folder(self, rel: str) -> list[tuple[str, dict[str, Any]]]:
        files = sorted((self.root / rel).glob("*.json")) if (self.root / rel).is_dir() else []
        if not files:
            self._miss(f"{rel}/", WHY[rel])
        out = []
        for f in files:
            obj = self.json(f"{rel}/{f.name}")
            if obj is not None:
                out.append((f.name, obj))
        return out


def load(root: Path) -> tuple[Caches, dict[str, Any]]:
    c = Caches(root)
    d: dict[str, Any] = {"ds": {}}
    scope_path = root / "scope.json"
    d["scope"] = json.loads(scope_path.read_text(encoding="utf-8")) if scope_path.is_file() else None
    for ds in DATASETS:
        x: dict[str, Any] = {}
        for name in ("retrieval", "adapters", "labels_train", "results_train", "results_test", "test_meta",
                     "timings"):
            x[name] = c.jsonl(f"{ds}/{name}.jsonl")
        d["ds"][ds] = x
    d["timings"] = c.jsonl("timings.jsonl")
    d["analysis"] = c.json("analysis.json")
    d["controllers"] = c.folder("controllers")
    d["curve"] = c.folder("curve")
    disc = common.HERE / "discussion.md"
    d["discussion"] = disc.read_text(encoding="utf-8") if disc.is_file() else None
    return c, d


# ----------------------------------------------------------------------------- computations (pure)
def merge_meta(rows: list[dict[str, Any]]) -> tuple[dict[tuple[str, str, str], dict[str, Any]], int]:
    """``{(dataset, id, condition): line}`` with the ``weights`` and ``calibration`` of a question's lines united
    (a method given twice: the later line wins); also how many lines disagreed on the positions (kept: the first)."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    conflicts = 0
    for m in rows:
        k = (m["dataset"], m["id"], m["condition"])
        if k not in out:
            out[k] = dict(m, weights=dict(m.get("weights") or {}), calibration=dict(m.get("calibration") or {}))
            continue
        if list(m.get("positions", [])) != list(out[k].get("positions", [])):
            conflicts += 1
            continue
        out[k]["weights"].update(m.get("weights") or {})
        out[k]["calibration"].update(m.get("calibration") or {})
    return out, conflicts


def supporting_share(weights: Sequence[float], supporting: Sequence[bool]) -> float | None:
    """Share of the merge weight ``sum w~`` on the supporting positions; None when the weights sum to 0."""
    total = sum(float(w) for w in weights)
    if len(weights) != len(supporting) or total <= 1e-12:
        return None
    return sum(float(w) for w, s in zip(weights, supporting) if s) / total


def base_name(name: str) -> str:
    """``learned:<candidate>:s<seed>`` -> ``learned:<candidate>`` (as ``analysis.outcome_table`` does)."""
    return ":".join(name.split(":")[:2]) if name.startswith("learned:") else name


def share_table(meta: dict[tuple[str, str, str], dict[str, Any]]) -> dict[str, Any]:
    """Per condition and method (each learned seed, and ``learned:<candidate>`` = the per-question mean over its
    seeds): the mean share of w~ on supporting positions per dataset and pooled, with the question counts."""
    vals: dict[str, dict[str, dict[str, list[float]]]] = {}
    undefined: dict[str, dict[str, int]] = {}
    for (ds, _, cond), m in sorted(meta.items()):
        seeds: dict[str, list[float]] = {}
        for name, w in m["weights"].items():
            if name.startswith("loo:"):
                continue
            s = supporting_share(w, m["supporting"])
            if s is None:
                undefined.setdefault(cond, {}).setdefault(name, 0)
                undefined[cond][name] += 1
                continue
            vals.setdefault(cond, {}).setdefault(name, {}).setdefault(ds, []).append(s)
            if name.startswith("learned:") and name != base_name(name):
                seeds.setdefault(base_name(name), []).append(s)
        for name, v in seeds.items():
            vals[cond].setdefault(name, {}).setdefault(ds, []).append(sum(v) / len(v))
    out: dict[str, Any] = {}
    for cond in sorted(set(vals) | set(undefined)):
        out[cond] = {}
        for name in sorted(set(vals.get(cond, {})) | set(undefined.get(cond, {}))):
            by_ds = vals.get(cond, {}).get(name, {})
            flat = [x for v in by_ds.values() for x in v]
            out[cond][name] = {"mean": {**{ds: mean(v) for ds, v in by_ds.items()}, "pooled": mean(flat)},
                               "n": {**{ds: len(v) for ds, v in by_ds.items()}, "pooled": len(flat)},
                               "undefined": undefined.get(cond, {}).get(name, 0)}
    return out


def seed_rows(results: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The learned rows with their seed kept (renamed so that ``analysis.outcome_table`` does not average them)."""
    return {ds: [dict(r, name="=" + r["name"]) for r in rows if r["name"].startswith("learned:")]
            for ds, rows in results.items()}


def index(table: dict[tuple[str, str, str, str], dict[str, float]]
          ) -> dict[tuple[str, str, str], dict[str, dict[str, float]]]:
    """``{(dataset, condition, mode): {method: {question id: value}}}``."""
    by: dict[tuple[str, str, str], dict[str, dict[str, float]]] = {}
    for (ds, qid, cond, mode), v in table.items():
        for m, x in v.items():
            by.setdefault((ds, cond, mode), {}).setdefault(m, {})[qid] = x
    return by


def boot(strata: dict[str, list[float]], seed: str, n: int) -> list[float]:
    """``[mean, lo, hi]`` (``analysis.paired_bootstrap``); ``n`` = 0: the mean only, ``lo`` = ``hi`` = None."""
    if n <= 0:
        flat = [x for v in strata.values() for x in v]
        return [sum(flat) / len(flat), None, None]  # type: ignore[list-item]
    p, lo, hi = analysis.paired_bootstrap(strata, f"report:{seed}", n)
    return [p, lo, hi]


def cell(by: dict, method: str, cond: str, mode: str, dsets: Sequence[str], expected: dict[str, int],
         n_boot: int, base: str = "prag_sum", base_cond: str | None = None) -> dict[str, Any]:
    """One (method, condition, prompt) over ``dsets``: coverage per dataset, and where every test question is
    covered, the mean with its CI and the paired difference against ``base`` (under ``base_cond``, default the same
    condition) with its CI."""
    base_cond = base_cond or cond
    vals = {ds: by.get((ds, cond, mode), {}).get(method, {}) for ds in dsets}
    ref = {ds: by.get((ds, base_cond, mode), {}).get(base, {}) for ds in dsets}
    paired = {ds: [q for q in sorted(vals[ds]) if q in ref[ds]] for ds in dsets}
    out: dict[str, Any] = {"n": {ds: len(vals[ds]) for ds in dsets}, "n_paired": {ds: len(paired[ds]) for ds in dsets},
                           "expected": {ds: expected.get(ds, 0) for ds in dsets}}
    out["complete"] = all(expected.get(ds, 0) > 0 and len(vals[ds]) >= expected[ds] for ds in dsets)
    key = f"{method}|{cond}|{mode}|{'+'.join(dsets)}"
    if out["complete"]:
        out["mean"] = boot({ds: [vals[ds][q] for q in sorted(vals[ds])] for ds in dsets}, "m|" + key, n_boot)
        if (method, cond) != (base, base_cond) and all(len(paired[ds]) >= expected[ds] for ds in dsets):
            out["delta"] = boot({ds: [vals[ds][q] - ref[ds][q] for q in paired[ds]] for ds in dsets},
                                f"d|{base}|{base_cond}|" + key, n_boot)
    return out


def order_methods(names: set[str] | list[str], chosen: str | None) -> list[str]:
    names = {n for n in names if not n.startswith("loo:")}
    first = [m for m in BASELINES if m in names]
    learned = sorted(m for m in names if m.startswith("learned:"))
    if chosen and f"learned:{chosen}" in learned:
        learned.remove(f"learned:{chosen}")
        learned.insert(0, f"learned:{chosen}")
    rest = sorted(names - set(first) - set(learned) - {"oracle"})
    return first + learned + rest + (["oracle"] if "oracle" in names else [])


def stage_costs(per_ds: dict[str, list[dict[str, Any]] | None], study: list[dict[str, Any]] | None,
                adapters: dict[str, list[dict[str, Any]] | None], controllers: list[tuple[str, dict[str, Any]]],
                curve: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Seconds per stage name (sum over its recorded runs), the bench and progress rows apart."""
    stages: dict[str, dict[str, Any]] = {}

    def add(stage: str, secs: float, source: str) -> None:
        s = stages.setdefault(stage, {"runs": 0, "seconds": 0.0, "source": source})
        s["runs"] += 1
        s["seconds"] += float(secs)

    for ds, rows in per_ds.items():
        for r in rows or []:
            if r.get("stage") not in NOT_SUMMED and r.get("seconds") is not None:
                add(r["stage"], r["seconds"], f"cache/<ds>/timings.jsonl")
    bench, progress = [], []
    for r in study or []:
        if r.get("stage") == "progress":
            progress.append(r)
        elif r.get("stage") in NOT_SUMMED:
            bench.append(r)
        elif r.get("seconds") is not None:
            add(r["stage"], r["seconds"], "cache/timings.jsonl")
    groups: set[tuple[str, str, Any]] = set()
    for ds, rows in adapters.items():
        for r in rows or []:
            if r.get("group_seconds") is not None:
                groups.add((ds, str(r.get("finished")), r["group_seconds"]))
    for _, _, secs in sorted(groups, key=str):
        add("adapters (groups logged in adapters.jsonl)", secs, "cache/<ds>/adapters.jsonl")
    for _, m in controllers:
        if m.get("seconds") is not None:
            add("train (controller runs)", m["seconds"], "cache/controllers/*.json")
    full = {(m.get("candidate"), m.get("seed"), m.get("questions"), m.get("seconds")) for _, m in controllers}
    for _, m in curve:  # the full-set point is the train stage's own run, copied: not counted twice
        if m.get("seconds") is not None and (m.get("candidate"), m.get("seed"), m.get("questions"),
                                             m.get("seconds")) not in full:
            add("curve (controller runs)", m["seconds"], "cache/curve/*.json")
    for s in stages.values():
        s["seconds"] = round(s["seconds"], 1)
    return {"stages": stages, "bench": bench, "progress": progress,
            "total_seconds": round(sum(s["seconds"] for s in stages.values()), 1)}


def adapter_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def avg(field: str, kind: str) -> float | None:
        v = [r[field][kind] for r in rows if kind in (r.get(field) or {})]
        return mean(v) if v else None

    return {"count": len(rows), "mean_steps": mean([r["steps"] for r in rows if "steps" in r]),
            "passage_loss_at_step": avg("loss_at_step", "passage"), "passage_loss_after": avg("loss_after", "passage"),
            "qa0_loss_at_step": avg("loss_at_step", "qa0"), "qa0_loss_after": avg("loss_after", "qa0")}


def label_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    flat, best_sup, sup = 0, 0, []
    for r in rows:
        d = r.get("deltas") or []
        sup += list(r.get("supporting") or [])
        if not d or max(d) - min(d) <= 1e-6:
            flat += 1
        elif r.get("supporting"):
            best_sup += bool(r["supporting"][d.index(max(d))])
    return {"records": len(rows), "questions": len({r.get("group") for r in rows}), "flat": flat,
            "best_passage_supporting": best_sup, "non_flat": len(rows) - flat,
            "supporting_share_of_passages": mean([float(s) for s in sup]) if sup else None,
            "mean_metric_all": mean([r["metric_all"] for r in rows if "metric_all" in r])}


def fixed_points(results_train: dict[str, list[dict[str, Any]] | None]) -> dict[str, Any]:
    """The fixed baselines' grid on the training split: per family the best point (the eval stage's rule,
    ``study.best_fixed``) and its mean training gold log-lik., with PRAG's sum on the same top-3 (row ``s:012``)."""
    tables: list[dict[str, float]] = []
    for rows in results_train.values():
        t: dict[str, dict[str, float]] = {}
        for r in rows or []:
            t.setdefault(r["key"], {})[r["name"]] = r["logprob"]
        tables += list(t.values())
    out: dict[str, Any] = {}
    for fam in ("kappa", "cos", "bm25"):
        names = sorted({n for t in tables for n in t if n.startswith(fam + ":")})
        full = [t for t in tables if names and all(n in t for n in names)]
        if full:
            means = {n: sum(t[n] for t in full) / len(full) for n in names}
            best = max(names, key=lambda n: (means[n], n))
            both = [t for t in full if "s:012" in t]
            out[fam] = {"best": best, "mean": means[best], "questions": len(full), "points": len(names),
                        "prag_sum_mean": mean([t["s:012"] for t in both]) if both else None}
    return out


# ----------------------------------------------------------------------------- formatting
def f(x: float | None, d: int = 4, sign: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:+.{d}f}" if sign else f"{x:.{d}f}"


def fci(v: Sequence[float], d: int = 4, sign: bool = True) -> str:
    if v[1] is None:
        return f(v[0], d, sign)
    return f"{f(v[0], d, sign)} [{f(v[1], d, sign)}, {f(v[2], d, sign)}]"


def coverage(c: dict[str, Any]) -> str:
    """"not run (questions covered / test questions)" of a cell (for a difference: the questions with both)."""
    n = sum((c["n_paired"] if c["complete"] else c["n"]).values())
    return f"not run ({n}/{sum(c['expected'].values())} questions)"


def reading(lo: float) -> str:
    if lo > 0:
        return "**better than PRAG's sum** (the CI's lower bound is above 0)"
    if lo >= MARGIN:
        return (f"**never worse beyond noise** (lower bound {f(lo)} ≥ {MARGIN}: the issue's acceptance bar is met), "
                "but not shown better (the CI includes 0)")
    return f"**worse than PRAG's sum beyond noise** (lower bound {f(lo)} < {MARGIN}: the acceptance bar is not met)"


def table(head: Sequence[str], rows: list[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return out + [""]


def pval(p: float | None) -> str:
    return "—" if p is None else f"{p:.4f}"


# ----------------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Readable names for the plots (the tables keep the row names, which the caches and the analysis use).
BASELINE_LABELS = {
    "prag_sum": "PRAG's sum (w~ = 1)",
    "average": "1/N average (w~ = 1/N)",
    "random": "random controller (untrained)",
    "best_kappa": "fixed scale (w~ = kappa, tuned)",
    "best_cos": "fixed cosine (g, tau tuned)",
    "best_bm25": "fixed BM25 rank (tau tuned)",
    "oracle": "leave-one-out oracle (reads the answer)",
}
_OBJECTIVES = {"kl": "KL", "risk": "risk"}
_FEATURES = {"paper": "paper features", "side": "+ side features"}
_SCALES = {"k1": "kappa 1", "kappa": "kappa tuned", "query": "per-query scale"}
CONDITION_LABELS = {
    "clean": "clean (BM25 top 3)",
    "replace": "replace-one (a passage from another question)",
    "repeat": "repeat-one (a passage listed twice)",
    "alt": "second subset (another 3 of the top 6)",
}


def method_label(name: str, chosen: str | None = None) -> str:
    """``learned:risk-side-kappa:s1`` -> ``learned: risk, + side features, kappa tuned (seed 1)``; baselines by
    :data:`BASELINE_LABELS`; the chosen configuration marked; unknown names unchanged."""
    if name in BASELINE_LABELS:
        return BASELINE_LABELS[name]
    if not name.startswith("learned:"):
        return name
    parts = name.split(":")
    cand = parts[1]
    bits = cand.split("-")
    text = cand
    if len(bits) == 3 and bits[0] in _OBJECTIVES and bits[1] in _FEATURES and bits[2] in _SCALES:
        text = f"{_OBJECTIVES[bits[0]]}, {_FEATURES[bits[1]]}, {_SCALES[bits[2]]}"
    seed = f" (seed {parts[2][1:]})" if len(parts) > 2 and parts[2].startswith("s") else ""
    return f"learned: {text}{seed}" + (" [chosen]" if chosen and cand == chosen else "")


def _kind_color(name: str, chosen: str | None) -> str:
    if chosen and name == f"learned:{chosen}":
        return "tab:red"
    if name == "oracle":
        return "tab:purple"
    return "tab:blue" if name.startswith("learned:") else "dimgray"


def plot_delta(rows: list[tuple[str, list[float]]], path: Path, chosen: str | None = None) -> None:
    """Forest plot: each method's mean paired difference from PRAG's sum with its 95% CI, top to bottom in the
    given order; baselines grey, learned configurations blue, the chosen one red, the oracle purple."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 0.42 * len(rows) + 1.9))
    ys = list(range(len(rows)))[::-1]
    for y, (name, v) in zip(ys, rows):
        ax.errorbar(v[0], y, xerr=[[v[0] - v[1]], [v[2] - v[0]]], fmt="o", capsize=3,
                    color=_kind_color(name, chosen))
    ax.axvline(0, color="black", lw=0.8, label="PRAG's sum (0)")
    ax.axvline(MARGIN, color="tab:red", lw=0.8, ls="--", label=f"\"never worse\" margin ({MARGIN})")
    ax.set_yticks(ys)
    ax.set_yticklabels([method_label(r[0], chosen) for r in rows], fontsize=8)
    for tick, (name, _) in zip(ax.get_yticklabels(), rows):
        tick.set_color(_kind_color(name, chosen))
    ax.set_xlabel("Δ gold-answer log-likelihood vs PRAG's sum (mean over questions, 95% CI)")
    ax.set_title("Each method minus PRAG's sum\n(test questions of both datasets, param prompt, clean retrieval)",
                 fontsize=9)
    ax.legend(loc="lower left", fontsize=8)  # the lower rows (learned, oracle) sit right of 0
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_g_tau(points: dict[str, dict[str, list[tuple[float, float]]]], path: Path) -> None:
    """The chosen configuration's calibration outputs (``points``: seed run -> condition -> (g, tau) per question).
    Left: (g, tau) per test question, one colour per seed, the conditions pooled (they lie on one curve: the
    calibration net moves g and tau together). Right: g per condition and seed (mean, min-max), the conditions
    spelled out."""
    plt = _plt()
    names = sorted(points)
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    conds = [c for c in CONDITIONS if any(c in points[n] for n in names)]
    configs = sorted({base_name(n) for n in names})

    def seed(name: str) -> str:
        tail = name.split(":")[-1]
        return f"seed {tail[1:]}" if name != base_name(name) and tail.startswith("s") else name

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1, 1.25]})
    for name in names:
        pts = [p for cond in conds for p in points[name].get(cond, [])]
        left.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, alpha=0.5, color=colors[name],
                     label=f"{seed(name)}: {len(pts)} (question, condition) points")
    left.set_xlabel("gate g")
    left.set_ylabel("temperature tau")
    left.set_title(f"(g, tau) per test question: the {len(conds)} conditions fall on one curve", fontsize=9)
    left.legend(fontsize=7, loc="lower left", markerscale=2)  # the points run from upper left to lower right
    offsets = {n: 0.22 * (i - (len(names) - 1) / 2) for i, n in enumerate(names)}
    for name in names:
        for k, cond in enumerate(conds):
            gs = [p[0] for p in points[name].get(cond, [])]
            if gs:
                m = sum(gs) / len(gs)
                right.errorbar(m, len(conds) - 1 - k - offsets[name],
                               xerr=[[max(0.0, m - min(gs))], [max(0.0, max(gs) - m)]],  # rounding: never < 0
                               fmt="o", capsize=3, color=colors[name])
    right.set_yticks(range(len(conds)))
    right.set_yticklabels([CONDITION_LABELS.get(c, c).replace(" (", "\n(") for c in conds][::-1], fontsize=8)
    right.set_xlabel("gate g: mean, min-max over questions (colours: seeds)")
    right.set_title("gate g by retrieval condition", fontsize=9)
    fig.suptitle("Calibration outputs of " + ", ".join(method_label(c) for c in configs)
                 + " (test questions of both datasets)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_share(shares: dict[str, Any], methods: list[str], path: Path, chosen: str | None = None) -> None:
    """Share of w~ on supporting passages per method (rows), one panel per retrieval condition, each with its own
    axis zoomed to its values (differences of 0.01-0.03 matter here; the perturbed conditions sit far from the
    clean one) and PRAG's sum as a dashed line; every point carries its value, so no legend is needed."""
    plt = _plt()
    conds = [c for c in CONDITIONS if c in shares]
    colors = {"clean": "tab:blue", "replace": "tab:red", "repeat": "tab:green", "alt": "tab:purple"}
    fig, axes = plt.subplots(1, len(conds), sharey=True, squeeze=False, figsize=(4 + 3.2 * len(conds),
                             0.36 * len(methods) + 1.9), gridspec_kw={"width_ratios": [1.4] + [1] * (len(conds) - 1)})
    ys = {m: len(methods) - 1 - i for i, m in enumerate(methods)}
    for ax, cond in zip(axes[0], conds):
        pts = [(shares[cond][m]["mean"]["pooled"], ys[m]) for m in methods
               if m in shares[cond] and shares[cond][m]["mean"].get("pooled") is not None]
        ax.scatter([x for x, _ in pts], [y for _, y in pts], s=30, color=colors.get(cond, "gray"), zorder=3)
        for x, y in pts:
            ax.annotate(f"{x:.3f}", (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        ref = shares[cond].get("prag_sum", {}).get("mean", {}).get("pooled")
        if ref is not None:
            ax.axvline(ref, color="gray", lw=0.8, ls="--", zorder=1)
        xs = [x for x, _ in pts] + ([ref] if ref is not None else [])
        if xs:
            lo, hi = min(xs), max(xs)
            pad = max(0.005, 0.1 * (hi - lo))
            ax.set_xlim(lo - pad, hi + 2.5 * pad)  # room for the value labels
        ax.set_title(CONDITION_LABELS.get(cond, cond).replace(" (", "\n("), fontsize=8)
        ax.set_xlabel("share of w~ on supporting", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.locator_params(axis="x", nbins=5)
        ax.grid(axis="x", color="0.92")
    axes[0][0].set_yticks([ys[m] for m in methods])
    axes[0][0].set_yticklabels([method_label(m, chosen) for m in methods], fontsize=8)
    fig.suptitle("Share of the merge weight on supporting passages (test questions, both datasets; dashed: PRAG's "
                 "sum). Axes zoomed: they do not start at 0", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_retention(rows: list[tuple[str, str, list[float]]], path: Path, chosen: str | None = None) -> None:
    """Perturbed minus clean for the same method and question, one row per (condition, method), with its CI."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 2.0))
    ys = list(range(len(rows)))[::-1]
    for y, (cond, name, v) in zip(ys, rows):
        ax.errorbar(v[0], y, xerr=[[v[0] - v[1]], [v[2] - v[0]]], fmt="o", capsize=3,
                    color="tab:red" if cond == "replace" else "tab:green")
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{CONDITION_LABELS.get(c, c).split(' (')[0]}: {method_label(n, chosen)}"
                        for c, n, _ in rows], fontsize=8)
    ax.set_xlabel("Δ gold-answer log-likelihood, perturbed − clean (95% CI)")
    fig.suptitle("Perturbation retention: perturbed − clean, same method and question (param prompt, both datasets)"
                 "\nreplace-one: a passage swapped for another question's; repeat-one: a passage listed twice",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curve(points: list[dict[str, Any]], path: Path) -> None:
    """The learning curve: one colour, one legend entry and one connecting line per seed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    seeds = sorted({p["seed"] or 0 for p in points})
    colors = dict(zip(seeds, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for seed in seeds:
        pts = sorted((p for p in points if (p["seed"] or 0) == seed), key=lambda p: p["questions"])
        shift = 1 + 0.02 * seeds.index(seed)  # seeds side by side, not on top of each other
        xs = [p["questions"] * shift for p in pts]
        ax.errorbar(xs, [p["gain"] for p in pts], yerr=[[p["gain"] - p["ci95"][0] for p in pts],
                                                        [p["ci95"][1] - p["gain"] for p in pts]],
                    fmt="o-", capsize=3, color=colors[seed], label=f"seed {seed}")
    ax.axhline(0, color="gray", lw=0.8, label="PRAG's sum (0)")
    cands = sorted({str(p.get("candidate")) for p in points if p.get("candidate")})
    ax.set_xscale("log", base=2)
    qs = sorted({p["questions"] for p in points})
    ax.set_xticks(qs)
    ax.set_xticklabels([str(q) for q in qs])
    ax.set_xlabel("training questions (log scale)")
    ax.set_ylabel("CV held-out gain over PRAG's sum (95% CI)")
    ax.set_title("Learning curve" + (f" of {', '.join(method_label('learned:' + c) for c in cands)}" if cands else "")
                 + "\ngrouped 5-fold CV on the first n training questions", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the report
def build(out_dir: Path, n_boot: int = DESC_BOOT) -> dict[str, Any]:
    """Write ``efficacy.md``, ``efficacy.json`` and the plots into ``out_dir``; returns the JSON blob."""
    out_dir.mkdir(parents=True, exist_ok=True)
    caches, d = load(common.HERE / "cache")
    scope = d["scope"]
    blob: dict[str, Any] = {"generated_by": "benchmarks/efficacy/report.py", "seed": SEED,
                            "descriptive_bootstrap_resamples": n_boot, "registered_bootstrap_resamples": analysis.BOOT,
                            "versions": versions(), "scope": scope}
    L: list[str] = []
    pngs: list[str] = []

    # --- data
    results = {ds: x["results_test"] for ds, x in d["ds"].items() if x["results_test"] is not None}
    table_ = analysis.outcome_table(results)
    by = index(table_)
    seeds_by = index(analysis.outcome_table(seed_rows(results)))
    sb = {k: {**ms, **({"prag_sum": by[k]["prag_sum"]} if "prag_sum" in by.get(k, {}) else {})}
          for k, ms in seeds_by.items()}  # each seed run beside PRAG's sum (its reference)
    expected: dict[str, int] = {}
    for ds, x in d["ds"].items():
        if x["retrieval"] is not None:
            expected[ds] = sum(r.get("split") == "test" for r in x["retrieval"])
        else:  # no split cached: the most questions any cell of this dataset has
            expected[ds] = max((len(v) for (dd, _, _), ms in by.items() if dd == ds for v in ms.values()), default=0)
    dups: dict[str, Any] = {}
    for ds, rows in results.items():
        seen: dict[tuple[str, str], list[float]] = {}
        for r in rows:
            seen.setdefault((r["key"], r["name"]), []).append(float(r["logprob"]))
        rep = [v for v in seen.values() if len(v) > 1]
        dups[ds] = {"rows": len(rows), "scored_twice_or_more": len(rep),
                    "max_spread": max((max(v) - min(v) for v in rep), default=0.0)}
    meta_rows = {ds: x["test_meta"] for ds, x in d["ds"].items() if x["test_meta"] is not None}
    meta: dict[tuple[str, str, str], dict[str, Any]] = {}
    meta_conflicts = 0
    for rows in meta_rows.values():
        m, k = merge_meta(rows)
        meta.update(m)
        meta_conflicts += k
    ana = d["analysis"]
    cv: dict[str, list[float]] = {}
    for _, m in d["controllers"]:
        if m.get("cv") and m["cv"].get("gain") is not None:
            cv.setdefault(m["candidate"], []).append(float(m["cv"]["gain"]))
    try:
        chosen_cv = analysis.select(cv) if cv else None
    except ValueError:  # a candidate name outside <objective>-<features>-<scale>
        chosen_cv = None
        caches.notes.append("the controllers' CV results could not be ranked by `analysis.select` (a candidate name "
                            "outside `<objective>-<features>-<scale>`)")
    chosen = (ana or {}).get("chosen") or chosen_cv
    best = f"learned:{chosen}" if chosen else None
    dsets_run = [ds for ds in DATASETS if ds in results]
    conds_scope = (scope or {}).get("conditions") or list(CONDITIONS)

    L.append("# Efficacy study, two datasets: learned controller vs PRAG's uniform sum (SmolLM2-135M-Instruct, CPU)\n")
    L.append("Generated by `python benchmarks/efficacy/report.py` from the committed caches in "
             "`benchmarks/efficacy/cache/` only (no model is loaded; `work/` is not read). The analysis plan, "
             "registered before any test-split result, is `docs/results/efficacy-plan.md` (with its changes after "
             "registration). Every number below comes from those caches; what has not been run is listed as such. "
             "The earlier one-dataset study's caches (`cache/v1-200q/`) are not read.\n")
    L.append("**Read with** `docs/results/efficacy-fresh.md`: a second, registered study on 196 questions never "
             "scored before, with answers (F1 / EM by PRAG's rules) and the gain split into a total scale and a "
             "reweighting. Its verdict on this study's finding: the gain is the scale; the reweighting adds nothing "
             "measurable. The cross-validated gains quoted below are this study's own (first order, epochs chosen "
             "and scored on the same folds), not the library's current selection-unbiased verdict.\n")
    L.append("## What is not run yet\n")
    miss = list(caches.missing) + list(caches.notes)
    L += [f"- {x}" for x in miss] if miss else ["- nothing: every cache the report reads exists."]
    L.append("")

    # --- 1. setup
    L.append("## 1. Setup\n")
    setup: dict[str, Any] = {"model": common.MODEL_NAME, "gguf": common.GGUF_FILE, "datasets": {}}
    rows_setup = []
    for ds in DATASETS:
        x = d["ds"][ds]
        s: dict[str, Any] = {}
        if x["retrieval"] is not None:
            s["questions"] = len(x["retrieval"])
            s["train"] = sum(r.get("split") == "train" for r in x["retrieval"])
            s["test"] = expected[ds]
            top3 = [p.get("supporting") for r in x["retrieval"] if r.get("split") == "test" for p in r["passages"][:3]]
            s["test_top3_supporting_share"] = mean([float(bool(v)) for v in top3]) if top3 else None
        if scope:
            s["train_used"] = len(scope.get("train_ids", {}).get(ds, []))
        s["adapters"] = adapter_summary(x["adapters"]) if x["adapters"] is not None else None
        s["labels"] = label_summary(x["labels_train"]) if x["labels_train"] is not None else None
        setup["datasets"][ds] = s
        a, lab = s["adapters"], s["labels"]
        rows_setup.append([
            ds, s.get("questions", "not run"),
            f"{s.get('train_used', s.get('train', '—'))} of {s.get('train', '—')}" if "train" in s else "not run",
            s.get("test", "not run"),
            f(s.get("test_top3_supporting_share"), 3, False),
            (f"{a['count']}; {a['mean_steps']:.2f} steps; passage loss {f(a['passage_loss_at_step'], 3, False)} → "
             f"{f(a['passage_loss_after'], 3, False)}; qa0 {f(a['qa0_loss_at_step'], 3, False)} → "
             f"{f(a['qa0_loss_after'], 3, False)}") if a and a["count"] else "not run",
            (f"{lab['records']} records, {lab['questions']} questions; {lab['flat']} flat; best passage supporting in "
             f"{lab['best_passage_supporting']} of {lab['non_flat']} non-flat (supporting share of passages "
             f"{f(lab['supporting_share_of_passages'], 2, False)})") if lab else "not run"])
    L += table(["dataset", "questions", "train used (of train split)", "test", "supporting share, test top-3",
                "adapters (count; mean steps; loss at step → after)", "labels (`labels_train.jsonl`)"], rows_setup)
    if scope:
        L.append(f"Scope frozen {scope.get('frozen_utc')} (`cache/scope.json`): training questions "
                 f"{scope.get('train_questions')}; conditions {', '.join(conds_scope)}. "
                 f"Reason: {scope.get('reason')}\n")
    else:
        L.append("No scope freeze (`cache/scope.json` absent): the registered full scope.\n")
    fx = fixed_points({ds: x["results_train"] for ds, x in d["ds"].items()})
    setup["fixed_baselines"] = fx
    bench = [r for r in d["timings"] or [] if r.get("stage") in NOT_SUMMED]
    dtype = bench[-1].get("dtype") if bench else None
    L.append(f"- Model: {common.MODEL_NAME} (`{common.GGUF_FILE}`, dequantized"
             + (f", {dtype} compute as recorded by the adapter bench" if dtype else "") + "), CPU. Adapters: PRAG's "
             "recipe, one per retrieved passage (LoRA r 2, alpha 32, gate/up/down_proj, AdamW lr 3e-4, 1 epoch).")
    if fx:
        L.append("- Fixed baselines tuned on the training split (best grid point by mean training gold log-lik.; "
                 "PRAG's sum on the same top-3 for reference): " + "; ".join(
                     f"`{v['best']}` {f(v['mean'], 4, False)} over {v['questions']} questions "
                     f"({v['points']} points; PRAG's sum {f(v['prag_sum_mean'], 4, False)})"
                     for v in fx.values()) + ".")
    else:
        L.append("- Fixed baselines' grids: not run (no `kappa:*`/`cos:*`/`bm25:*` rows in `results_train.jsonl`: the "
                 "`grids` stage has not run).")
    L.append(f"- Library versions of the environment that generated this report: `{json.dumps(blob['versions'])}`.\n")
    blob["setup"] = setup

    # --- 2. primary
    L.append("## 2. Pre-registered primary comparison\n")
    L.append("Chosen configuration (by grouped CV on the training split) − PRAG's sum, `param` prompt, clean "
             "retrieval, gold-answer mean token log-likelihood, both datasets' test questions pooled; 95% CI: paired "
             f"bootstrap over questions within each dataset ({analysis.BOOT:,} resamples); p: paired sign-flip test "
             f"({analysis.FLIPS:,} flips). Reading (registered): better than PRAG's sum if the CI's lower bound is "
             f"above 0; never worse beyond noise if it is at least {MARGIN}; otherwise worse.\n")
    check: dict[str, Any] = {}
    primary = (ana or {}).get("primary") or {}
    exp_total = sum(expected.get(ds, 0) for ds in DATASETS)
    if ana is None:
        L.append(f"Not run: {WHY['analysis.json']}.\n")
    elif not ana.get("chosen"):
        L.append("Not run: `analysis.json` has no chosen configuration (no controller with a CV result when it was "
                 "written).\n")
    elif not primary.get("n"):
        L.append(f"Not run: no test rows of `{best}` and `prag_sum` on `param`/clean when `analysis.json` was "
                 "written.\n")
    # staleness: the file against the results and controllers it should have been computed from
    if ana is not None:
        stale = []
        if ana.get("chosen") != chosen_cv:
            stale.append(f"its chosen configuration `{ana.get('chosen')}` is not the one the controllers' CV "
                         f"selects now (`{chosen_cv}`)")
        if best:
            diffs = [v[best] - v["prag_sum"] for (dd, _, c, m), v in table_.items()
                     if c == "clean" and m == "param" and best in v and "prag_sum" in v]
            check = {"n": len(diffs), "delta_loglik": mean(diffs) if diffs else None}
            off = bool(diffs) and abs((primary.get("delta_loglik") or 0.0) - mean(diffs)) > 1e-9
            if primary.get("n", 0) != len(diffs) or off:
                stale.append(f"its primary n / Δ ({primary.get('n', 0)}, {f(primary.get('delta_loglik'))}) differ "
                             f"from the results now ({len(diffs)}, {f(mean(diffs)) if diffs else '—'})")
        check["stale"] = stale
        if stale:
            L.append("**`analysis.json` is stale**: " + "; ".join(stale) + ". Rerun `python benchmarks/efficacy/"
                     "analysis.py` and then this report; the numbers quoted below are the file's.\n")
    if primary.get("n"):
        lo = primary["ci95"][0]
        done = primary["n"] >= exp_total
        L += table(["configuration", "datasets", "n", "mean paired Δ gold log-lik.", "95% CI", "p (sign-flip)"],
                   [[f"`{primary['method']}` − `prag_sum`", ", ".join(primary.get("datasets", [])), primary["n"],
                     f(primary["delta_loglik"]), f"[{f(primary['ci95'][0])}, {f(primary['ci95'][1])}]",
                     pval(primary.get("p"))]])
        if done:
            L.append(f"Reading: {reading(lo)}.\n")
        else:
            L.append(f"**Not a result**: the evaluation covered {primary['n']} of {exp_total} test questions (a pass "
                     "that did not finish; the plan reports it as not run).\n")
    orc = (ana or {}).get("oracle") or {}
    if orc.get("n"):
        L.append(f"Reference, never tested: the leave-one-out oracle (reads the answer) − PRAG's sum: n {orc['n']}, "
                 f"Δ {f(orc['delta_loglik'])} [{f(orc['ci95'][0])}, {f(orc['ci95'][1])}].\n")
    blob["analysis"] = ana
    blob["analysis_check"] = check

    # --- 3. secondary
    L.append("## 3. Secondary comparisons (Holm-corrected together)\n")
    sec = (ana or {}).get("secondary") or {}
    if not sec:
        L.append("Not run: " + (WHY["analysis.json"] if ana is None else "`analysis.json` has no secondary family")
                 + ".\n")
    else:
        rows = []
        for name, v in sec.items():
            if v.get("n"):
                exp = sum(expected.get(ds, 0) for ds in v.get("datasets", []))
                if v["n"] < exp:
                    rows.append([name, f"{v['n']}/{exp}", "not run to completion: not a result", "", "", ""])
                    continue
                rows.append([name, v["n"], f(v["delta_loglik"]), f"[{f(v['ci95'][0])}, {f(v['ci95'][1])}]",
                             pval(v.get("p")), pval(v.get("p_holm"))])
            else:
                cond = name.rsplit("/", 1)[-1] if "/" in name else "clean"
                why = ("dropped at the scope freeze (`cache/scope.json`)" if cond not in conds_scope
                       else "no test rows for it when `analysis.json` was written")
                rows.append([name, 0, f"not run: {why}", "", "", ""])
        L += table(["comparison (vs `prag_sum`)", "n", "mean paired Δ", "95% CI", "p", "Holm p"], rows)

    # --- 4. CV
    L.append("## 4. Candidate selection: grouped cross-validation on the training split\n")
    ctrl = d["controllers"]
    if not ctrl:
        L.append(f"Not run: {WHY['controllers']}.\n")
    else:
        metric = next((m["cv"].get("metric") for _, m in ctrl if m.get("cv")), None)
        L.append("Each run: the library trainer's grouped 5-fold CV by question on both datasets' pooled training "
                 "labels (" + (f"gain = {metric}" if metric else "gain as recorded by the trainer") + "; 95% CI by "
                 "bootstrap over questions). Selection: the highest mean gain over seeds; ties within "
                 f"{analysis.TIE} go to the configuration with fewer changes from the paper's. "
                 f"Chosen: **`{chosen}`**" + ("" if chosen == chosen_cv else f" (per `analysis.json`; the CV now "
                                                                              f"selects `{chosen_cv}`)") + ".\n")
        rows = []
        for fname, m in sorted(ctrl, key=lambda t: (t[1].get("candidate", ""), t[1].get("seed", 0))):
            c = m.get("cv") or {}
            if c.get("gain") is None:
                rows.append([m.get("candidate"), m.get("seed"), m.get("questions", "—"), "no CV result", "", "", "",
                             m.get("seconds", "—"), f"`{fname}`"])
                continue
            rows.append([m.get("candidate"), m.get("seed"), c.get("n_groups", m.get("questions", "—")),
                         f(c["gain"], 5), f"[{f(c['ci95'][0], 5)}, {f(c['ci95'][1], 5)}]", c.get("verdict", "—"),
                         f"{c.get('selected_epochs', '—')} of {m.get('epochs_max', c.get('max_epochs', '—'))}",
                         m.get("seconds", "—"), f"`{fname}`"])
        L.append("Every run (`cache/controllers/`):\n")
        L += table(["candidate", "seed", "questions", "CV gain", "95% CI", "verdict", "selected epochs", "seconds",
                    "file"], rows)
        rows = []
        for cand in sorted({m.get("candidate") for _, m in ctrl}):
            runs = [m for _, m in ctrl if m.get("candidate") == cand]
            g = cv.get(cand, [])
            better = sum((m.get("cv") or {}).get("verdict") == "better_than_uniform" for m in runs)
            rows.append([("**" + cand + "** (chosen)") if cand == chosen else cand, len(g),
                         f(mean(g), 5) if g else "—", f"{better} of {len(runs)}",
                         analysis.changes_from_paper(cand) if cand.count("-") == 2 else "—"])
        L.append("Mean over seeds:\n")
        L += table(["candidate", "seeds with CV", "mean CV gain", "seeds whose CI is above 0", "changes from paper"],
                   rows)
        if not any((m.get("cv") or {}).get("verdict") == "better_than_uniform" for _, m in ctrl):
            L.append("No candidate's CV gain has a 95% CI above 0 in any seed; the primary comparison is run on the "
                     "chosen configuration all the same (the plan).\n")
    blob["controllers"] = {fname: m for fname, m in ctrl}
    blob["cv_mean_gain"] = {c: mean(g) for c, g in cv.items()}
    blob["chosen"] = chosen

    # --- discussion (hand-written), once
    if d["discussion"] is not None:
        L.append(d["discussion"].rstrip("\n") + "\n")
    else:
        L.append("## Discussion\n\nNot written yet (`benchmarks/efficacy/discussion.md` does not exist).\n")

    # --- 5. every method x prompt x condition
    L.append("## 5. Every method × prompt × condition\n")
    L.append(f"Mean gold log-lik. per test question with its 95% CI, and the paired difference against `prag_sum` "
             f"(questions that have both) with its CI; percentile bootstrap over questions, within each dataset, "
             f"{n_boot:,} resamples (the registered numbers above use {analysis.BOOT:,}). `learned:<candidate>` is the "
             "mean of its seeds' values per question. A cell that does not cover every test question is a pass that "
             "did not finish: not run (questions covered / test questions).\n")
    cells: dict[str, Any] = {}
    if not results:
        L.append(f"Not run: {WHY['results_test.jsonl']}.\n")
    present = sorted({(c, m) for (_, c, m) in by}, key=lambda t: (CONDITIONS.index(t[0]) if t[0] in CONDITIONS else 9,
                                                                   MODES.index(t[1]) if t[1] in MODES else 9, t))
    groups = [(ds,) for ds in DATASETS] + [tuple(DATASETS)]
    for cond, mode in present:
        names = {m for (dd, c, mo), ms in by.items() if (c, mo) == (cond, mode) for m in ms}
        core = {"prag_sum", "average"} | ({best} if best else set())
        if (cond, mode) == ("clean", "param"):
            core |= {"random", "best_kappa", "best_cos", "best_bm25", "oracle"}
        methods = order_methods(names | core, chosen)
        L.append(f"### `{mode}` prompt, {cond}\n")
        rows = []
        for meth in methods:
            row = [f"`{meth}`" + (" (chosen)" if meth == best else "")]
            for g in groups:
                k = f"{meth}|{cond}|{mode}|{'+'.join(g)}"
                c = cell(by, meth, cond, mode, g, expected, n_boot)
                cells[k] = c
                if not c["complete"]:
                    row += [coverage(c), ""]
                else:
                    row += [fci(c["mean"], 3, False), fci(c["delta"]) if "delta" in c else "—"]
            rows.append(row)
        head = ["method"]
        for g in groups:
            lab = g[0] if len(g) == 1 else "pooled"
            head += [f"{lab}: gold log-lik.", f"{lab}: Δ vs prag_sum"]
        L += table(head, rows)
        sd = sorted({m for (dd, c, mo), ms in seeds_by.items() if (c, mo) == (cond, mode) for m in ms})
        if sd:
            L.append(f"Each learned seed separately (`{mode}`, {cond}): Δ vs `prag_sum` (per dataset: the mean; "
                     "pooled: with its 95% CI)\n")
            rows = []
            for s in sd:
                row = [f"`{s[1:]}`"]
                for g in groups:
                    c = cell(sb, s, cond, mode, g, expected, n_boot if len(g) > 1 else 0)
                    cells[f"{s[1:]}|{cond}|{mode}|{'+'.join(g)}"] = c
                    row.append(fci(c["delta"]) if "delta" in c else coverage(c))
                rows.append(row)
            L += table(["seed run"] + [g[0] if len(g) == 1 else "pooled" for g in groups], rows)
    blob["cells"] = cells
    blob["expected_test_questions"] = expected
    pooled_key = f"|clean|param|{'+'.join(DATASETS)}"
    delta_rows = [(k.split("|")[0], c["delta"]) for k, c in cells.items()
                  if k.endswith(pooled_key) and "delta" in c and k.split("|")[0] == base_name(k.split("|")[0])]
    if delta_rows:
        plot_delta(delta_rows, out_dir / "efficacy_delta.png", chosen)
        pngs.append("efficacy_delta.png")
        L.append("![Δ vs PRAG's sum](efficacy_delta.png)\n")

    # --- 6. weight on supporting passages
    L.append("## 6. Weight on supporting passages\n")
    shares = share_table(meta)
    blob["supporting_share"] = shares
    if not meta:
        L.append(f"Not run: {WHY['test_meta.jsonl']}.\n")
    else:
        if meta_conflicts:
            L.append(f"{meta_conflicts} metadata line(s) disagreed with an earlier line of the same question on the "
                     "positions; the first line was kept.\n")
        L.append("Mean over test questions of the share of the merge weight (w~, from `test_meta.jsonl`, a question's "
                 "lines merged) on the positions holding a supporting passage; `learned:<candidate>` averages its "
                 "seeds per question. (The oracle's weights are computed at scoring time and are not in the "
                 "metadata.)\n")
        for cond in [c for c in CONDITIONS if c in shares]:
            ms = order_methods(set(shares[cond]), chosen) + sorted(
                m for m in shares[cond] if m != base_name(m))
            ms = list(dict.fromkeys(ms))
            rows = []
            for m in ms:
                v = shares[cond][m]
                rows.append([f"`{m}`" + (" (chosen)" if m == best else "")]
                            + [f"{f(v['mean'].get(ds), 3, False)} ({v['n'].get(ds, 0)})"
                                          for ds in (*DATASETS, "pooled")] + [v["undefined"]])
            L.append(f"### {cond}\n")
            L += table(["method", *[f"{ds} (n)" for ds in DATASETS], "pooled (n)", "questions with Σw~ = 0"], rows)
        clean = shares.get("clean", {})
        plot_methods = [m for m in order_methods(set(clean), chosen) if m == base_name(m)]
        if plot_methods:
            plot_share(shares, plot_methods, out_dir / "efficacy_supporting_weight.png", chosen)
            pngs.append("efficacy_supporting_weight.png")
            L.append("![weight on supporting passages](efficacy_supporting_weight.png)\n")

    # --- 7. calibration
    L.append("## 7. Calibration outputs (g, tau) of the learned controllers\n")
    calib: dict[str, dict[str, list[list[float]]]] = {}
    for (ds, _, cond), m in sorted(meta.items()):
        for name, v in (m.get("calibration") or {}).items():
            if v and len(v) >= 2:
                calib.setdefault(name, {}).setdefault(cond, []).append([float(x) for x in v])
    cal_sum = {name: {cond: {"n": len(v), "g_mean": mean([x[0] for x in v]), "g_min": min(x[0] for x in v),
                             "g_max": max(x[0] for x in v), "tau_mean": mean([x[1] for x in v]),
                             "scale_mean": mean([x[2] for x in v if len(x) > 2])
                             if any(len(x) > 2 for x in v) else None}
                      for cond, v in cs.items()} for name, cs in calib.items()}
    blob["calibration"] = cal_sum
    if not calib:
        L.append("Not run: no learned controller's `calibration` in `test_meta.jsonl` "
                 f"({'the eval stage has not scored a learned controller yet' if meta else WHY['test_meta.jsonl']}).\n")
    else:
        rows = [[f"`{name}`" + (" (chosen)" if base_name(name) == best else ""), cond, v["n"], f(v["g_mean"], 3, False),
                 f"{f(v['g_min'], 3, False)} – {f(v['g_max'], 3, False)}", f(v["tau_mean"], 3, False),
                 f(v["scale_mean"], 3, False)]
                for name in sorted(cal_sum) for cond, v in cal_sum[name].items()]
        L += table(["controller run", "condition", "questions", "mean g", "g range", "mean tau", "mean total scale"],
                   rows)
        mine = {name: {c: [(x[0], x[1]) for x in v] for c, v in cs.items()}
                for name, cs in calib.items() if best and base_name(name) == best}
        if mine:
            plot_g_tau(mine, out_dir / "efficacy_g_tau.png")
            pngs.append("efficacy_g_tau.png")
            L.append(f"![(g, tau) of {best}'s seeds](efficacy_g_tau.png)\n")
        else:
            why = "no configuration chosen yet" if not best else f"no calibration recorded for `{best}`"
            L.append(f"(g, tau) scatter of the chosen configuration: not run ({why}).\n")

    # --- 8. retention
    L.append("## 8. Perturbation retention\n")
    L.append("Δ gold log-lik. perturbed − clean of the same method and question (`param` prompt), 95% CI "
             f"({n_boot:,} resamples within each dataset). Replace-one: one passage swapped for another test "
             "question's passage; repeat-one: one passage listed twice.\n")
    ret: dict[str, Any] = {}
    rrows, prow = [], []
    for cond in [c for c in ("replace", "repeat", "alt") if any(k[1] == c for k in by)]:
        names = {m for (dd, c, mo), ms in by.items() if c == cond and mo == "param" for m in ms}
        for meth in order_methods(names | {"prag_sum"} | ({best} if best else set()), chosen):
            row = [cond, f"`{meth}`" + (" (chosen)" if meth == best else "")]
            for g in groups:
                c = cell(by, meth, cond, "param", g, expected, n_boot, base=meth, base_cond="clean")
                ret[f"{meth}|{cond}|{'+'.join(g)}"] = c
                row.append(fci(c["delta"]) if "delta" in c else coverage(c))
                if len(g) > 1 and "delta" in c:
                    prow.append((cond, meth, c["delta"]))
            rrows.append(row)
    not_run = [c for c in ("replace", "repeat") if not any(k[1] == c for k in by)]
    if rrows:
        L += table(["condition", "method", *DATASETS, "pooled"], rrows)
    for c in not_run:
        L.append(f"- {c}: not run (no test rows" + ("" if c in conds_scope else "; dropped at the scope freeze") + ").")
    if "alt" not in conds_scope:
        L.append("- alt (second subset): not run (dropped at the scope freeze, `cache/scope.json`).")
    L.append("")
    blob["retention"] = ret
    if prow:
        plot_retention(prow, out_dir / "efficacy_retention.png", chosen)
        pngs.append("efficacy_retention.png")
        L.append("![retention](efficacy_retention.png)\n")

    # --- 9. learning curve
    L.append("## 9. Learning curve\n")
    cpts = []
    for fname, m in d["curve"]:
        c = m.get("cv") or {}
        cpts.append({"file": fname, "questions": m.get("questions"), "seed": m.get("seed", 0),
                     "candidate": m.get("candidate"), "gain": c.get("gain"), "ci95": c.get("ci95"),
                     "verdict": c.get("verdict"), "selected_epochs": c.get("selected_epochs"),
                     "seconds": m.get("seconds")})
    cpts.sort(key=lambda p: (p["questions"] or 0, p["seed"] or 0))
    blob["curve"] = cpts
    if not cpts:
        L.append(f"Not run: {WHY['curve']} (`cache/curve/` is empty).\n")
    else:
        L.append("The chosen configuration's grouped-CV held-out gain trained on the first n training questions "
                 "(the adapter stage's order; `cache/curve/`).\n")
        L += table(["training questions", "seed", "candidate", "CV gain", "95% CI", "verdict", "selected epochs",
                    "file"],
                   [[p["questions"], p["seed"], p["candidate"], f(p["gain"], 5),
                     f"[{f(p['ci95'][0], 5)}, {f(p['ci95'][1], 5)}]" if p["ci95"] else "—", p["verdict"],
                     p["selected_epochs"], f"`{p['file']}`"] for p in cpts])
        ok = [p for p in cpts if p["gain"] is not None and p["ci95"] and p["questions"] is not None]
        if ok:
            plot_curve(ok, out_dir / "efficacy_learning_curve.png")
            pngs.append("efficacy_learning_curve.png")
            L.append("![learning curve](efficacy_learning_curve.png)\n")

    # --- 10. cost
    L.append("## 10. Cost per stage (wall-clock)\n")
    cost = stage_costs({ds: x["timings"] for ds, x in d["ds"].items()}, d["timings"],
                       {ds: x["adapters"] for ds, x in d["ds"].items()}, d["controllers"], d["curve"])
    blob["cost"] = cost
    if not cost["stages"]:
        L.append("Not run: no stage has recorded its wall-clock.\n")
    else:
        L.append("Sum of the seconds of every recorded run of a stage (a stage records itself when it finishes, so a "
                 "run that was stopped is not in the sum; the adapter stage's cost is the sum over the adapter groups "
                 "it logged).\n")
        L += table(["stage", "runs", "seconds", "hours", "source"],
                   [[k, v["runs"], v["seconds"], f"{v['seconds'] / 3600:.2f}", f"`{v['source']}`"]
                    for k, v in cost["stages"].items()] +
                   [["**total**", "", cost["total_seconds"], f"{cost['total_seconds'] / 3600:.2f}", ""]])
    for b in cost["bench"]:
        runs = ", ".join(f"group {r.get('group')}: {r.get('adapters_per_s')} adapters/s" for r in b.get("runs", []))
        info = {"adapters": b.get("adapters"), "best group": b.get("best_group"), "threads": b.get("threads"),
                "dtype": b.get("dtype"), "finished": b.get("finished")}
        L.append(f"- Adapter bench (`{b.get('stage')}`, not in the sums): {runs}; "
                 + ", ".join(f"{k} {v}" for k, v in info.items() if v is not None) + ".")
    if cost["progress"]:
        p = cost["progress"][-1]
        L.append(f"- {len(cost['progress'])} progress snapshot(s) (not in the sums); the last ({p.get('now_utc')}): "
                 f"adapters {p.get('adapters_done')}, labels {p.get('labels_questions_done')}.")
    L.append("")

    # --- 11. every run
    L.append("## 11. Every run\n")
    L.append("Rows in `results_test.jsonl` per method (each seed and leave-one-out row separately): questions "
             "scored per dataset, condition and prompt.\n")
    raw: dict[str, dict[str, set[str]]] = {}
    for ds, rows in results.items():
        for r in rows:
            _, qid, cond, mode = r["key"].split("|")
            raw.setdefault(r["name"], {}).setdefault(f"{ds} {cond}/{mode}", set()).add(qid)
    cols = sorted({c for v in raw.values() for c in v})
    if raw:
        L += table(["row name", *cols], [[f"`{n}`", *[len(raw[n].get(c, ())) or "" for c in cols]]
                                         for n in sorted(raw, key=lambda n: (n.startswith("loo:"), n))])
    else:
        L.append(f"No test rows: {WHY['results_test.jsonl']}.\n")
    for ds, v in dups.items():
        if v["scored_twice_or_more"]:
            L.append(f"- {ds}: {v['scored_twice_or_more']} (question, row) pairs were scored more than once (largest "
                     f"spread {v['max_spread']:.2g}); each counts as the mean of its values, as in `analysis.py`.")
    L.append(f"- Controller runs: {len(d['controllers'])} (`cache/controllers/`, all listed in section 4); "
             f"learning-curve runs: {len(d['curve'])} (section 9).")
    L.append("")
    blob["runs"] = {"results_test_rows": {n: {c: len(q) for c, q in v.items()} for n, v in raw.items()},
                    "duplicates": dups}
    blob["missing"] = miss

    # --- 12. the held-out command
    blob["heldout_command"] = heldout_section(common.HERE / "cache" / "heldout", L, n_boot)

    # --- write
    for p in out_dir.glob("efficacy_*.png"):
        if p.name not in pngs:
            p.unlink()
    blob["plots"] = pngs
    (out_dir / "efficacy.md").write_text("\n".join(L).rstrip("\n") + "\n", encoding="utf-8")
    write_json(out_dir / "efficacy.json", _clean(blob))
    return blob


def heldout_section(root: Path, L: list[str], n_boot: int) -> dict[str, Any]:
    """Section 12: ``run_all.py`` on question files with the recommended controller (``cache/heldout/<file>/``:
    its ``eval.jsonl`` and ``summary*.json``), per file and pooled (bootstrap resampled within each file)."""
    import heldout

    L.append("## 12. The held-out command (`run_all.py`, the recommended controller)\n")
    runs = sorted(p for p in root.glob("*/eval.jsonl")) if root.is_dir() else []
    if not runs:
        L.append("Not run: `cache/heldout/` holds no `run_all.py` output.\n")
        return {}
    L.append("`python benchmarks/efficacy/run_all.py --data ../shared/data/<file>.jsonl --controller "
             "benchmarks/efficacy/controller --out <dir> --limit N [--prompt combine]`: each file's first N questions "
             "after leaving out the controller's 126 training questions; BM25 top 3, adapters trained afresh, gold "
             "answer log-lik. Paired difference against PRAG's sum, 95% bootstrap CI over questions "
             f"(pooled: resampled within each file, {n_boot} resamples). `learned_same_total` puts every passage at "
             "the mean of the learned weights: the controller's total scale without its reweighting. The bar is the "
             f"issue's: lower bound >= {MARGIN}.\n")
    out: dict[str, Any] = {}
    rows = []
    tables = {path.parent.name: heldout.per_question(read_jsonl(path)) for path in runs}  # each file read once
    for prompt in ("param", "combine"):
        per_file: dict[str, dict[str, dict[str, float]]] = {}
        for file, t in tables.items():
            table_ = {k: v for k, v in t.items() if k.endswith(f"|{prompt}")}
            if table_:
                per_file[file] = table_
        if not per_file:
            continue
        methods = sorted({m for t in per_file.values() for v in t.values() for m in v
                          if not m.startswith("loo:") and m != "prag_sum"})
        pairs = [(m, "prag_sum") for m in methods]
        if {"learned", "learned_same_total"} <= set(methods):  # the reweighting's own part, at the same total
            pairs.append(("learned", "learned_same_total"))
        for m, ref in pairs:
            diffs = {f: [v[m] - v[ref] for v in t.values() if m in v and ref in v]
                     for f, t in per_file.items()}
            cells = [(f, {f: d}) for f, d in diffs.items()] + ([("pooled", diffs)] if len(diffs) > 1 else [])
            for name, strata in cells:
                n = sum(len(d) for d in strata.values())
                if not n:
                    continue
                label = m if ref == "prag_sum" else f"{m} - {ref}"
                point, lo, hi = analysis.paired_bootstrap(strata, f"heldout:{prompt}:{name}:{label}", n=n_boot)
                out.setdefault(prompt, {}).setdefault(name, {})[label] = {"n": n, "delta_loglik": point,
                                                                           "ci95": [lo, hi]}
                rows.append([prompt, name, n, f"`{label}`", fci([point, lo, hi]),
                             "" if m in ("average", "oracle") or ref != "prag_sum"
                             else ("yes" if lo >= MARGIN else "**no**")])
    L += table(["prompt", "file", "questions", "method", "Δ vs PRAG's sum [95% CI]", f"lower bound >= {MARGIN}"],
               rows)
    L.append("`learned - learned_same_total` is the paired difference between the two rows (not against PRAG's "
             "sum): what the controller's reweighting between passages adds at its own total scale.\n")
    L.append("`oracle` reads the answer (a reference, not a method); `average` is PRAG's 1/N merge.\n")
    return out


def _clean(x: Any) -> Any:
    """JSON-ready: NaN -> None, tuples -> lists."""
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {OUT_DIR})")
    p.add_argument("--boot", type=int, default=DESC_BOOT, help="bootstrap resamples of the descriptive CIs")
    a = p.parse_args(argv)
    out = a.out or OUT_DIR
    blob = build(out, a.boot)
    print(f"report: {out / 'efficacy.md'}, efficacy.json, plots {blob['plots']}; not run: {len(blob['missing'])} "
          "cache file(s)", flush=True)


if __name__ == "__main__":
    main()
