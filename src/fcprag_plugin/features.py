"""Query-passage pair features ``x_i = [e_q; e_p_i; e_q*e_p_i; |e_q-e_p_i|]``."""

from __future__ import annotations

import torch


def pair_features(e_q: torch.Tensor, E_p: torch.Tensor) -> torch.Tensor:
    """``e_q [B, d]``, ``E_p [B, N, d]`` -> ``x [B, N, 4d]``."""
    if e_q.ndim != 2 or E_p.ndim != 3 or e_q.shape[0] != E_p.shape[0] or e_q.shape[1] != E_p.shape[2]:
        raise ValueError(f"pair_features expects e_q [B, d] and E_p [B, N, d], got {list(e_q.shape)} and {list(E_p.shape)}")
    q = e_q.unsqueeze(1).expand_as(E_p)
    return torch.cat([q, E_p, q * E_p, (q - E_p).abs()], dim=-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Mean over ``dim`` of ``x [B, N, ...]`` counting only ``mask [B, N]`` entries."""
    m = mask.to(x.dtype)
    while m.ndim < x.ndim:
        m = m.unsqueeze(-1)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def masked_std(x: torch.Tensor, mask: torch.Tensor, dim: int = 1) -> torch.Tensor:
    mu = masked_mean(x, mask, dim)
    var = masked_mean((x - mu.unsqueeze(dim)) ** 2, mask, dim)
    # sqrt'(0) is infinite: a zero variance (N = 1, or tied values) would turn every gradient into NaN.
    # Same values as sqrt(var); only the gradient at var == 0 becomes 0.
    return torch.where(var > 0, var.clamp_min(torch.finfo(var.dtype).tiny).sqrt(), torch.zeros_like(var))


def masked_max(x: torch.Tensor, mask: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return x.masked_fill(~mask, float("-inf")).amax(dim)


def masked_min(x: torch.Tensor, mask: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return x.masked_fill(~mask, float("inf")).amin(dim)
