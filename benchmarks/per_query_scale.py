"""Per-query scale and the out-of-sample risk rule on the committed efficacy caches (no model is run).

    PYTHONPATH=src python benchmarks/per_query_scale.py OUT_DIR [--reuse]   # --reuse: keep finished trainings

Builds two label files from ``benchmarks/efficacy/cache`` (every number in them was measured by real forwards of
SmolLM2-135M on PRAG-recipe adapters, BM25 top-3):

- ``train126.jsonl``: the first study's 126 training questions (59 HotpotQA, 67 2Wiki), the top-3 record with its
  leave-one-out deltas and the gold log-lik. at every scale of the grid (``cache/<ds>/scales_train.jsonl.gz``, as
  ``scales.py attach`` adds them);
- ``fresh196.jsonl``: the 196 fresh questions (151 HotpotQA, 45 2Wiki), from ``cache/fresh/<ds>/eval.jsonl.gz``:
  ``prag_sum``, ``loo:i`` and ``scale:s`` rows, gold log-lik. and F1 at every scale (answer-level scale labels).

Then runs ``train_controller`` (the default recipe: kappa on measured scales, the per-query scale measured in the
nested CV) on each (log-lik.; F1 too for the fresh file), and one out-of-sample check: the per-query head and the
global kappa chosen on train126, scored on fresh196. Prints each verdict and writes ``OUT_DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_records
from fcprag_plugin.training import load_labels, train_controller
from fcprag_plugin.training import query_scale as qs
from fcprag_plugin.training.data import build_tensors
from fcprag_plugin.training.selection import ScaleRule, choose_scale, scale_gain
from fcprag_plugin.training.stats import bootstrap_ci, loss_share
from fcprag_plugin.training.trainer import open_cache, resolve_encoder
from fcprag_tools.train_report import train_table

CACHE = Path(__file__).resolve().parent / "efficacy" / "cache"
DATASETS = ("hotpotqa", "2wiki")


def _jsonl(path: Path) -> list[dict]:
    return [r for _, r in read_records(path, FcpragError)]


def train126(out: Path) -> Path:
    rows = []
    for ds in DATASETS:
        m: dict[str, dict[str, float]] = {}
        for r in _jsonl(CACHE / ds / "scales_train.jsonl.gz"):
            m.setdefault(r["key"].split("|")[1], {})[r["name"]] = r["logprob"]
        for rec in _jsonl(CACHE / ds / "labels_train.jsonl.gz"):
            qid = rec["id"].split(":")[1]
            if not rec["id"].endswith(":s:012") or qid not in m:
                continue
            grid = sorted(float(k.split(":")[1]) for k in m[qid])
            rec["scales"] = grid
            rec["metric_at_scales"] = [rec["metric_all"] + m[qid][f"scale:{s:g}"] - m[qid]["scale:1"] for s in grid]
            rec.pop("deltas")  # metric_all - metric_without, given once
            rec["dataset"] = ds
            rows.append(rec)
    path = out / "train126.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def fresh196(out: Path) -> Path:
    rows = []
    for ds in DATASETS:
        text = {p["pid"]: p["text"] for r in _jsonl(CACHE / "fresh" / ds / "retrieval.jsonl.gz") for p in r["passages"]}
        question = {r["id"]: r for r in _jsonl(CACHE / "fresh" / ds / "retrieval.jsonl.gz")}
        by_key: dict[str, dict[str, dict]] = {}
        for r in _jsonl(CACHE / "fresh" / ds / "eval.jsonl.gz"):
            by_key.setdefault(r["key"], {})[r["name"]] = r
        for key, m in by_key.items():
            qid = key.split("|")[1]
            base = m["prag_sum"]
            grid = sorted([1.0] + [float(k.split(":")[1]) for k in m if k.startswith("scale:")])
            at = [base if s == 1.0 else m[f"scale:{s:g}"] for s in grid]
            n = len(base["pids"])
            rows.append({"id": f"{ds}:{qid}", "query": question[qid]["question"],
                         "passages": [text[p] for p in base["pids"]], "group": f"{ds}:{qid}", "dataset": ds,
                         "metric": "answer_logprob", "metric_all": base["logprob"],
                         "metric_without": [m[f"loo:{i}"]["logprob"] for i in range(n)], "scales": grid,
                         "metric_at_scales": [r["logprob"] for r in at], "f1_all": base["f1"],
                         "f1_at_scales": [r["f1"] for r in at]})
    path = out / "fresh196.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _cv_summary(cv: dict) -> dict:
    q = cv.get("query_scale") or {}
    return {"kappa": cv["kappa"], "shipped": cv["shipped"], "scale": {k: cv["scale"][k] for k in (
        "gain", "ci95", "ci_adjusted", "shown", "fold_kappas", "held_out_loss_share", "by_metric")},
        "grid": cv["scale"]["grid"], "reweighting_first_order": {k: cv["reweighting"][k] for k in ("gain", "ci95")},
        "query_scale": {k: q.get(k) for k in ("gain", "ci95", "ci_adjusted", "shown", "keeps_rule", "vs_sum",
                                              "held_out_loss_share", "folds")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for the label files, trainings and summary.json")
    p.add_argument("--reuse", action="store_true", help="keep finished trainings (their verdicts as they were)")
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    files = {"train126": train126(out), "fresh196": fresh196(out)}
    common = dict(progress=False, threads=1, overwrite=True, cache_dir=str(out / "emb"), val_fraction=0.0,
                  controller={"score_hidden": [256], "calib_hidden": 64})
    summary: dict = {}
    name_, enc = resolve_encoder(None)
    enc = enc()
    cache = open_cache(str(out / "emb"), name_, enc.dim)
    for name, metric in (("train126", "label"), ("fresh196", "label"), ("fresh196", "f1")):
        done = out / f"{name}-{metric}" / "metrics.json"
        if done.is_file() and args.reuse:  # a finished run of this script: its verdict as it was
            cv = json.loads(done.read_text(encoding="utf-8"))["cv"]
        else:
            res = train_controller(files[name], out / f"{name}-{metric}", scale_metric=metric, **common)
            verdict = train_table(res.metrics).split("\n\n")[-1]
            print(f"\n===== {name}, kappa chosen on {metric} =====\n{verdict}")
            cv = res.metrics["cv"]
        summary[f"{name}:{metric}"] = _cv_summary(cv)
        for ds in DATASETS:  # per dataset: the grid's mean gain (descriptive)
            recs = [r for r in load_labels(files[name]).records if r.extra.get("dataset") == ds]
            data = build_tensors(recs, enc, cache)
            k, grid = choose_scale(data.scales, data.gains(metric), data.groups, ScaleRule())
            summary[f"{name}:{metric}"][f"grid_{ds}"] = {"kappa_by_rule": k, **grid}
    # out of sample: head and kappa chosen on train126, scored on fresh196 (gold log-lik.)
    tr, te = (build_tensors(load_labels(files[n]).records, enc, cache) for n in ("train126", "fresh196"))
    rule = ScaleRule()
    kappa, _ = choose_scale(tr.scales, tr.scale_gains, tr.groups, rule)
    head, info = qs.fit_query_scale(tr, "label", kappa, rule, seed=0)
    chosen = qs.choose(head, te)
    g_q = scale_gain(te, chosen)[0]
    g_k = scale_gain(te, torch.full((len(te),), kappa, dtype=torch.float64))[0]
    ds = [g.split(":")[1] for g in te.groups]  # group keys read "group:<dataset>:<id>"
    oos = {"kappa_train126": kappa, "head": {k: info[k] for k in ("grid", "rho", "l2")},
           "per_query_minus_global": {"gain": float((g_q - g_k).mean()),
                                      "ci95": list(bootstrap_ci(g_q - g_k, te.groups, 0))},
           "global_vs_sum": {"gain": float(g_k.mean()), "ci95": list(bootstrap_ci(g_k, te.groups, 0)),
                             "loss_share": loss_share(g_k, te.groups, rule.loss_margin)},
           "per_query_vs_sum": {"gain": float(g_q.mean()), "ci95": list(bootstrap_ci(g_q, te.groups, 0)),
                                "loss_share": loss_share(g_q, te.groups, rule.loss_margin)},
           "chosen_by_dataset": {d: {repr(s): sum(1 for c, x in zip(chosen.tolist(), ds) if x == d and c == s)
                                     for s in info["grid"]} for d in DATASETS}}
    # the risk rule out of sample: kappa chosen on train126 by each bound, its loss share on fresh196
    for bound in ("upper", "observed"):
        k, _ = choose_scale(tr.scales, tr.scale_gains, tr.groups, ScaleRule(bound=bound))
        g = scale_gain(te, torch.full((len(te),), k, dtype=torch.float64))[0]
        oos[f"rule_{bound}"] = {"kappa_train126": k, "gain_fresh196": float(g.mean()),
                                "ci95": list(bootstrap_ci(g, te.groups, 0)),
                                "loss_share_fresh196": loss_share(g, te.groups, rule.loss_margin)}
    summary["out_of_sample_train126_to_fresh196"] = oos
    print("\n===== out of sample: chosen on train126, scored on fresh196 (gold log-lik.) =====")
    print(json.dumps(oos, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
