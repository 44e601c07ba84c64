"""Stage 4: leave-one-out labels on the train split with ``fcprag labels build``.

Writes the manifest ``cache/<dataset>/manifest_train.jsonl`` (adapters under ``work/``), runs
``fcprag labels build`` once (``param`` prompt, bf16, greedy answers of up to 16 tokens, label metric
``answer_logprob``; F1 and EM are recorded in the same records as extra fields), and derives the F1 label file
from the same records (``metric_all``/``metric_without`` replaced by ``f1_all``/``f1_without``), so both label
files come from one evaluation of each subset:

- ``cache/<dataset>/labels_train_answer_logprob.jsonl``
- ``cache/<dataset>/labels_train_f1.jsonl``

No ``split`` field is written, so ``fcprag train`` makes its own seeded validation split by ``group``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from common import GGUF_FILE, cache_dir, read_jsonl, setup_logging, smollm2_dir, timed, work_dir, write_jsonl


def write_manifest(dataset: str, split: str) -> str:
    rows = [r for r in read_jsonl(cache_dir(dataset) / "retrieval.jsonl") if r["split"] == split]
    root = work_dir(dataset) / "adapters"
    base = cache_dir(dataset)
    out = []
    for r in rows:
        out.append({"id": r["id"], "question": r["question"], "answer": r["answer"], "group": r["id"],
                    "passages": [p["text"] for p in r["passages"]],
                    "adapters": [os.path.relpath(root / p["pid"], base) for p in r["passages"]],
                    "supporting": [p["supporting"] for p in r["passages"]]})
    path = base / f"manifest_{split}.jsonl"
    write_jsonl(path, out)
    return str(path)


def derive(src: str, dst: str, metric: str) -> None:
    rows = []
    for r in read_jsonl(src):
        r = dict(r)
        r["metric"], r["metric_all"], r["metric_without"] = metric, r[f"{metric}_all"], r[f"{metric}_without"]
        r.pop("deltas", None)
        rows.append(r)
    write_jsonl(dst, rows)


def run(dataset: str, threads: int, max_new_tokens: int) -> None:
    manifest = write_manifest(dataset, "train")
    base = cache_dir(dataset)
    out = base / "labels_train_answer_logprob.jsonl"
    fcprag = os.path.join(os.path.dirname(sys.executable), "fcprag")
    cmd = [fcprag, "labels", "build", manifest, "--model", smollm2_dir(), "--gguf-file", GGUF_FILE,
           "--dtype", "bfloat16", "--prompt-mode", "param", "--metric", "answer_logprob",
           "--max-new-tokens", str(max_new_tokens), "--empty-generation", "zero", "--use-slot",
           "--threads", str(threads), "--out", str(out)]
    with timed(dataset, "labels", command=" ".join(os.path.relpath(c) if os.path.isabs(c) else c for c in cmd)):
        subprocess.run(cmd, check=True)
    derive(str(out), str(base / "labels_train_f1.jsonl"), "f1")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    a = p.parse_args(argv)
    setup_logging()
    run(a.dataset, a.threads, a.max_new_tokens)


if __name__ == "__main__":
    main()
