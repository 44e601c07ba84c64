"""Integration shims for host codebases (:mod:`.prag`: PRAG's ``add_weighted_adapter`` merge; :mod:`.dyprag`:
DyPRAG's average of translator outputs; :mod:`.base`: what they share). The core never imports them."""

from .base import PatchSet, WeightProvider
from .context import clear_context, get_context, set_context

__all__ = ["WeightProvider", "PatchSet", "set_context", "clear_context", "get_context"]
