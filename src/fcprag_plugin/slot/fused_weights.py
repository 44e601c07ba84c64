"""Fused weights for a :class:`~fcprag_plugin.slot.FusedSlot`: the target modules compute with ``W' = W + B A``.

While a slot's merge is on, each target module can compute with a fused copy of its weight instead of adding the
low-rank update through a forward hook (the hooks cost 15-50% of a generate; fused weights cost what the base
model costs). The base weights are never written: every target module gets one preallocated buffer

    W' = W + BT^T A      (``torch.addmm``; ``A [K*R, in]`` and ``BT [K*R, out]`` are the slot's rows, which hold
                          ``w~_i s_i A_i`` and ``B_i^T``: ``BT^T A = sum_i w~_i s_i B_i A_i``, or DyPRAG's sums)

and its ``weight`` parameter is swapped for ``nn.Parameter(W')`` with ``setattr``; switching off puts the original
``Parameter`` object back, so the base model is restored bit-exact by construction and at no cost.

Memory: one copy of the target weights (``nbytes``), allocated the first time and kept until the slot is removed.
It must fit ``budget`` bytes (default: half of the memory the device reports free); when it does not, or when a
target weight is not a plain floating-point ``nn.Parameter`` (quantised, meta / offloaded, a subclass), the slot
keeps its hooks and logs why once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def free_bytes(device: torch.device) -> int | None:
    """Memory the device reports free (CUDA: free plus what torch's allocator holds unused; CPU: the kernel's
    ``MemAvailable``), or None when unknown."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None


def ineligible(modules: Sequence[nn.Module]) -> str | None:
    """Why these modules cannot compute with a swapped fused weight (None: they can)."""
    for mod in modules:
        w = getattr(mod, "weight", None)
        if type(w) is not nn.Parameter:  # quantised weights are Parameter subclasses (e.g. bitsandbytes)
            return f"a target weight is a {type(w).__name__}, not a plain nn.Parameter"
        if w.dtype not in FLOAT_DTYPES:
            return f"a target weight has dtype {w.dtype} (fused weights need float16/bfloat16/float32/float64)"
        if w.device.type == "meta":
            return "a target weight is on the meta device (offloaded)"
        if not dict(mod.named_parameters(recurse=False)).get("weight") is w:
            return f"{type(mod).__name__}.weight is not a registered parameter"
    return None


class FusedWeights:
    """The fused-weight buffers of one slot's target modules (``modules``, in the slot's layout order) and the
    swap. ``budget``: the most bytes the buffers may take (None: half of the device's free memory)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self.budget: int | None = None
        self._params: list[nn.Parameter] | None = None  # the fused parameters (buffers), one per module
        self._swapped: list[tuple[nn.Module, nn.Parameter]] = []  # (module, its original weight) while swapped
        self._refused: str | None = None
        self._refused_for: Any = object()  # the budget the refusal was decided under

    @property
    def nbytes(self) -> int:
        """Bytes of the fused copies (what the route costs once allocated)."""
        return sum(m.weight.numel() * m.weight.element_size() for m in self.modules) if self._params is None \
            else sum(p.numel() * p.element_size() for p in self._params)

    @property
    def swapped(self) -> bool:
        return bool(self._swapped)

    def _need_bytes(self) -> int:
        return sum(m.weight.numel() * m.weight.element_size() for m in self.modules)

    def available(self) -> str | None:
        """Allocate the buffers if needed; None when the route can be used, else why not (decided once per budget,
        logged once)."""
        if self._params is not None:
            return None
        if self._refused is not None and self._refused_for == self.budget:
            return self._refused
        why = ineligible(self.modules)
        if why is None:
            need = self._need_bytes()
            devices = {m.weight.device for m in self.modules}
            if self.budget is not None:
                if need > self.budget:
                    why = f"they need {need} bytes, over the budget of {self.budget} bytes"
            else:
                for dev in devices:
                    need_dev = sum(m.weight.numel() * m.weight.element_size() for m in self.modules
                                   if m.weight.device == dev)
                    free = free_bytes(dev)
                    if free is not None and need_dev > free // 2:
                        why = f"they need {need_dev} bytes on {dev}, over half of its {free} free bytes"
                        break
        if why is None:
            try:
                self._params = [nn.Parameter(torch.empty_like(m.weight, memory_format=torch.contiguous_format),
                                             requires_grad=False) for m in self.modules]
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                why = f"allocating them failed ({str(e).splitlines()[0][:120]})"
        if why is not None:
            self._refused, self._refused_for = why, self.budget
            logger.warning("FusedSlot: fused weights for %d target modules not used: %s; the update is added "
                           "through forward hooks instead", len(self.modules), why)
        return why

    @torch.no_grad()
    def fill(self, factors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``buffer_j = W_j + BT_j^T A_j`` for every module (``factors[j] = (A [rows, in], BT [rows, out])``)."""
        assert self._params is not None and not self._swapped
        for mod, p, (A, BT) in zip(self.modules, self._params, factors):
            W = mod.weight
            if A.shape[0] == 0:
                p.copy_(W)
            elif A.dtype == W.dtype:
                torch.addmm(W, BT.T, A, out=p)
            else:  # factors in another dtype (slot dtype=): add in the wider one, round once
                wide = torch.promote_types(A.dtype, W.dtype)
                p.copy_(torch.addmm(W.to(wide), BT.T.to(wide), A.to(wide)))

    def swap_in(self) -> None:
        """Each module computes with its fused buffer (the original ``Parameter`` objects are kept)."""
        assert self._params is not None and not self._swapped
        try:
            for mod, p in zip(self.modules, self._params):
                self._swapped.append((mod, mod.weight))  # recorded first: restore() is safe at any point
                setattr(mod, "weight", p)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Put every original weight ``Parameter`` back (idempotent)."""
        while self._swapped:
            mod, orig = self._swapped[-1]
            setattr(mod, "weight", orig)
            self._swapped.pop()

    def free(self) -> None:
        self.restore()
        self._params = None
