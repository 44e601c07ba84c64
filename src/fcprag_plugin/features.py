"""Query-passage pair features ``x_i = [e_q; e_p_i; e_q*e_p_i; |e_q-e_p_i|]``.

The first block of ``x_i`` is the same for every passage of a query. The controller therefore never builds ``x``:
it keeps the per-passage part ``[e_p_i; e_q*e_p_i; |e_q-e_p_i|]`` (:func:`passage_features`) and applies the query
block of a first-layer weight once per query (see ``controller.split_first_linear``).

The ``masked_*`` reductions take ``mask=None`` for "every entry is real" (no masking ops at all).
"""

from __future__ import annotations

import torch


def _check(e_q: torch.Tensor, E_p: torch.Tensor, what: str) -> None:
    if e_q.ndim != 2 or E_p.ndim != 3 or e_q.shape[0] != E_p.shape[0] or e_q.shape[1] != E_p.shape[2]:
        raise ValueError(f"{what} expects e_q [B, d] and E_p [B, N, d], got {list(e_q.shape)} and {list(E_p.shape)}")


def pair_features(e_q: torch.Tensor, E_p: torch.Tensor) -> torch.Tensor:
    """``e_q [B, d]``, ``E_p [B, N, d]`` -> ``x [B, N, 4d]``."""
    _check(e_q, E_p, "pair_features")
    q = e_q.unsqueeze(1).expand_as(E_p)
    return torch.cat([q, E_p, q * E_p, (q - E_p).abs()], dim=-1)


def passage_features(e_q: torch.Tensor, E_p: torch.Tensor) -> torch.Tensor:
    """The per-passage blocks of :func:`pair_features`: ``[e_p; e_q*e_p; |e_q-e_p|]`` as ``[B, N, 3d]``
    (``pair_features(e_q, E_p) == cat([e_q expanded, passage_features(e_q, E_p)], -1)``)."""
    _check(e_q, E_p, "passage_features")
    q = e_q.unsqueeze(1)
    return torch.cat([E_p, q * E_p, (q - E_p).abs()], dim=-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """Mean over ``dim`` of ``x [B, N, ...]`` counting only ``mask [B, N]`` entries (None: all)."""
    if mask is None:
        return x.mean(dim)
    m = mask.to(x.dtype)
    while m.ndim < x.ndim:
        m = m.unsqueeze(-1)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def masked_std(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """Population standard deviation over ``dim`` of the ``mask`` entries (None: all)."""
    mu = masked_mean(x, mask, dim)
    var = masked_mean((x - mu.unsqueeze(dim)) ** 2, mask, dim)
    # sqrt'(0) is infinite: a zero variance (N = 1, or tied values) would turn every gradient into NaN.
    # Same values as sqrt(var); only the gradient at var == 0 becomes 0.
    return torch.where(var > 0, var.clamp_min(torch.finfo(var.dtype).tiny).sqrt(), torch.zeros_like(var))


def masked_max(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    return x.amax(dim) if mask is None else x.masked_fill(~mask, float("-inf")).amax(dim)


def masked_min(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    return x.amin(dim) if mask is None else x.masked_fill(~mask, float("inf")).amin(dim)
