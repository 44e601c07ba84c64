"""Run every stage of the efficacy study in order (each stage skips what its cache already holds).

    python benchmarks/efficacy/run_all.py --dataset hotpotqa

Stages: retrieve -> augment -> adapters -> labels -> train -> grid -> evaluate -> report. With the committed
caches, only the stages whose outputs are missing do work: ``adapters`` (not committed: ~1 GB) and the
controllers are rebuilt, the rest is read back. ``--from-scratch`` moves the dataset's cache aside first.
"""

from __future__ import annotations

import argparse
import shutil
import time

import adapters
import augment
import evaluate
import grid
import labels_stage
import report
import retrieve
import train_stage
from common import cache_dir, setup_logging, work_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--test", type=int, default=50)
    p.add_argument("--from-scratch", action="store_true", help="move cache/<dataset> aside and start over")
    a = p.parse_args(argv)
    setup_logging()
    if a.from_scratch:
        old = cache_dir(a.dataset)
        shutil.move(str(old), f"{old}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    d = cache_dir(a.dataset)
    if not (d / "retrieval.jsonl").exists():
        retrieve.run(a.dataset, a.questions, a.test, 3)
    augment.run(a.dataset, 16, 128, 150, None)
    adapters.run(a.dataset, 16, 1, 128, None)
    if not (d / "labels_train_f1.jsonl").exists():
        labels_stage.run(a.dataset, 2, 16)
    if not all((work_dir(a.dataset) / "controllers" / m / "config.json").exists() for m in train_stage.METRICS):
        train_stage.run(a.dataset, list(train_stage.METRICS), None, "", 2)
    if not (d / "grid.json").exists():
        grid.run(a.dataset, None)
    evaluate.run(a.dataset, None)
    report.run([a.dataset])


if __name__ == "__main__":
    main()
