"""Merge weights: the one check every merge applies, and strict-JSON helpers for logging them."""

from __future__ import annotations

import math
from array import array
from typing import Any

import torch

from .errors import MergeError


def check_weights(weights: Any, n: int) -> list[float]:
    """Validated merge weights ``w~``: finite, 1-D, one per adapter (``n >= 1``), as float32-rounded Python floats
    (the values a float32 merge computes with). ``None`` is ``[1] * n`` (PRAG's uniform merge). Lists and tuples
    skip tensor ops (the per-query hot path); tensors and arrays are accepted too."""
    if n == 0:
        raise MergeError("no adapters to merge (N == 0)")
    if weights is None:
        return [1.0] * n
    vals: list[float] | None = None
    if isinstance(weights, (list, tuple)):
        try:
            vals = array("f", [float(v) for v in weights]).tolist()  # rounds to float32 like torch does
        except (TypeError, ValueError, OverflowError):
            vals = None
    if vals is None or len(vals) != n:
        w = torch.as_tensor(weights, dtype=torch.float32).detach().cpu()
        if w.ndim != 1 or w.shape[0] != n:
            raise MergeError(f"merge weights have shape {list(w.shape)}, expected [{n}] (one per adapter)")
        vals = w.tolist()
    if not all(map(math.isfinite, vals)):
        raise MergeError(f"merge weights must be finite, got {vals}")
    return vals


def finite_or_none(obj: Any) -> Any:
    """NaN / inf -> None, recursively through dicts, lists and tuples, so a record is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj
