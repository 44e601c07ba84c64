"""Fast per-query fusion on a live model.

- :class:`FusedSlot`: a LoRA slot injected once into a model; per query only its buffers are rewritten
  (``with slot.fused(adapters, w~): model.generate(...)``), exact ``cat`` or DyPRAG ``separate`` semantics. It is
  the one way an update enters a live model; :func:`activate` puts one adapter on a model through a
  one-adapter slot until ``handle.remove()``.
- :class:`AdapterStore`: bounded LRU cache of packed adapters keyed by directory + file mtimes.
- :func:`fused_mixed` / :func:`activate_mixed`: one forward where every sample has its own mixture.
- :func:`pack_adapter` / :class:`PackedAdapter`: adapters as contiguous per-layer stacks.
"""

from __future__ import annotations

from .layout import Layout, LayoutGroup, PackedAdapter, PackedGroup, layout_from_shapes, layout_of, pack_adapter
from .mixed import activate_mixed, fused_mixed, union_weights
from .slot import FusedSlot, activate
from .adapter_store import AdapterStore, StoreStats, read_adapter_dir

__all__ = [
    "FusedSlot",
    "activate",
    "AdapterStore",
    "StoreStats",
    "PackedAdapter",
    "PackedGroup",
    "Layout",
    "LayoutGroup",
    "pack_adapter",
    "layout_of",
    "layout_from_shapes",
    "read_adapter_dir",
    "activate_mixed",
    "fused_mixed",
    "union_weights",
]
