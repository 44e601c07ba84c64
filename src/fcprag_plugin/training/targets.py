"""Training targets ``y = softmax(delta / T_label)``, flatness and sample weights, and the objectives "kl" and
"risk" (math only; defined in ``docs/label-format.md``, "Targets and objective")."""

from __future__ import annotations

import math

import torch

from ..errors import FcpragError
from ..features import masked_max, masked_mean, masked_min

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


def make_targets(deltas: torch.Tensor, mask: torch.Tensor, t_label: float = DEFAULT_T_LABEL,
                 flat_eps: float = DEFAULT_FLAT_EPS, flat_weight: float = DEFAULT_FLAT_WEIGHT
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``deltas [B, N]``, ``mask [B, N]`` -> ``(y [B, N], omega [B], flat [B])``: ``y`` zero on padding, ``flat``
    when ``max - min <= flat_eps`` (N = 1 always), ``omega`` ``flat_weight`` if flat else 1."""
    check_target_args(t_label, flat_eps, flat_weight)
    y = torch.softmax((deltas / t_label).masked_fill(~mask, float("-inf")), dim=1).masked_fill(~mask, 0.0)
    flat = (masked_max(deltas, mask) - masked_min(deltas, mask)) <= flat_eps
    return y, torch.ones_like(flat, dtype=torch.float32).masked_fill(flat, flat_weight), flat


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


def first_order_gain(w_tilde: torch.Tensor, deltas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i (w~_i - 1) delta_i`` per record ``[B]`` (padding ignored): the first-order gain in the label metric
    of the merge weights ``w~`` over PRAG's uniform merge (exactly 0 for ``w~ = 1``)."""
    u = (w_tilde - 1).masked_fill(~mask, 0.0)
    return (u * deltas.to(u.dtype).masked_fill(~mask, 0.0)).sum(1)


def risk_objective(w_tilde: torch.Tensor, deltas: torch.Tensor, mask: torch.Tensor, lam: float) -> torch.Tensor:
    """``J_b = sum_i (w~_i - 1) delta_i - lambda sum_i (w~_i - 1)^2`` per record ``[B]`` (to maximise)."""
    u = (w_tilde - 1).masked_fill(~mask, 0.0)
    return first_order_gain(w_tilde, deltas, mask) - lam * (u * u).sum(1)


def risk_loss(w_tilde: torch.Tensor, deltas: torch.Tensor, mask: torch.Tensor, lam: float) -> torch.Tensor:
    """The risk objective as a loss to minimise: ``-mean_b J_b`` (a scalar)."""
    return -risk_objective(w_tilde, deltas, mask, lam).mean()


def estimate_lambda(deltas: torch.Tensor, mask: torch.Tensor) -> float:
    """The risk objective's lambda: the pooled within-record standard deviation of the deltas over records with
    ``N_b >= 2`` (1.0 when every record is flat)."""
    d, m = deltas.to(torch.float64), mask.to(torch.float64)
    n = m.sum(1)
    keep = n >= 2
    if not bool(keep.any()):
        return 1.0
    ss = (((d - masked_mean(d, mask).unsqueeze(1)) * m) ** 2).sum(1)
    var = float(ss[keep].sum() / (n[keep] - 1).sum())
    return math.sqrt(var) if var > 0 else 1.0
