"""Training kernels for the controller's two MLPs, in bfloat16 (mixed precision) or float32.

:class:`TrainRunner` is the controller's :class:`~fcprag_plugin.controller.MLPRunner` while the trainer runs:

- bfloat16: every Linear multiplies bfloat16 activations by a bfloat16 *shadow* copy of its float32 weight
  (cast in place into a buffer allocated once, at every forward); features,
  biases' gradients, everything after the MLPs, the loss, the master weights and AdamW stay float32. Autocasting
  the whole forward would also round the gate, the temperature and the weights to bfloat16 (3 digits), which
  makes the KL loss coarse and ties scores.
- both precisions: a custom backward writes each weight gradient with ``mm(..., out=buffer)`` into a buffer
  allocated once and hands that buffer to ``param.grad`` (the same tensor every step: do not keep references to
  ``.grad`` across steps). Letting autograd allocate fresh 12 MB gradients every step (and, with autocast, fresh
  casts of every weight and gradient) made glibc return and re-fault that memory in some epochs and not others:
  measured side by side on the 2-core VM, 4,000-8,000 page faults per step and 10.5-12.9 s per epoch (10k
  records) versus 6.1-6.4 s in the epochs without faults; these kernels run 6.3-6.6 s in every epoch. Without
  the faults, they are about as fast as autocast: the step is bound by the matmuls and AdamW's memory traffic.
- the score net's first layer never builds ``x_i = [e_q; xp_i]``: the query block of the weight is applied once
  per query (forward) and its gradient is accumulated from the per-query sum of the output gradients (backward).
- ReLU and the dropout after it are one step whose backward needs only its output; the keep-mask (the
  Bernoulli(1 - p) law of ``nn.Dropout``, from the same global generator) comes from uniform 32-bit integers,
  about 3x cheaper than ``bernoulli_`` on CPU.

Float32 gradients equal a float64 autograd reference of the whole loss to float32 rounding; bfloat16 ones are
within 3% (relative norm) of it, like autocast's (``tests/test_training_precision.py``).
The runner is an instance attribute of the controller only inside :func:`use_runner`, so the module, its state
dict and saved files are unchanged.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch import nn

from ..controller import FusionController, MLPRunner

TRAIN_DTYPES = (torch.bfloat16, torch.float32)


class _Slot:
    """One Linear's compute weights and gradient buffers."""

    __slots__ = ("weight", "bias", "w", "b", "gw", "gw32")

    def __init__(self, layer: nn.Linear, dtype: torch.dtype) -> None:
        self.weight, self.bias = layer.weight, layer.bias
        self.w = self.b = None  # set by refresh()
        self.gw = self.gw32 = None  # allocated by the first backward pass

    def refresh(self, dtype: torch.dtype) -> None:
        """Point ``w``/``b`` at the current parameter values in ``dtype``. For bfloat16 this is an in-place cast
        into buffers allocated once, done on every forward: the fused AdamW kernel updates parameters without
        bumping their version counters, so "did it change?" cannot be asked cheaply."""
        w, b = self.weight, self.bias
        if dtype == torch.float32:
            self.w, self.b = w.detach(), b.detach()
            return
        with torch.no_grad():
            if self.w is None or self.w.device != w.device:
                self.w = torch.empty(w.shape, dtype=dtype, device=w.device)
                self.b = torch.empty(b.shape, dtype=dtype, device=b.device)
            self.w.copy_(w)
            self.b.copy_(b)

    def deposit(self, compute: Any) -> None:
        """Add this step's weight gradient to ``weight.grad``: ``compute(out)`` writes it into ``out``."""
        p = self.weight
        if self.gw32 is None or self.gw32.device != p.device:
            self.gw32 = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            self.gw = self.gw32 if self.w.dtype == torch.float32 else torch.empty(p.shape, dtype=self.w.dtype,
                                                                                 device=p.device)
        if p.grad is None:  # the common case after zero_grad(set_to_none=True): no allocation, no extra pass
            compute(self.gw)
            if self.gw is not self.gw32:
                self.gw32.copy_(self.gw)
            p.grad = self.gw32
        else:  # accumulate (zero_grad(set_to_none=False), or several backward passes)
            tmp = torch.empty_like(self.gw)
            compute(tmp)
            p.grad.add_(tmp)


class _LinearFn(torch.autograd.Function):
    """``y = x W^T + b`` with the slot's compute weights; the weight gradient goes to the slot's buffer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, slot: _Slot) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.addmm(slot.b, x2, slot.w.t())
        ctx.save_for_backward(x2)
        ctx.slot, ctx.in_shape = slot, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        (x2,) = ctx.saved_tensors
        slot = ctx.slot
        g2 = g.reshape(-1, g.shape[-1])
        gx = torch.mm(g2, slot.w).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            slot.deposit(lambda out: torch.mm(g2.t(), x2, out=out))
        gb = g2.sum(0, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        return gx, None, gb, None


class _FirstLayerFn(torch.autograd.Function):
    """The score net's first layer on ``x_i = [e_q; xp_i]`` without building ``x``.

    Forward: ``h_i = (W_q e_q + b) + W_p xp_i``. Backward: ``dW_q = (sum_i dh_i)^T e_q``, ``dW_p = dh^T xp``,
    written into the two column blocks of one gradient buffer.
    """

    @staticmethod
    def forward(ctx: Any, e_q: torch.Tensor, xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                slot: _Slot) -> torch.Tensor:
        B, N, _ = xp.shape
        d = e_q.shape[1]
        w_q, w_p = slot.w[:, :d], slot.w[:, d:]
        h_q = torch.addmm(slot.b, e_q, w_q.t()).repeat_interleave(N, 0)  # [B*N, H]
        # the passage part is accumulated onto h_q inside the matmul (one rounding of the sum in bfloat16)
        h = torch.addmm(h_q, xp.reshape(B * N, -1), w_p.t()).view(B, N, -1)
        ctx.save_for_backward(e_q, xp)
        ctx.slot = slot
        return h

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        e_q, xp = ctx.saved_tensors
        slot = ctx.slot
        B, N, H = g.shape
        d = e_q.shape[1]
        g_q = g.sum(1)  # [B, H]: the query block's output gradient, summed over the query's passages
        g2 = g.reshape(B * N, H)
        xp2 = xp.reshape(B * N, -1)
        if ctx.needs_input_grad[2]:
            def compute(out: torch.Tensor) -> None:
                torch.mm(g_q.t(), e_q, out=out[:, :d])
                torch.mm(g2.t(), xp2, out=out[:, d:])

            slot.deposit(compute)
        ge = torch.mm(g_q, slot.w[:, :d]) if ctx.needs_input_grad[0] else None
        gxp = torch.mm(g2, slot.w[:, d:]).view(xp.shape) if ctx.needs_input_grad[1] else None
        gb = g_q.sum(0, dtype=torch.float32) if ctx.needs_input_grad[3] else None
        return ge, gxp, None, gb, None


class _ReluDropoutFn(torch.autograd.Function):
    """``relu(x) * keep / (1 - p)`` in three in-place passes; the backward needs only the output
    (``out > 0`` exactly where ``x > 0`` and the unit was kept)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.where(keep, x, 0).relu_().mul_(scale)
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(g, out, 0).mul_(ctx.scale), None, None


class TrainRunner(MLPRunner):
    """The controller's MLPs for training in ``dtype`` (``torch.bfloat16`` or ``torch.float32``); see the module
    docstring. One runner per trainer: its buffers are reused by every step."""

    trainable = True

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in TRAIN_DTYPES:
            raise ValueError(f"training precision supports {[str(t) for t in TRAIN_DTYPES]}, got {dtype}")
        self.dtype = dtype
        self._slots: dict[int, _Slot] = {}
        self._bits: dict[tuple, torch.Tensor] = {}

    def _slot(self, layer: nn.Linear) -> _Slot:
        slot = self._slots.get(id(layer))
        if slot is None or slot.weight is not layer.weight:
            slot = self._slots[id(layer)] = _Slot(layer, self.dtype)
        slot.refresh(self.dtype)
        return slot

    def first(self, layer: nn.Linear, e_q: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
        return _FirstLayerFn.apply(e_q.to(self.dtype), xp.to(self.dtype), layer.weight, layer.bias, self._slot(layer))

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x.to(self.dtype), layer.weight, layer.bias, self._slot(layer))

    def relu_dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if p <= 0:
            return torch.relu(x)
        if p >= 1:
            return x * 0
        return _ReluDropoutFn.apply(x, self.keep_mask(x.shape, p, x.device), 1.0 / (1.0 - p))

    def keep_mask(self, shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
        """Bool ``shape``: each unit kept with probability ``1 - p`` (to within 2**-33), from the global torch
        generator: uniform 32-bit integers, two per 64-bit draw (~1.4x cheaper than ``torch.rand(shape) >= p``,
        whose floats resolve p to only 2**-24)."""
        n = math.prod(shape)
        key = ((n + 1) // 2, device)
        bits = self._bits.get(key)
        if bits is None:  # one buffer per size, reused every step (no fresh ~1 MB allocation, no page faults)
            bits = self._bits[key] = torch.empty(key[0], dtype=torch.int64, device=device)
        bits.random_(-2 ** 63, None)
        threshold = min(-2 ** 31 + round(p * 2 ** 32), 2 ** 31 - 1)  # P(bits < threshold) = p
        return (bits.view(torch.int32)[:n] >= threshold).view(shape)


@contextlib.contextmanager
def use_runner(controller: FusionController, runner: MLPRunner) -> Iterator[FusionController]:
    """Within the block, ``controller`` evaluates its MLPs with ``runner`` (restored afterwards)."""
    had = "_runner" in controller.__dict__
    old = controller.__dict__.get("_runner")
    controller.__dict__["_runner"] = runner
    try:
        yield controller
    finally:
        if had:
            controller.__dict__["_runner"] = old
        else:
            del controller.__dict__["_runner"]


@contextlib.contextmanager
def mixed_precision(controller: FusionController, dtype: torch.dtype | None) -> Iterator[FusionController]:
    """Within the block, the controller's MLPs run in ``dtype`` (only ``torch.bfloat16``; None: no change)."""
    if dtype is None:
        yield controller
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"mixed precision supports torch.bfloat16 only, got {dtype}")
    with use_runner(controller, TrainRunner(dtype)):
        yield controller


def native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): then bf16 matmuls are several times
    faster than float32. Elsewhere oneDNN emulates them and float32 is the better choice."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set()
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.backends.mkldnn.is_available()


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> ``"bf16"`` on CPUs with native bfloat16, else ``"fp32"``; others pass through."""
    if precision == "auto":
        return "bf16" if native_bf16() else "fp32"
    return precision
