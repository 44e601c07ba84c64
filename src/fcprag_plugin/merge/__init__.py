"""Weighted merging of N LoRA adapters with merge weights ``w~`` (length N; ``[1]*N`` is PRAG's sum of passage
updates): one small function per mode (``cat``, ``separate``, ``svd``; see :mod:`.modes`) behind one registry."""

from __future__ import annotations

from .core import (MERGE_MODES, MergeResult, WeightedAdapterMerger, check_compatible, get_merge_mode, merge_adapters,
                   register_merge_mode)
from . import modes as _modes  # noqa: F401  (registers the built-in modes)

__all__ = ["MERGE_MODES", "MergeResult", "WeightedAdapterMerger", "check_compatible", "get_merge_mode",
           "merge_adapters", "register_merge_mode"]
