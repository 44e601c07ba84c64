"""Per-sample mixtures of a fused slot's adapters in one batch (``FusedSlot.write_mixed``): the checked weights and
the transform the slot's hooks apply in rank space."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import MergeError


def mixture_weights(merge_weights: Any, mask: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked per-sample weights ``[B, k]`` (masked entries zeroed) and the mask (default: non-zero weights)."""
    w = torch.as_tensor(merge_weights, dtype=torch.float32).detach().cpu()
    if w.ndim != 2 or w.shape[1] != k or w.shape[0] < 1:
        raise MergeError(f"mixed-batch weights have shape {list(w.shape)}, expected [B, {k}] (one row per sample, "
                         "one column per adapter of the union)")
    if not bool(torch.isfinite(w).all()):
        raise MergeError("mixed-batch weights must be finite")
    m = w != 0 if mask is None else torch.as_tensor(mask).detach().cpu().to(torch.bool)
    if m.shape != w.shape:
        raise MergeError(f"mixed-batch mask has shape {list(m.shape)}, expected {list(w.shape)}")
    return w * m, m


class Mixture:
    """The rank-space transform of ``FusedSlot.write_mixed`` for ``B`` samples of per-sample weights ``w [B, n]``
    over the slot's first ``n`` of ``k_slot`` adapters (rank ``rank``): ``cat`` weighs rows, ``separate`` takes
    ``u_b = w_b * m_b / sum m_b``, ``h* = sum_i u_bi h_i``, then ``sum_i u_bi B_i h*``."""

    def __init__(self, w: torch.Tensor, m: torch.Tensor, mode: str, k_slot: int, rank: int) -> None:
        B, n = w.shape
        if mode == "cat":
            coef = torch.zeros(B, k_slot, rank)
            coef[:, :n] = w[:, :, None]
            coef = coef.view(B, k_slot * rank)
        else:
            count = m.sum(1, keepdim=True)
            if bool((count == 0).any()):
                bad = int(torch.nonzero(count[:, 0] == 0)[0])
                raise MergeError(f"mixed mode 'separate': sample {bad} uses no adapter (its mask row is all False)")
            coef = torch.zeros(B, k_slot)
            coef[:, :n] = (w / count.to(torch.float32)) * m
        self.coef, self.mode, self.k, self.r, self.batch = coef, mode, k_slot, rank, B
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def __call__(self, h: torch.Tensor, name: str) -> torch.Tensor:
        if h.ndim < 2 or h.shape[0] != self.batch:
            raise MergeError(f"module '{name}': the mixed batch has {self.batch} samples but the module's input has "
                             f"shape {list(h.shape[:-1])} (batch first expected; beam search or other batch "
                             "expansion needs one weight row per expanded sample)")
        c = self._cache.get((h.device, h.dtype))
        if c is None:
            c = self._cache[(h.device, h.dtype)] = self.coef.to(device=h.device, dtype=h.dtype)
        lead = (self.batch,) + (1,) * (h.ndim - 2)
        if self.mode == "cat":
            return h * c.view(*lead, -1)
        u = c.view(*lead, self.k, 1)
        hs = (h.view(*h.shape[:-1], self.k, self.r) * u).sum(-2, keepdim=True)  # [..., 1, R] = A*_b x
        return (u * hs).reshape(h.shape)
