"""``activate``: put a (merged) adapter on a live model until removed -- a thin constructor over
:class:`~fcprag_plugin.fast.FusedSlot`, the one way an update enters a live model.

The update is applied by forward hooks on the target ``nn.Linear`` modules (``y += B (s A x)``), so removing the
handle restores the model bit for bit: no parameter is ever written.
"""

from __future__ import annotations

import torch
from torch import nn

from ..adapter import LoraAdapter
from ..fast.slot import FusedSlot


def activate(model: nn.Module, adapter: LoraAdapter, *, dtype: torch.dtype | None = None) -> FusedSlot:
    """Apply ``adapter`` to ``model`` until the returned handle is removed (``handle.remove()``, or use it as a
    context manager): a one-adapter :class:`FusedSlot` (buffers in ``dtype``, default each weight's) holding it."""
    slot = FusedSlot(model, adapter, max_adapters=1, dtype=dtype)
    try:
        slot.activate([adapter])
    except Exception:
        slot.remove()
        raise
    return slot
