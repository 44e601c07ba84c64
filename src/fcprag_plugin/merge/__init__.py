"""Weighted merging of N LoRA adapters: one small function per mode behind one registry.

Modes (``w~`` are the merge weights, length N; uniform ``w~ = [1]*N`` is PRAG's sum of passage updates):

- ``cat`` (exact): ``dW* = sum_i w~_i s_i B_i A_i`` by concatenating along rank (rank sum r_i, scaling 1).
- ``separate`` (DyPRAG): ``A* = sum_i u_i s_i A_i``, ``B* = sum_i u_i B_i`` with ``u = w~/N``; has cross terms.
- ``svd``: the exact ``cat`` update compressed to rank k without forming the dense dW.
"""

from __future__ import annotations

from .core import (
    MERGE_MODES,
    MergeResult,
    WeightedAdapterMerger,
    check_compatible,
    get_merge_mode,
    merge_adapters,
    register_merge_mode,
)
from . import modes as _modes  # noqa: F401  (registers the built-in modes)



__all__ = [
    "MERGE_MODES",
    "MergeResult",
    "WeightedAdapterMerger",
    "check_compatible",
    "get_merge_mode",
    "merge_adapters",
    "register_merge_mode",
]
