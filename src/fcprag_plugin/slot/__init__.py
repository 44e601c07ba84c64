"""The slot on a live model: :class:`FusedSlot` (the one way an update enters a live model; :func:`activate` is a
one-adapter slot), :class:`AdapterStore` (cached packed adapters) and packed adapters (:func:`pack_adapter`)."""

from __future__ import annotations

from .layout import Layout, LayoutGroup, PackedAdapter, PackedGroup, layout_from_shapes, layout_of, pack_adapter
from .fused import FusedSlot, activate
from .store import AdapterStore, StoreStats, read_adapter_dir

__all__ = ["FusedSlot", "activate", "AdapterStore", "StoreStats", "PackedAdapter", "PackedGroup", "Layout",
           "LayoutGroup", "pack_adapter", "layout_of", "layout_from_shapes", "read_adapter_dir"]
