"""Fused weights for a :class:`~fcprag_plugin.slot.FusedSlot`: each target module computes with ``W' = W + BT^T A``,
one buffer per module swapped in for its ``weight`` parameter (and the original put back). The copy must fit
``budget`` bytes (None: half the device's free memory) and every target weight must be a plain floating-point
``nn.Parameter``; otherwise the slot keeps its hooks (logged once)."""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (CUDA: free plus what torch's allocator holds unused; CPU: ``MemAvailable``)."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, RuntimeError, StopIteration, ValueError):
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
    return None


class WeightSwap:
    """The swap of a slot's target ``modules``' ``weight`` parameters for fused copies (base weight plus update)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self.budget: int | None = None
        self._params: list[nn.Parameter] | None = None
        self._swapped: list[tuple[nn.Module, nn.Parameter]] = []  # (module, its original weight) while swapped
        self._refused: tuple[int | None, str] | None = None  # (budget, why) of the last refusal

    nbytes = property(lambda self: sum(m.weight.numel() * m.weight.element_size() for m in self.modules))
    device_type = property(lambda self: self.modules[0].weight.device.type)
    swapped = property(lambda self: bool(self._swapped))

    def available(self) -> str | None:
        """Allocate the buffers if needed: None when the route can be used, else why not (logged once per budget)."""
        if self._params is not None:
            return None
        if self._refused is not None and self._refused[0] == self.budget:
            return self._refused[1]
        why = ineligible(self.modules)
        if why is None and self.budget is not None and self.nbytes > self.budget:
            why = f"they need {self.nbytes} bytes, over the budget of {self.budget} bytes"
        for dev in ({m.weight.device for m in self.modules} if why is None and self.budget is None else ()):
            need = sum(m.weight.numel() * m.weight.element_size() for m in self.modules if m.weight.device == dev)
            free = free_bytes(dev)
            if free is not None and need > free // 2:
                why = f"they need {need} bytes on {dev}, over half of its {free} free bytes"
        if why is None:
            try:
                self._params = [nn.Parameter(torch.empty_like(m.weight, memory_format=torch.contiguous_format),
                                             requires_grad=False) for m in self.modules]
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                why = f"allocating them failed ({str(e).splitlines()[0][:120]})"
        if why is not None:
            self._refused = (self.budget, why)
            logger.warning("FusedSlot: fused weights for %d target modules not used: %s; the update is added "
                           "through forward hooks instead", len(self.modules), why)
        return why

    @torch.no_grad()
    def fill(self, factors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``buffer_j = W_j + BT_j^T A_j`` (``factors[j] = (A [rows, in], BT [rows, out])``), rounded once."""
        assert self._params is not None and not self._swapped
        for mod, p, (A, BT) in zip(self.modules, self._params, factors):
            W = mod.weight
            if A.shape[0] == 0:
                p.copy_(W)
            elif A.dtype == W.dtype:
                torch.addmm(W, BT.T, A, out=p)
            else:  # factors in another dtype (the slot's dtype=): add in the wider one
                wide = torch.promote_types(A.dtype, W.dtype)
                p.copy_(torch.addmm(W.to(wide), BT.T.to(wide), A.to(wide)))

    def swap_in(self) -> None:
        """Each module computes with its buffer; an interruption half way puts every original back."""
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
