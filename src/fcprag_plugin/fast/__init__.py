"""Fast per-query fusion on a live model: :class:`FusedSlot` (the one way an update enters a live model;
:func:`activate` is a one-adapter slot), :class:`AdapterStore` (cached packed adapters), mixed batches
(:func:`fused_mixed`: every sample its own mixture) and packed adapters (:func:`pack_adapter`)."""

from __future__ import annotations

from .layout import Layout, LayoutGroup, PackedAdapter, PackedGroup, layout_from_shapes, layout_of, pack_adapter
from .mixed import activate_mixed, fused_mixed, union_weights
from .slot import FusedSlot, activate
from .adapter_store import AdapterStore, StoreStats, read_adapter_dir

__all__ = ["FusedSlot", "activate", "AdapterStore", "StoreStats", "PackedAdapter", "PackedGroup", "Layout",
           "LayoutGroup", "pack_adapter", "layout_of", "layout_from_shapes", "read_adapter_dir", "activate_mixed",
           "fused_mixed", "union_weights"]
