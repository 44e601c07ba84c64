"""Controller forward latency for one query (batch 1, N = 3 passages, precomputed embeddings).

The float32 controller is memory-bound: its score net streams 21 MB (d = 384) / 34 MB (d = 768) of weights per
call. The script times, side by side in one run, the float32 reference (``FusionController.forward``) and the
bfloat16 copy of ``for_inference``, for d = 384 and 768 and torch threads 1 and 2; variants are interleaved in
rounds so a change in the machine's load hits all of them alike. Reported: the median of many calls and the
ratio to float32, plus the machine's load average. There is no latency target: a few ms sit next to tens of ms of
sentence encoding and seconds of generation per query.

Two cache states:
  hot   calls back to back: the weights stay in the CPU caches (best case; what a tight loop sees);
  cold  a 64 MB buffer is streamed between calls (not timed), evicting the weights as a language model's
        forward pass would between two controller calls in a real pipeline.

    .venv/latest/bin/python benchmarks/bench_controller.py
    .venv/latest/bin/python benchmarks/bench_controller.py --dims 384 --threads 1 --calls 500 --json out.json
"""

from __future__ import annotations

import os

# as in bench_train.py: busy-waiting OpenMP threads are very slow on a CPU shared with other jobs
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fcprag_plugin.controller import ControllerConfig, FusionController

def _evict(buf: torch.Tensor) -> None:
    buf.add_(1.0)  # read + write 64 MB: larger than the last-level cache


def time_variants(models: dict[str, FusionController], e_q: torch.Tensor, E_p: torch.Tensor, calls: int,
                  rounds: int, cold: bool) -> dict[str, list[float]]:
    """Per-call seconds for each model, interleaved: ``rounds`` rounds of ``calls // rounds`` calls each."""
    buf = torch.zeros(16 * 1024 * 1024) if cold else None
    times: dict[str, list[float]] = {k: [] for k in models}
    per_round = max(1, calls // rounds)
    with torch.inference_mode():
        for m in models.values():  # warm-up: caches of converted weights, oneDNN primitives
            for _ in range(5):
                m(e_q, E_p)
        for _ in range(rounds):
            for name, m in models.items():
                for _ in range(per_round):
                    if buf is not None:
                        _evict(buf)
                    t0 = time.perf_counter()
                    m(e_q, E_p)
                    times[name].append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[384, 768], help="embedding sizes")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op thread counts")
    ap.add_argument("--n", type=int, default=3, help="passages per query")
    ap.add_argument("--calls", type=int, default=400, help="timed calls per variant and setting")
    ap.add_argument("--rounds", type=int, default=8, help="interleaving rounds")
    ap.add_argument("--cache", choices=["hot", "cold", "both"], default="both")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"(OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}); load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (other jobs on the CPU slow every figure below)")
    print(f"task: controller forward, batch 1, N = {a.n}, precomputed embeddings; median of {a.calls} calls per "
          f"variant, interleaved in {a.rounds} rounds")
    caches = ["hot", "cold"] if a.cache == "both" else [a.cache]
    prev_threads = torch.get_num_threads()
    results = []
    header = f"{'d':>4} {'thr':>3} {'cache':>5} | {'fp32 ms':>8} | {'bf16 ms':>8} {'x':>6}"
    print(header)
    print("-" * len(header))
    for d in a.dims:
        # a random (not uniform-initialised) controller: the weights differ per passage, as a trained one's do
        ref = FusionController(ControllerConfig(embed_dim=d, seed=0, init="random")).eval()
        models = {"fp32": ref, "bf16": ref.for_inference(torch.bfloat16)}
        g = torch.Generator().manual_seed(d)
        e_q = torch.nn.functional.normalize(torch.randn(1, d, generator=g), dim=-1)
        E_p = torch.nn.functional.normalize(torch.randn(1, a.n, d, generator=g), dim=-1)
        with torch.inference_mode():
            w_ref = ref(e_q, E_p).merge_weights
            dev = {k: float((m(e_q, E_p).merge_weights - w_ref).abs().max()) for k, m in models.items() if k != "fp32"}
        mb = sum(p.numel() for p in ref.parameters()) * 4 / 1e6
        for th in a.threads:
            torch.set_num_threads(th)
            for cache in caches:
                t = time_variants(models, e_q, E_p, a.calls, a.rounds, cache == "cold")
                med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
                row = {"dim": d, "threads": th, "cache": cache, "fp32_weights_mb": round(mb, 1),
                       "load_avg_1min": round(os.getloadavg()[0], 2),
                       **{f"{k}_ms": round(v, 4) for k, v in med.items()},
                       **{f"{k}_speedup": round(med["fp32"] / med[k], 2) for k in med if k != "fp32"},
                       **{f"{k}_max_abs_dw": v for k, v in dev.items()}}
                results.append(row)
                line = f"{d:>4} {th:>3} {cache:>5} | {med['fp32']:>8.3f} | {med['bf16']:>8.3f} " \
                       f"{med['fp32'] / med['bf16']:>5.2f}x"
                print(line, flush=True)
    torch.set_num_threads(prev_threads)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("accuracy on the timed query, max |w~ - w~_fp32|: "
          + ", ".join(f"d={r['dim']} {k[:-11]} {r[k]:.1e}" for r in results[:: len(a.threads) * len(caches)]
                      for k in r if k.endswith("_max_abs_dw")))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
