"""The registered analysis (``docs/results/efficacy-plan.md``) from the committed caches only -> ``cache/analysis.json``.

    python benchmarks/efficacy/analysis.py

- Selection (training split only): per candidate, the trainer's grouped-CV gain of seed 0
  (``cache/controllers/<candidate>-s0.json``; plan change 2: only the chosen configuration gets seeds 1 and 2,
  so its later seeds cannot change the choice); the highest wins, ties within ``TIE`` go to the candidate that
  changes fewer options from the paper's (KL objective, paper features, kappa 1).
- Outcome per test question: gold log-lik. from ``cache/<ds>/results_test.jsonl``; a learned configuration's value
  is the mean over its seeds.
- Primary: chosen configuration vs ``prag_sum``, ``param`` prompt, clean, both datasets pooled: mean paired
  difference, 95% paired bootstrap CI (``BOOT`` resamples, resampled within each dataset), two-sided sign-flip
  randomisation p-value (``FLIPS`` flips).
- Secondary (Holm-corrected together): the primary per dataset; every other method on ``param``/clean pooled; the
  chosen configuration on ``combine``/clean, and under replace / repeat / alt (``param``), pooled.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import SEED, cache_dir, read_jsonl, write_json  # noqa: E402

BOOT = 10_000
FLIPS = 10_000
TIE = 0.001
PAPER = {"objective": "kl", "features": "paper", "scale": "k1"}
DATASETS = ("hotpotqa", "2wiki")


SELECTION_SEEDS = (0,)  # the selection reads these seeds' CV (docs/results/efficacy-plan.md, change 2)


def cv_gains(folder: Path, seeds: Sequence[int] = SELECTION_SEEDS) -> dict[str, list[float]]:
    """``{candidate: [CV gain per seed in seeds]}`` from ``folder/<candidate>-s<seed>.json``."""
    cv: dict[str, list[float]] = {}
    for f in sorted(folder.glob("*.json")):
        m = json.loads(f.read_text())
        if m.get("seed") in seeds and m.get("cv") and m["cv"].get("gain") is not None:
            cv.setdefault(m["candidate"], []).append(float(m["cv"]["gain"]))
    return cv


def changes_from_paper(candidate: str) -> int:
    obj, feat, scale = candidate.split("-")
    return (obj != PAPER["objective"]) + (feat != PAPER["features"]) + (scale != PAPER["scale"])


def select(cv: dict[str, list[float]]) -> str:
    """The candidate with the highest mean CV gain over its seeds; ties within ``TIE`` -> fewer changes."""
    means = {c: sum(g) / len(g) for c, g in cv.items() if g}
    top = max(means.values())
    near = [c for c, m in means.items() if m >= top - TIE]
    return min(near, key=lambda c: (changes_from_paper(c), -means[c], c))


def resampled_means(strata: list[list[float]], r: random.Random, n: int) -> list[float]:
    """``n`` bootstrap means of the pooled values (each stratum resampled within itself, its own size), sorted."""
    total = sum(len(v) for v in strata)
    return sorted(sum(sum(v[r.randrange(len(v))] for _ in v) for v in strata) / total for _ in range(n))


def paired_bootstrap(diffs: dict[str, Sequence[float]], seed: str, n: int = BOOT) -> tuple[float, float, float]:
    """Mean of the pooled per-question differences and its percentile CI, resampling within each stratum."""
    strata = [list(v) for v in diffs.values() if len(v)]
    point = sum(sum(v) for v in strata) / sum(len(v) for v in strata)
    stats = resampled_means(strata, random.Random(f"{SEED}:{seed}"), n)
    return point, stats[int(0.025 * n)], stats[min(n - 1, int(0.975 * n))]


def sign_flip_p(diffs: Sequence[float], seed: str, n: int = FLIPS) -> float:
    """Two-sided p-value of the mean paired difference under random sign flips (+1 smoothing)."""
    r = random.Random(f"{SEED}:flip:{seed}")
    obs = abs(sum(diffs))
    hits = sum(abs(sum(d if r.random() < 0.5 else -d for d in diffs)) >= obs - 1e-12 for _ in range(n))
    return (hits + 1) / (n + 1)


def holm(p: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values (step-down, monotone, capped at 1)."""
    order = sorted(p, key=p.get)
    out, running = {}, 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * p[k]))
        out[k] = running
    return out


def outcome_table(results: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, str, str, str], dict[str, float]]:
    """``{(dataset, id, condition, mode): {method: gold log-lik.}}``; seeds of a learned configuration averaged
    into ``learned:<candidate>``."""
    table: dict[tuple[str, str, str, str], dict[str, list[float]]] = {}
    for ds, rows in results.items():
        for r in rows:
            _, qid, cond, mode = r["key"].split("|")
            name = r["name"]
            if name.startswith("learned:"):
                name = ":".join(name.split(":")[:2])  # learned:<candidate>:s<seed> -> learned:<candidate>
            table.setdefault((ds, qid, cond, mode), {}).setdefault(name, []).append(float(r["logprob"]))
    return {k: {m: sum(v) / len(v) for m, v in ms.items()} for k, ms in table.items()}


def compare(table: dict, method: str, cond: str, mode: str, datasets: Sequence[str], seed: str) -> dict[str, Any]:
    diffs = {ds: [v[method] - v["prag_sum"] for (d, _, c, m), v in sorted(table.items())
                  if d == ds and c == cond and m == mode and method in v and "prag_sum" in v] for ds in datasets}
    flat = [x for v in diffs.values() for x in v]
    if not flat:
        return {"n": 0}
    point, lo, hi = paired_bootstrap(diffs, seed)
    return {"n": len(flat), "delta_loglik": point, "ci95": [lo, hi], "p": sign_flip_p(flat, seed),
            "method": method, "condition": cond, "mode": mode, "datasets": list(datasets)}


def analyse(results: dict[str, list[dict[str, Any]]], cv: dict[str, list[float]]) -> dict[str, Any]:
    table = outcome_table(results)
    chosen = select(cv) if cv else None
    out: dict[str, Any] = {"chosen": chosen, "cv_mean_gain": {c: sum(g) / len(g) for c, g in cv.items() if g}}
    if chosen is None:
        return out
    best = f"learned:{chosen}"
    dsets = [ds for ds in DATASETS if ds in results]
    out["primary"] = compare(table, best, "clean", "param", dsets, "primary")
    second: dict[str, dict[str, Any]] = {}
    for ds in dsets:
        second[f"primary@{ds}"] = compare(table, best, "clean", "param", [ds], f"primary@{ds}")
    methods = sorted({m for v in table.values() for m in v
                      if m not in ("prag_sum", best, "oracle") and not m.startswith("loo:")})
    for m in methods:
        second[f"{m}@param/clean"] = compare(table, m, "clean", "param", dsets, m)
    second[f"{best}@combine/clean"] = compare(table, best, "clean", "combine", dsets, "combine")
    for cond in ("replace", "repeat", "alt"):
        second[f"{best}@param/{cond}"] = compare(table, best, cond, "param", dsets, cond)
    tested = {k: v["p"] for k, v in second.items() if v.get("n")}
    for k, p in holm(tested).items():
        second[k]["p_holm"] = p
    out["secondary"] = second
    out["oracle"] = compare(table, "oracle", "clean", "param", dsets, "oracle")  # a reference, never tested
    return out


def main() -> None:
    results = {ds: read_jsonl(cache_dir(ds) / "results_test.jsonl") for ds in DATASETS
               if (cache_dir(ds) / "results_test.jsonl").exists()}
    out = analyse(results, cv_gains(cache_dir("controllers")))
    write_json(HERE / "cache" / "analysis.json", out)
    print(f"chosen: {out.get('chosen')}; primary: {out.get('primary')}")


if __name__ == "__main__":
    main()
