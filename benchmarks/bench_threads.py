"""``fcprag study``'s CPU work at 1 and at 2 (``--threads``) torch threads, side by side in one run.

On a SmolLM2-135M-shaped Llama with random weights (``bench_study.make_model``; the same arithmetic as the real
model, nothing to download), the three kinds of work a CPU study spends its time on, each timed at every thread
count in turn, round after round, so that each count meets the same load from other jobs:

- augmentation: ``--aug-batch`` passages (two prompts of ``--prompt-tokens`` each) answered by greedy generation of
  ``--new-tokens`` tokens in one ``batched_greedy`` (the study's augmentation);
- adapters: ``--stack`` PRAG-recipe adapters trained stacked (``train_stacked``, 4 samples of ``--prompt-tokens``);
- scoring: one forward of ``--batch`` sequences of ``--prompt-tokens`` tokens (labels and evaluation).

Prints per kind and thread count the median wall seconds and the process's CPU seconds per unit, the ratio of each
count's wall time to 1 thread's, and the 1-minute load average before and after (what the study's default reads:
``study/preflight.auto_threads``).

Usage::

    python benchmarks/bench_threads.py [--threads 1 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_study import Tok, make_model  # noqa: E402


def work(model: Any, a: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    from fcprag_tools.lm.batched import batched_greedy
    from fcprag_tools.study import adapters as ad

    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(3, V, (n,), generator=g).tolist()

    prompts = [ids(a.prompt_tokens) for _ in range(2 * a.aug_batch)]
    data = [{k: (s, s) for k in ("passage", "rewrite", "qa0", "qa1") for s in [ids(a.prompt_tokens)]}
            for _ in range(a.stack)]
    batch = torch.tensor([ids(a.prompt_tokens) for _ in range(a.batch)])
    tok = Tok()

    def score() -> None:
        with torch.no_grad():
            model(input_ids=batch)

    return {"augmentation": lambda: batched_greedy(model, tok, prompts, a.new_tokens),
            "adapters": lambda: ad.train_stacked(model, tok, data, list(range(a.stack))),
            "scoring": score}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--aug-batch", type=int, default=2, help="passages per generate (the study's CPU default is 8)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=160)
    p.add_argument("--stack", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    load0 = os.getloadavg()[0]
    model = make_model("smollm2", None, torch.device("cpu"), torch.float32)
    kinds = work(model, a)
    for fn in kinds.values():  # warm-up
        fn()
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(a.rounds):
        for name, fn in kinds.items():
            for n in a.threads:
                torch.set_num_threads(n)
                w0, c0 = time.perf_counter(), time.process_time()
                fn()
                times.setdefault((name, n), []).append((time.perf_counter() - w0, time.process_time() - c0))
    print(f"{os.cpu_count()} cores; load average (1 min) {load0:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"{a.rounds} rounds; torch {torch.__version__}")
    print(f"{'work':<13} {'threads':>7} {'wall s (median)':>16} {'CPU s':>7} {'wall / 1 thread':>16}")
    for name in kinds:
        base = statistics.median(w for w, _ in times[(name, a.threads[0])])
        for n in a.threads:
            wall = statistics.median(w for w, _ in times[(name, n)])
            cpu = statistics.median(c for _, c in times[(name, n)])
            print(f"{name:<13} {n:>7} {wall:>16.2f} {cpu:>7.2f} {wall / base:>16.2f}")


if __name__ == "__main__":
    main()
