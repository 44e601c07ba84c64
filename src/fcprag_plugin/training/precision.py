"""Training precision: float32, or bfloat16 matmuls through ``torch.autocast``.

With ``precision="bf16"`` the trainer runs the controller's forward under ``torch.autocast("cpu", bfloat16)``:
the Linear layers multiply in bfloat16 while the master weights, AdamW and the gradients stay float32. The two MLPs
return float32 (``ScoreNet`` / ``CalibNet`` cast their outputs), so the gate, temperature, softmax, weights and loss
are computed in float32 (autocast leaves float32 inputs of those ops alone); rounding them to bfloat16 would make
the loss coarse and tie scores.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def autocast(precision: str) -> ContextManager:
    """The context the controller's forward runs in for a resolved ``precision`` (``"fp32"`` or ``"bf16"``)."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): then bf16 matmuls are several times
    faster than float32. Elsewhere oneDNN emulates them and float32 is the better choice."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set()
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.backends.mkldnn.is_available()


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> ``"bf16"`` on CPUs with native bfloat16, else ``"fp32"``; others pass through."""
    if precision == "auto":
        return "bf16" if native_bf16() else "fp32"
    return precision
