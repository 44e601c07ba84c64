"""Shared by the timing scripts: ``--device`` / ``--dtype`` options and timers that synchronise CUDA around every
timed call (a CUDA call returns before the GPU has finished; without a sync a timer measures the launch)."""

from __future__ import annotations

import gc
import platform
import statistics
import time
from typing import Any, Callable

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def add_device_args(parser: Any, dtype: str = "float32") -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--dtype", default=dtype, choices=sorted(DTYPES), help=f"model dtype (default {dtype})")


def device_of(args: Any) -> torch.device:
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA GPU")
    return dev


def dtype_of(args: Any) -> torch.dtype:
    return DTYPES[args.dtype]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU's queued work (no-op on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | str | None = None) -> float:
    """Seconds of one call of ``fn``, synchronised before and after on a CUDA ``device``."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "repeats": len(times)}


def timeit(fn: Callable[[], Any], repeats: int, warmup: int = 1, device: Any = None) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    gc.collect()
    return summary([timed(fn, device) for _ in range(repeats)])


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1, device: Any = None
                ) -> dict[str, dict[str, float]]:
    """Each function once per round, in turn (side by side: drifts of the machine hit all of them alike)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    gc.collect()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(timed(fn, device))
    return {k: summary(v) for k, v in times.items()}


def env(device: torch.device, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What the figures were measured on."""
    from fcprag_plugin.compat import package_version

    out: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                           "transformers": str(package_version("transformers")), "peft": str(package_version("peft")),
                           "python": platform.python_version(), "threads": torch.get_num_threads()}
    if dtype is not None:
        out["dtype"] = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    else:
        out["cpu"] = platform.processor() or platform.machine()
        try:
            import os

            out["load_avg"] = os.getloadavg()
        except OSError:
            pass
    return out
