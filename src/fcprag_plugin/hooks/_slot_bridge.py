"""Shared plumbing of the shims' ``use_slot`` option.

- :class:`ShimSlots`: one :class:`~fcprag_plugin.fast.FusedSlot` per live model, created at the first question,
  grown when a question has more adapters or a larger rank than it holds (a documented resize, logged), or held
  at a fixed capacity (``max_adapters``: more adapters is a :class:`HookError`).
- :func:`pack_modules`: the factors a host already holds (live PEFT layers, DyPRAG translator outputs) packed
  straight into the slot's layout (``A [L, r, in]``, ``BT [L, r, out]`` per layout group), with shape checks that
  name the module.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import HookError
from ..fast.layout import Layout, PackedAdapter, PackedGroup
from ..fast.slot import FusedSlot

logger = logging.getLogger(__name__)

# module name -> (A [r, in], B [out, r], scaling)
FactorGetter = Callable[[str], "tuple[torch.Tensor, torch.Tensor, float]"]


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

    def slot_of(self, model: nn.Module) -> FusedSlot | None:
        return self._slots.get(model)

    def slots(self) -> list[FusedSlot]:
        return list(self._slots.values())

    def close(self) -> None:
        """Remove every slot (hooks and buffers): the models are exactly as before the first question."""
        for slot in list(self._slots.values()):
            slot.remove()
        self._slots = weakref.WeakKeyDictionary()


def pack_modules(layout: Layout, factors: FactorGetter, source: str, *, device: torch.device | None = None
                 ) -> PackedAdapter:
    """Pack one adapter given per module by ``factors(name) -> (A [r, in], B [out, r], scaling)`` into ``layout``.

    Modules of one group with different ranks are zero-padded to the largest (``B @ A`` unchanged). A factor of
    the wrong shape is a :class:`HookError` naming the module, the adapter (``source``) and both shapes.
    """
    groups = []
    for g in layout.groups:
        As, Bs, scales, ranks = [], [], [], []
        for name in g.names:
            A, B, s = factors(name)
            if A.ndim != 2 or B.ndim != 2 or A.shape[1] != g.in_features or B.shape[0] != g.out_features \
                    or A.shape[0] != B.shape[1]:
                raise HookError(f"{source}: module '{name}': lora_A {list(A.shape)} / lora_B {list(B.shape)} do not "
                                f"fit the model's [out, in] = [{g.out_features}, {g.in_features}] (expected A [r, "
                                f"{g.in_features}], B [{g.out_features}, r])")
            if device is not None and A.device != device:
                A, B = A.to(device), B.to(device)
            As.append(A)
            Bs.append(B)
            scales.append(float(s))
            ranks.append(int(A.shape[0]))
        r = max(ranks)
        if all(k == r for k in ranks):
            A_st = torch.stack(As)
            BT_st = torch.stack([b.T for b in Bs])
        else:
            A_st = As[0].new_zeros(len(As), r, g.in_features)
            BT_st = Bs[0].new_zeros(len(Bs), r, g.out_features)
            for l, (a, b) in enumerate(zip(As, Bs)):
                A_st[l, :a.shape[0]] = a
                BT_st[l, :b.shape[1]] = b.T
        common = set(scales)
        groups.append(PackedGroup(A_st, BT_st, torch.tensor(scales, dtype=torch.float64), tuple(ranks),
                                  common.pop() if len(common) == 1 else None))
    return PackedAdapter(layout, tuple(groups), source)
