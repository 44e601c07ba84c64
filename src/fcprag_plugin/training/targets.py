"""Training targets and the objective (math only, no I/O).

    y_b     = softmax(delta_b / T_label)                  over the real passages of sample b
    flat_b  = max(delta_b) - min(delta_b) <= eps          nothing to learn about the ranking
    omega_b = flat_weight if flat_b else 1
    loss    = sum_b omega_b * KL(y_b || w_b) / (sum_b omega_b + eps)
"""

from __future__ import annotations

import torch

from ..errors import FcpragError

DEFAULT_T_LABEL = 0.1
DEFAULT_FLAT_EPS = 1e-6
DEFAULT_FLAT_WEIGHT = 0.1
LOSS_EPS = 1e-8
_LOG_FLOOR = 1e-12  # w can underflow to 0 for a passage; log(0) would make the KL infinite


def check_target_args(t_label: float, flat_eps: float, flat_weight: float) -> None:
    if not t_label > 0:
        raise FcpragError(f"t_label is {t_label}, expected a positive temperature")
    if not flat_eps >= 0:
        raise FcpragError(f"flat_eps is {flat_eps}, expected >= 0")
    if not 0 <= flat_weight:
        raise FcpragError(f"flat_weight is {flat_weight}, expected >= 0 (a sample weight for flat samples)")


def soft_targets(deltas: torch.Tensor, mask: torch.Tensor, t_label: float = DEFAULT_T_LABEL) -> torch.Tensor:
    """``deltas [B, N]``, ``mask [B, N]`` -> ``y [B, N]``: softmax over the real passages, zeros on padding."""
    logits = (deltas / t_label).masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=1).masked_fill(~mask, 0.0)


def flat_samples(deltas: torch.Tensor, mask: torch.Tensor, flat_eps: float = DEFAULT_FLAT_EPS) -> torch.Tensor:
    """``[B]`` bool: the spread of the real deltas is at most ``flat_eps`` (N = 1 is always flat)."""
    hi = deltas.masked_fill(~mask, float("-inf")).amax(1)
    lo = deltas.masked_fill(~mask, float("inf")).amin(1)
    return (hi - lo) <= flat_eps


def sample_weights(flat: torch.Tensor, flat_weight: float = DEFAULT_FLAT_WEIGHT) -> torch.Tensor:
    """``omega [B]``: 1 for informative samples, ``flat_weight`` for flat ones."""
    return torch.where(flat, torch.full_like(flat, flat_weight, dtype=torch.float32),
                       torch.ones_like(flat, dtype=torch.float32))


def make_targets(deltas: torch.Tensor, mask: torch.Tensor, t_label: float = DEFAULT_T_LABEL,
                 flat_eps: float = DEFAULT_FLAT_EPS, flat_weight: float = DEFAULT_FLAT_WEIGHT
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(y [B, N], omega [B], flat [B])``."""
    check_target_args(t_label, flat_eps, flat_weight)
    flat = flat_samples(deltas, mask, flat_eps)
    return soft_targets(deltas, mask, t_label), sample_weights(flat, flat_weight), flat


def kl_per_sample(y: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``KL(y_b || w_b)`` per sample ``[B]``; terms with ``y = 0`` (and padding) contribute 0."""
    y = y.to(w.dtype)
    pos = mask & (y > 0)
    ratio = torch.where(pos, y.clamp_min(_LOG_FLOOR).log() - w.clamp_min(_LOG_FLOOR).log(), torch.zeros_like(w))
    return (y * ratio).sum(1)


def weighted_kl(y: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, omega: torch.Tensor,
                eps: float = LOSS_EPS) -> torch.Tensor:
    """The objective: ``sum_b omega_b * KL(y_b || w_b) / (sum_b omega_b + eps)`` (a scalar)."""
    omega = omega.to(w.dtype)
    return (omega * kl_per_sample(y, w, mask)).sum() / (omega.sum() + eps)
