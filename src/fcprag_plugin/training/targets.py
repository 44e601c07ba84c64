"""Training targets and the objective (math only, no I/O).

    y_b     = softmax(delta_b / T_label)                  over the real passages of sample b
    flat_b  = max(delta_b) - min(delta_b) <= eps          nothing to learn about the ranking
    omega_b = flat_weight if flat_b else 1
    loss    = sum_b omega_b * KL(y_b || w_b) / (sum_b omega_b + eps)            objective "kl" (the paper's)

The risk-aware objective (the paper's appendix, ``sum_i w_i mu_i - lambda sigma^2 sum_i w_i^2``, written for the
deviation from PRAG's merge ``u_i = w~_i - 1``) maximises per record

    J_b = sum_i u_i delta_i - lambda sum_i u_i^2                                   objective "risk"

``sum_i u_i delta_i`` is the first-order change of the label metric when the merge moves from uniform to ``w~``
(the leave-one-out delta is the metric's slope in adapter i's weight); the penalty keeps the step where that
linearisation and the noisy labels can be trusted. The loss is ``-mean_b J_b``. For a fixed total weight the
per-record optimum is ``u_i = (delta_i - mean_j delta_j) / (2 lambda)``, so lambda sets how far one noisy label may
move a weight: :func:`estimate_lambda` takes the pooled within-record standard deviation of the deltas, so a
passage one standard deviation better than its set's average gets ``w~ = 1.5`` at the optimum, and one worse gets
0.5 (a deviation the size of the label noise cannot push a weight past 0 or 2).
"""

from __future__ import annotations

import math

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
    """lambda for the risk objective from the labels: the pooled within-record standard deviation of the deltas,
    ``sqrt(sum_b sum_i (delta_bi - mean_b)^2 / sum_b (N_b - 1))`` over records with ``N_b >= 2`` (the scale of the
    differences the controller is asked to act on, noise included). Falls back to 1.0 when every record is flat."""
    m = mask.to(torch.float64)
    d = deltas.to(torch.float64) * m
    n = m.sum(1)
    keep = n >= 2
    if not bool(keep.any()):
        return 1.0
    mean = d.sum(1) / n.clamp_min(1)
    ss = (((d - mean.unsqueeze(1)) * m) ** 2).sum(1)
    var = float(ss[keep].sum() / (n[keep] - 1).sum())
    return math.sqrt(var) if var > 0 else 1.0


def best_kappa(w_tilde: torch.Tensor, deltas: torch.Tensor, mask: torch.Tensor, lam: float) -> float:
    """The global scale ``kappa`` maximising ``sum_b J_b`` for merge weights ``kappa * w~`` (closed form:
    ``kappa = (sum w~ delta + 2 lambda sum w~) / (2 lambda sum w~^2)``), floored at 0.05."""
    m = mask.to(torch.float64)
    wt, d = w_tilde.to(torch.float64) * m, deltas.to(torch.float64) * m
    num = float((wt * d).sum() + 2 * lam * wt.sum())
    den = float(2 * lam * (wt * wt).sum())
    return max(0.05, num / den) if den > 0 else 1.0
