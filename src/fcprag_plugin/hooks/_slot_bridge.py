"""Shared plumbing of the shims' ``use_slot`` option.

- :class:`ShimSlots`: one :class:`~fcprag_plugin.fast.FusedSlot` per live model, created at the first question,
  grown when a question has more adapters or a larger rank than it holds (a documented resize, logged), or held
  at a fixed capacity (``max_adapters``: more adapters is a :class:`HookError`).
- :meth:`ShimSlots.write`: the factors a host already holds (DyPRAG's translator outputs) packed straight into the
  slot's layout (:func:`fcprag_plugin.fast.layout.pack_factors`) and merged there; :meth:`ShimSlots.write_packed`:
  adapters already packed by an adapter store (PRAG's passages).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Sequence

from torch import nn

from ..errors import HookError
from ..fast.layout import FactorGetter, PackedAdapter, pack_factors
from ..fast.slot import FusedSlot

logger = logging.getLogger(__name__)


def check_max_adapters(max_adapters: Any, use_slot: bool, who: str) -> int | None:
    """Validate the ``max_adapters`` option (``None``: the slot grows with the largest question)."""
    if max_adapters is None:
        return None
    if not use_slot:
        raise HookError(f"{who}: max_adapters / --slot-max-adapters only applies with use_slot=True / --use-slot")
    if isinstance(max_adapters, bool) or not isinstance(max_adapters, int) or max_adapters < 1:
        raise HookError(f"{who}: max_adapters must be a positive integer (the most passages one question may have), "
                        f"got {max_adapters!r}")
    return max_adapters


class ShimSlots:
    """The fused slots one shim installed, one per live model (held weakly); :meth:`close` removes them all.

    Args:
        max_adapters: fixed slot capacity K; ``None`` sizes the slot for the first question and grows it (one
            reallocation, logged at INFO) when a later question has more adapters or a larger rank.
        who: names the shim in error messages.
    """

    def __init__(self, max_adapters: int | None, who: str) -> None:
        self.max_adapters = max_adapters
        self.who = who
        self._slots: "weakref.WeakKeyDictionary[nn.Module, FusedSlot]" = weakref.WeakKeyDictionary()
        self.resizes = 0

    def get(self, model: nn.Module, modules: Sequence[str], n: int, rank: int) -> FusedSlot:
        """The slot on ``model`` covering exactly ``modules`` (base-model paths), with room for ``n`` adapters of
        rank ``rank``."""
        if self.max_adapters is not None and n > self.max_adapters:
            raise HookError(f"{self.who}: this question merges {n} adapters but the fused slot holds "
                            f"max_adapters={self.max_adapters}; raise max_adapters (--slot-max-adapters) or leave it "
                            "unset so the slot grows with the largest question")
        slot = self._slots.get(model)
        if slot is not None and set(slot.layout.module_names) != set(modules):
            logger.info("%s: the target modules changed (%d -> %d modules); rebuilding the fused slot", self.who,
                        slot.layout.num_modules, len(modules))
            slot.remove()
            del self._slots[model]
            slot = None
        if slot is None:
            slot = FusedSlot(model, list(modules), max_adapters=self.max_adapters or n, max_rank=rank)
            self._slots[model] = slot
            logger.info("%s: fused slot installed on %d modules (K=%d, R=%d, %d bytes)", self.who,
                        slot.layout.num_modules, slot.max_adapters, slot.max_rank, slot.nbytes)
        elif n > slot.max_adapters or rank > slot.max_rank:
            slot.resize(max(n, slot.max_adapters), max(rank, slot.max_rank))
            self.resizes += 1
        return slot

    def write(self, model: nn.Module, modules: Sequence[str], rank: int, factors: Sequence[FactorGetter],
              sources: Sequence[str], weights: Sequence[float], mode: str) -> FusedSlot:
        """The shims' merge step on the slot: pack each adapter's factors (``factors[i](module) -> (A, B, s)``,
        named ``sources[i]`` in errors) into the slot of ``model`` and write their ``mode`` merge with ``weights``
        (switched on; the caller decides when it stays on)."""
        slot = self.get(model, modules, len(factors), rank)
        packed = [pack_factors(slot.layout, f, src, error=HookError) for f, src in zip(factors, sources)]
        return slot.activate(packed, list(weights), mode)

    def write_packed(self, model: nn.Module, packed: Sequence[PackedAdapter], weights: Sequence[float],
                     mode: str) -> FusedSlot:
        """Write the ``mode`` merge of already packed adapters (an :class:`~fcprag_plugin.fast.AdapterStore`'s)
        into the slot of ``model`` covering their modules (switched on)."""
        slot = self.get(model, packed[0].layout.module_names, len(packed), max(p.max_rank for p in packed))
        return slot.activate(list(packed), list(weights), mode)

    def slot_of(self, model: nn.Module) -> FusedSlot | None:
        return self._slots.get(model)

    def slots(self) -> list[FusedSlot]:
        return list(self._slots.values())

    def close(self) -> None:
        """Remove every slot (hooks and buffers): the models are exactly as before the first question."""
        for slot in list(self._slots.values()):
            slot.remove()
        self._slots = weakref.WeakKeyDictionary()
