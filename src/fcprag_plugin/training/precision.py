"""Mixed precision for the controller's two MLPs only.

Autocasting the whole forward would also round the gate, the temperature and the weights to bfloat16 (3 digits),
which makes the KL loss coarse and ties scores. Only ``score_net`` and ``calib_net`` (nearly all the FLOPs) run
in bfloat16; their outputs come back as float32 and everything after them stays float32. The master weights and
the optimizer stay float32. The patch is an instance attribute, so the state dict (and saved files) are unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..controller import FusionController

_NETS = ("score_net", "calib_net")


def _bf16_forward(module: torch.nn.Module):
    inner = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = inner(x)
        return out.float()

    return forward


@contextlib.contextmanager
def mixed_precision(controller: FusionController, dtype: torch.dtype | None) -> Iterator[FusionController]:
    """Within the block, the controller's MLPs run in ``dtype`` (only ``torch.bfloat16``; None: no change)."""
    if dtype is None:
        yield controller
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"mixed precision supports torch.bfloat16 only, got {dtype}")
    patched = []
    try:
        for name in _NETS:
            mod = getattr(controller, name)
            mod.forward = _bf16_forward(mod)
            patched.append(mod)
        yield controller
    finally:
        for mod in patched:
            del mod.forward


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
