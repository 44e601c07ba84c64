"""Training precision: float32, or ``"bf16"``: the controller's Linear layers multiply in bfloat16 under
``torch.autocast``; weights, AdamW, gradients and everything after the two MLPs stay float32."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def autocast(precision: str) -> ContextManager:
    """The context the controller's forward runs in for a resolved ``precision`` (``"fp32"`` or ``"bf16"``)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision is {precision!r}, expected 'fp32' or 'bf16' (resolved: resolve_precision)")
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere float32 is faster."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.backends.mkldnn.is_available()


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> ``"bf16"`` on CPUs with native bfloat16, else ``"fp32"``; others pass through."""
    if precision == "auto":
        return "bf16" if native_bf16() else "fp32"
    return precision
