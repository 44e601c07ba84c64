"""Stage 5: train one controller per label metric with ``fcprag train`` -> ``work/<dataset>/controllers/<metric>/``.

Default training settings of the library (10 epochs, AdamW 1e-4, batch 32, T_label 0.1, seeded validation split
by group), the packaged offline embedding model (all-MiniLM-L6-v2; the default BAAI/bge-base-en-v1.5 is not
available offline). Each run's ``metrics.json`` (validation KL and weight on the best passage next to the
uniform and random baselines) is copied to ``cache/<dataset>/train_<metric>_metrics.json``. Extra runs with
other settings (``--tag``, ``--epochs``) are kept side by side and all are listed in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from common import cache_dir, setup_logging, timed, work_dir

METRICS = ("answer_logprob", "f1")


def run(dataset: str, metrics: list[str], epochs: int | None, tag: str, threads: int) -> None:
    fcprag = os.path.join(os.path.dirname(sys.executable), "fcprag")
    for metric in metrics:
        labels = cache_dir(dataset) / f"labels_train_{metric}.jsonl"
        if not labels.is_file():
            raise SystemExit(f"{labels}: not found; run labels_stage.py first")
        name = metric + (f"-{tag}" if tag else "")
        out = work_dir(dataset) / "controllers" / name
        cmd = [fcprag, "train", str(labels), "--out", str(out), "--overwrite", "--seed", "0", "--threads", str(threads),
               "--cache-dir", str(work_dir(dataset) / "embeddings"), "--plots", "--no-progress"]
        if epochs is not None:
            cmd += ["--epochs", str(epochs)]
        with timed(dataset, f"train:{name}", command=" ".join(os.path.relpath(c) if os.path.isabs(c) else c
                                                               for c in cmd)):
            subprocess.run(cmd, check=True)
        metrics_obj = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
        args_obj = json.loads((out / "training_args.json").read_text(encoding="utf-8"))
        (cache_dir(dataset) / f"train_{name}_metrics.json").write_text(
            json.dumps({"metrics": metrics_obj, "training_args": args_obj}, indent=2) + "\n", encoding="utf-8")
        plots = out / "plots"
        if plots.is_dir():
            dst = cache_dir(dataset) / f"train_{name}_plots"
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(plots, dst)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--metric", action="append", choices=METRICS, help="default: both")
    p.add_argument("--epochs", type=int, default=None, help="default: the library's (10)")
    p.add_argument("--tag", default="", help="name suffix for a run with other settings")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    setup_logging()
    run(a.dataset, a.metric or list(METRICS), a.epochs, a.tag, a.threads)


if __name__ == "__main__":
    main()
