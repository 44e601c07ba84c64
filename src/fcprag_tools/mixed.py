"""Mixed-batch fusion: every sample of a batch gets its own weighted mixture of adapters, in one forward.

The union of the batch's adapters is written into a :class:`~fcprag_plugin.slot.fused.FusedSlot` unweighted
(``A = s_i A_i``, ``BT = B_i^T``, adapter i on rank rows ``i*R ..``). The per-sample weights then act in rank
space, between A and B, so no per-sample weights are ever materialised:

- ``cat``:       ``y_b += B diag(w_b (x) 1_R) A x_b``  i.e. ``sum_i w_bi s_i B_i A_i x_b``  (exact)
- ``separate``:  ``h = A x_b`` split per adapter, ``h* = sum_i u_bi h_i`` (= ``A*_b x_b``), then
  ``y_b += sum_i u_bi B_i h*``  (= ``B*_b A*_b x_b``), ``u_b = w~_b / N_b`` -- DyPRAG's merge per sample, exact.

Both equal running each sample alone with its own merge, up to float rounding (tested).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager, Sequence

import torch

from fcprag_plugin.errors import MergeError
from fcprag_plugin.slot import FusedSlot

MIXED_MODES = ("cat", "separate")


def adapter_key(adapter: Any) -> tuple:
    """How mixed batches tell adapters apart: by resolved path (``str`` / ``Path``), else by object identity."""
    return ("path", str(Path(adapter).resolve())) if isinstance(adapter, (str, Path)) else ("id", id(adapter))


def union_weights(per_sample_adapters: Sequence[Sequence[Any]], per_sample_weights: Sequence[Sequence[float]] | None
                  = None) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    """Per-sample adapter lists (+ weights ``w~``, default ones) -> (union, ``W [B, K]``, ``mask [B, K]``).

    Adapters are identified by :func:`adapter_key`, in order of first appearance.
    """
    union: list[Any] = []
    index: dict[Any, int] = {}
    entries: list[tuple[int, int, float]] = []  # (sample, position in the union, weight)
    if per_sample_weights is not None and len(per_sample_weights) != len(per_sample_adapters):
        raise MergeError(f"got adapter lists for {len(per_sample_adapters)} samples but weights for "
                         f"{len(per_sample_weights)}")
    for b, ads in enumerate(per_sample_adapters):
        ws = [1.0] * len(ads) if per_sample_weights is None else list(per_sample_weights[b])
        if len(ws) != len(ads):
            raise MergeError(f"sample {b}: {len(ads)} adapters but {len(ws)} weights")
        if not ads:
            raise MergeError(f"sample {b} has no adapters")
        for a, w in zip(ads, ws):
            i = index.setdefault(adapter_key(a), len(union))
            if i == len(union):
                union.append(a)
            entries.append((b, i, float(w)))
    W = torch.zeros(len(per_sample_adapters), len(union))
    mask = torch.zeros(len(per_sample_adapters), len(union), dtype=torch.bool)
    for b, i, w in entries:
        if mask[b, i]:
            raise MergeError(f"sample {b} lists adapter {union[i]!r} twice")
        W[b, i], mask[b, i] = w, True
    return union, W, mask


def _check(weights: Any, mask: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.as_tensor(weights, dtype=torch.float32).detach().cpu()
    if w.ndim != 2 or w.shape[1] != k or w.shape[0] < 1:
        raise MergeError(f"mixed-batch weights have shape {list(w.shape)}, expected [B, {k}] (one row per sample, "
                         "one column per adapter of the union)")
    if not bool(torch.isfinite(w).all()):
        raise MergeError("mixed-batch weights must be finite")
    if mask is None:
        m = w != 0
    else:
        m = torch.as_tensor(mask).detach().cpu().to(torch.bool)
        if m.shape != w.shape:
            raise MergeError(f"mixed-batch mask has shape {list(m.shape)}, expected {list(w.shape)}")
    return w * m, m


class _RankMixer:
    """The rank-space transform a slot applies between A and B, for ``B`` samples (see the module docstring)."""

    def __init__(self, coef: torch.Tensor, mode: str, k_slot: int, rank: int) -> None:
        self.coef = coef  # cat: [B, K*R] row weights; separate: [B, K] u
        self.mode, self.k, self.r = mode, k_slot, rank
        self.batch = coef.shape[0]
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _coef(self, h: torch.Tensor) -> torch.Tensor:
        key = (h.device, h.dtype)
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = self.coef.to(device=h.device, dtype=h.dtype)
        return c

    def __call__(self, h: torch.Tensor, name: str) -> torch.Tensor:
        if h.ndim < 2 or h.shape[0] != self.batch:
            raise MergeError(f"module '{name}': the mixed batch has {self.batch} samples but the module's input has "
                             f"shape {list(h.shape[:-1])} (batch first expected; beam search or other batch "
                             "expansion needs one weight row per expanded sample)")
        c = self._coef(h)
        lead = (self.batch,) + (1,) * (h.ndim - 2)
        if self.mode == "cat":
            return h * c.view(*lead, -1)
        h4 = h.view(*h.shape[:-1], self.k, self.r)
        u = c.view(*lead, self.k, 1)
        hs = (h4 * u).sum(-2, keepdim=True)  # [..., 1, R] = A*_b x
        return (u * hs).reshape(h.shape)


def activate_mixed(slot: FusedSlot, adapters: Sequence[Any], weights: Any, mode: str = "cat",
                   mask: Any = None) -> FusedSlot:
    """Write the union ``adapters`` (K' <= slot K) and activate per-sample mixtures ``weights [B, K']`` (``w~``).

    ``mask [B, K']`` marks which adapters each sample uses (default: non-zero weights); ``separate`` divides
    by the per-sample count ``N_b``. Inputs of every target module must then have batch size ``B`` first.
    """
    if mode not in MIXED_MODES:
        raise MergeError(f"mixed-batch mode '{mode}' is not supported; expected one of {list(MIXED_MODES)}")
    w, m = _check(weights, mask, len(adapters))
    packed = slot.write_unweighted(adapters)
    K, R = slot.max_adapters, slot.max_rank
    B = w.shape[0]
    if mode == "cat":
        coef = torch.zeros(B, K, R)
        coef[:, :len(packed)] = w[:, :, None]
        coef = coef.view(B, K * R)
    else:
        slot._check_equal_ranks(packed, "mixed mode 'separate'")
        n = m.sum(1, keepdim=True)
        if bool((n == 0).any()):
            bad = int(torch.nonzero(n[:, 0] == 0)[0])
            raise MergeError(f"mixed mode 'separate': sample {bad} uses no adapter (its mask row is all False)")
        coef = torch.zeros(B, K)
        coef[:, :len(packed)] = (w / n.to(torch.float32)) * m
    slot.switch_on_transform(_RankMixer(coef, mode, K, R))
    return slot


def fused_mixed(slot: FusedSlot, adapters: Sequence[Any], weights: Any, mode: str = "cat",
                mask: Any = None) -> ContextManager[FusedSlot]:
    """``with fused_mixed(slot, union, W): model(**batch)`` -- per-sample mixtures inside the block only."""
    return slot._block(lambda: activate_mixed(slot, adapters, weights, mode, mask),
                      "fused_mixed() cannot run inside another fused() block of the same slot")
