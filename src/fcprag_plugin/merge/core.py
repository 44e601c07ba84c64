"""Merge registry, input validation (:func:`check_weights`, the one check of ``w~`` every merge applies) and the
``WeightedAdapterMerger`` front end."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..adapter import LoraAdapter
from ..errors import MergeError


def check_weights(weights: Any, n: int) -> tuple[float, ...]:
    """Validated merge weights ``w~``: finite, 1-D, one per adapter (``n >= 1``), as a tuple of float32-rounded
    Python floats; ``None`` is ``[1] * n``. Lists and tuples skip tensor ops (the hot path); tensors work too."""
    if n == 0:
        raise MergeError("no adapters to merge (N == 0)")
    if weights is None:
        return (1.0,) * n
    try:  # rounds to float32 like torch does
        vals = array("f", [float(v) for v in weights]).tolist() if isinstance(weights, (list, tuple)) else None
    except (TypeError, ValueError, OverflowError):
        vals = None
    if vals is None or len(vals) != n:
        w = torch.as_tensor(weights, dtype=torch.float32).detach().cpu()
        if w.ndim != 1 or w.shape[0] != n:
            raise MergeError(f"merge weights have shape {list(w.shape)}, expected [{n}] (one per adapter)")
        vals = w.tolist()
    if not all(map(math.isfinite, vals)):
        raise MergeError(f"merge weights must be finite, got {vals}")
    return tuple(vals)


MergeFn = Callable[..., "MergeResult"]
MERGE_MODES: dict[str, MergeFn] = {}


@dataclass
class MergeResult:
    """The merged adapter, its ``merge_weights`` (``w~``), ``mode`` and ``info`` (mode-specific, e.g. svd errors)."""

    adapter: LoraAdapter
    merge_weights: tuple[float, ...]
    mode: str
    info: dict[str, Any] = field(default_factory=dict)


def register_merge_mode(name: str) -> Callable[[MergeFn], MergeFn]:
    """Register ``fn(adapters, merge_weights, **options) -> MergeResult`` (validated ``w~``) under ``name``."""

    def deco(fn: MergeFn) -> MergeFn:
        MERGE_MODES[name] = fn
        return fn

    return deco


def get_merge_mode(name: str) -> MergeFn:
    try:
        return MERGE_MODES[name]
    except KeyError:
        raise MergeError(f"unknown merge mode '{name}'; expected one of {sorted(MERGE_MODES)}") from None


def check_compatible(adapters: Sequence[LoraAdapter]) -> list[str]:
    """All adapters must target the same modules with the same in/out shapes. Returns the module names."""
    if not adapters:
        raise MergeError("no adapters to merge (N == 0)")
    ref = adapters[0]
    names = ref.target_modules
    for i, ad in enumerate(adapters[1:], start=1):
        if set(ad.modules) != set(ref.modules):
            missing, extra = sorted(set(ref.modules) - set(ad.modules)), sorted(set(ad.modules) - set(ref.modules))
            raise MergeError(f"adapter {i} ({ad.source}) and adapter 0 ({ref.source}) target different modules: "
                             f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                             f"extra {extra[:3]}{'...' if len(extra) > 3 else ''}")
        for name in names:
            a, b = ref.modules[name], ad.modules[name]
            if (a.in_features, a.out_features) != (b.in_features, b.out_features):
                raise MergeError(f"module '{name}': adapter {i} ({ad.source}) has [out, in] = "
                                 f"[{b.out_features}, {b.in_features}] but adapter 0 ({ref.source}) has "
                                 f"[{a.out_features}, {a.in_features}]")
    return names


def merge_adapters(adapters: Sequence[LoraAdapter], merge_weights: Any, mode: str = "cat", **options: Any
                   ) -> MergeResult:
    """Merge ``adapters`` with merge weights ``w~`` (length N) using ``mode``; see the package docstring."""
    fn = get_merge_mode(mode)
    adapters = list(adapters)
    w = check_weights(merge_weights, len(adapters))
    check_compatible(adapters)
    return fn(adapters, w, **options)


class WeightedAdapterMerger:
    """Merge N adapters with weights ``w~`` (length N) in registered merge ``mode``:
    ``WeightedAdapterMerger("cat").merge([a0, a1, a2], [1.12, 0.89, 0.99]).adapter``."""

    def __init__(self, mode: str = "cat", **options: Any) -> None:
        get_merge_mode(mode)  # fail early on a typo
        self.mode, self.options = mode, options

    def merge(self, adapters: Sequence[LoraAdapter], merge_weights: Any | None = None) -> MergeResult:
        """``merge_weights=None`` means uniform ``[1]*N`` (PRAG's merge)."""
        return merge_adapters(adapters, merge_weights, self.mode, **self.options)

    def __repr__(self) -> str:
        return f"WeightedAdapterMerger(mode={self.mode!r}, options={self.options})"
