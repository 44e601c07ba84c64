"""What a default training run saves without the per-query scale: the same labels and seed trained with the
library's defaults by the code before its removal (where it was on by default) and by this checkout, one run each,
side by side in one script. No model runs: the labels are the committed efficacy caches' (SmolLM2-135M, measured).

    git archive 0b6a7d3 src | tar -x -C /tmp/before          # the last commit with the per-query scale
    python benchmarks/bench_default_train.py /tmp/before/src OUT [--all]

The labels, from ``benchmarks/efficacy/cache/<dataset>/labels_train.jsonl.gz``: ``top3``, the first study's 126
training questions' top-3 records with the gold log-lik. at every scale of ``scales_train.jsonl.gz`` (one record
per question, as ``fcprag labels build --scales`` writes them); with ``--all`` also ``all``, the 2,520 records of
those questions (the scales on the top-3 ones: the same per-query scale work, 20 times the network's; about half
an hour a side on a busy 2-core VM). Each side runs ``train_controller(labels, out)`` with nothing but
``progress=False`` and a shared, warm embedding cache, in its own process; printed: the cross-validation's and the
whole run's seconds (wall time, as the run measures them), the process's CPU seconds, and what ships.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

CACHE = Path(__file__).resolve().parent / "efficacy" / "cache"
HERE = Path(__file__).resolve().parents[1] / "src"
CHILD = """
import json, sys
from fcprag_plugin.training import train_controller
labels, out, emb = sys.argv[1:4]
res = train_controller(labels, out, progress=False, cache_dir=emb, overwrite=True, **json.loads(sys.argv[4]))
cv = res.metrics.get("cv") or {}
print(json.dumps({"cv_s": cv.get("seconds"), "total_s": res.metrics["timing_s"]["total"], "shipped": cv.get("shipped"),
                  "kappa": res.metrics["kappa"], "epochs": res.metrics["epochs"]}))
"""


def label_files(out: Path) -> dict[str, Path]:
    """``top3`` and ``all`` (module docstring), written into ``out``."""
    import gzip

    rows: dict[str, list[dict]] = {"top3": [], "all": []}
    for ds in ("hotpotqa", "2wiki"):
        at: dict[str, dict[str, float]] = {}
        with gzip.open(CACHE / ds / "scales_train.jsonl.gz", "rt", encoding="utf-8") as f:
            for r in map(json.loads, f):
                at.setdefault(r["key"].split("|")[1], {})[r["name"]] = r["logprob"]
        with gzip.open(CACHE / ds / "labels_train.jsonl.gz", "rt", encoding="utf-8") as f:
            for rec in map(json.loads, f):
                qid = rec["id"].split(":")[1]
                if rec["id"].endswith(":s:012") and qid in at:
                    grid = sorted(float(k.split(":")[1]) for k in at[qid])
                    rec["scales"] = grid
                    rec["metric_at_scales"] = [rec["metric_all"] + at[qid][f"scale:{s:g}"] - at[qid]["scale:1"]
                                               for s in grid]
                    rows["top3"].append(rec)
                rows["all"].append(rec)
    paths = {}
    for name, recs in rows.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return paths


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train(src: Path, labels: Path, out: Path, emb: Path, **kwargs) -> dict:
    """One run in its own process with ``src`` first on the path: what ``CHILD`` prints, and its CPU seconds."""
    env, cpu = {**os.environ, "PYTHONPATH": str(src)}, _cpu()
    got = subprocess.run([sys.executable, "-c", CHILD, str(labels), str(out), str(emb), json.dumps(kwargs)],
                         env=env, check=True, capture_output=True, text=True)
    return {**json.loads(got.stdout.strip().splitlines()[-1]), "cpu_s": _cpu() - cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path, help="the src/ folder of the code before (with the per-query scale)")
    p.add_argument("out", type=Path, help="a folder for the label files, the runs and the embedding cache")
    p.add_argument("--after", type=Path, default=HERE, help="the src/ folder of the code after (default: this one)")
    p.add_argument("--all", action="store_true", help="also the 2,520 records of the same questions (long)")
    a = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each line as it comes, also into a file
    a.out.mkdir(parents=True, exist_ok=True)
    files, emb = label_files(a.out), a.out / "emb"
    files = {k: v for k, v in files.items() if a.all or k == "top3"}
    train(a.after, files.get("all", files["top3"]), a.out / "warm", emb, epochs=1, cv_folds=0)  # texts embedded once
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'labels':8} {'side':7} {'CV s':>8} {'total s':>8} {'CPU s':>8}  ships")
    for name, path in files.items():
        got = {side: train(src, path, a.out / f"{name}-{side}", emb) for side, src in (("before", a.before),
                                                                                       ("after", a.after))}
        for side, r in got.items():
            print(f"{name:8} {side:7} {r['cv_s']:8.1f} {r['total_s']:8.1f} {r['cpu_s']:8.1f}  {r['shipped']} at kappa "
                  f"{r['kappa']:g}, {r['epochs']} epochs")
        b, n = got["before"], got["after"]
        print(f"{name:8} {'saved':7} {b['cv_s'] - n['cv_s']:8.1f} {b['total_s'] - n['total_s']:8.1f} "
              f"{b['cpu_s'] - n['cpu_s']:8.1f}  "
              f"(after/before: {n['total_s'] / b['total_s']:.2f} of the run)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
