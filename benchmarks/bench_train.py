"""Training throughput: 10 epochs over 10,000 synthetic records with N = 3 and cached embeddings.

The script writes a synthetic label file, fills the embedding cache once (not timed), then times
``train_controller`` end to end with a warm cache (parsing, cache look-up, training, final metrics) for each requested precision, and prints seconds, CPU-seconds
and records/s, for comparing versions of the trainer side by side (no time target; bf16 runs through
``torch.autocast``: docs/results/bench_train.md). The timed runs
train exactly ``--epochs`` epochs (``cv_folds=0``); ``--cv-folds K`` times the trainer's default instead, whose
grouped K-fold cross-validation trains K more controllers before the final one (about K times the work).

    .venv/latest/bin/python benchmarks/bench_train.py                 # fp32 and bf16, d = 384 (all-MiniLM-L6-v2)
    .venv/latest/bin/python benchmarks/bench_train.py --precision bf16 --dim 768
"""

from __future__ import annotations

import os

# Must be set before torch loads OpenMP. On a CPU shared with other jobs, OpenMP's default busy-waiting makes two
# threads up to 10x slower than one (each waits, spinning, for a descheduled partner); passive waiting does not.
# An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import resource
import tempfile
import time
from pathlib import Path

import torch

from fcprag_plugin.training import train_controller
from fcprag_plugin.training.precision import resolve_precision
from fcprag_tools.synthetic import synthetic_records, table_encoder, write_labels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--n", type=int, default=3, help="passages per record")
    ap.add_argument("--dim", type=int, default=384, help="embedding size (384: all-MiniLM-L6-v2, 768: bge-base)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--cv-folds", type=int, default=0, help="the trainer's cross-validation folds (0: off)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    precisions = ["fp32", "bf16"] if a.precision == "both" else [a.precision]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads (OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}), "
          f"load average {os.getloadavg()[0]:.2f} "
          "(other jobs on the CPU slow every figure below)")
    print(f"the trainer's default precision 'auto' is {resolve_precision('auto')} on this CPU")
    print(f"task: {a.epochs} epochs x {a.records} records, N = {a.n}, d = {a.dim}, batch {a.batch_size}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, table = synthetic_records(a.records, a.n, a.dim, seed=0)
        write_labels(train, tmp / "train.jsonl")
        calls: list = []
        enc = table_encoder(table, f"synthetic-{a.dim}", calls)
        cache = tmp / "cache"
        # warm the cache (not timed): one epoch-less pass that embeds every text
        t0 = time.perf_counter()
        train_controller(tmp / "train.jsonl", tmp / "warm", encoder=enc, cache_dir=cache,
                         epochs=1, progress=False, controller={"score_hidden": [8], "calib_hidden": 8}, cv_folds=0)
        encoded = sum(len(c) for c in calls)
        print(f"cache warm-up: embedded {encoded} texts in {time.perf_counter() - t0:.1f} s (not timed)")

        for prec in precisions:
            calls.clear()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0 = time.process_time()
            t0 = time.perf_counter()
            res = train_controller(tmp / "train.jsonl", tmp / f"run-{prec}", encoder=enc,
                                   cache_dir=cache, epochs=a.epochs, batch_size=a.batch_size, precision=prec,
                                   progress=False, cv_folds=a.cv_folds)
            dt = time.perf_counter() - t0
            cpu = time.process_time() - c0  # CPU seconds of this process: robust to other jobs on a shared machine
            # minor page faults: fresh large allocations every step (e.g. 12 MB gradients) cost thousands per step
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            re_encoded = sum(len(c) for c in calls)
            rps = a.epochs * a.records / dt
            r = {"precision": prec, "seconds": round(dt, 2), "cpu_seconds": round(cpu, 2), "records_per_s": round(rps, 1),
                 "fit_s": res.metrics["timing_s"]["fit"], "data_s": res.metrics["timing_s"]["data"],
                 "re_encoded_texts": re_encoded, "minor_page_faults": faults, "train_kl": res.metrics["train"]["learned"]["kl"],
                 "train_kl_uniform": res.metrics["train"]["uniform"]["kl"],
                 "train_top1": res.metrics["train"]["learned"]["top1"]}
            results.append(r)
            print(f"[{prec}] {dt:.1f} s total (data {r['data_s']:.1f} s, fit {r['fit_s']:.1f} s; {cpu:.1f} CPU-s; "
                  f"{faults / 1e3:.0f}k page faults), "
                  f"{rps:.0f} records/s; re-encoded texts: {re_encoded}; "
                  f"KL on the training records {r['train_kl']:.4f} (uniform {r['train_kl_uniform']:.4f}), top-1 "
                  f"{r['train_top1']:.3f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if len(results) == 2:
        print(f"fp32 / bf16 time ratio: {results[0]['seconds'] / results[1]['seconds']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
