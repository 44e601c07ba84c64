"""Validation metrics of a controller next to the uniform and random baselines (``docs/label-format.md``, "Outputs")."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..controller import FusionController
from ..features import masked_max, masked_mean
from .data import LabelTensors
from .targets import first_order_gain, kl_per_sample

_W_TIE = 1e-9


@torch.no_grad()
def collect_outputs(controller: FusionController, data: LabelTensors, batch_size: int = 512) -> dict[str, torch.Tensor]:
    """Run ``controller`` (eval mode, fp32: what metrics.json and the cross-validation read) over ``data``: ``w`` and
    ``wt`` (the merge weights ``w~``) ``[R, N_max]`` (0 on padding), ``g [R]``, ``tau [R]``."""
    was_training = controller.training
    controller.eval()
    R, N = data.mask.shape
    w, wt = torch.zeros(R, N), torch.zeros(R, N)
    g, tau = torch.zeros(R), torch.zeros(R)
    try:
        for b in data.batches(batch_size):
            out = controller(b.e_q, b.E_p, b.mask, b.side)
            w[b.index, : b.mask.shape[1]] = out.probabilities.float().cpu()
            wt[b.index, : b.mask.shape[1]] = out.merge_weights.float().cpu()
            g[b.index], tau[b.index] = out.g.float().cpu(), out.tau.float().cpu()
    finally:
        controller.train(was_training)
    return {"w": w, "wt": wt, "g": g, "tau": tau}


def average_ranks(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1-based average ranks of ``x [B, N]`` within each row's real entries (ties share their mean rank)."""
    xi, xj = x.unsqueeze(2), x.unsqueeze(1)
    mj = mask.unsqueeze(1)
    less = ((xj < xi) & mj).sum(2).to(torch.float64)
    equal = ((xj == xi) & mj).sum(2).to(torch.float64)
    return (less + (equal + 1) / 2).masked_fill(~mask, 0.0)


def spearman_per_sample(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spearman correlation per row ``[B]`` (float64) and a ``[B]`` bool of the rows where it is defined."""
    m = mask.to(torch.float64)
    ca, cb = ((r - masked_mean(r, mask).unsqueeze(1)) * m  # ranks centred on their row's mean, 0 on padding
              for r in (average_ranks(a, mask), average_ranks(b, mask)))
    va, vb = (ca * ca).sum(1), (cb * cb).sum(1)
    defined = (va > 1e-12) & (vb > 1e-12) & (mask.sum(1) >= 2)
    rho = (ca * cb).sum(1) / (va * vb).clamp_min(1e-300).sqrt()
    return rho.masked_fill(~defined, float("nan")), defined


def top1_credit(w: torch.Tensor, deltas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row ``[B]``: |argmax w & argmax delta| / |argmax w| (tie-aware top-1 agreement)."""
    top_w = (w >= masked_max(w, mask).unsqueeze(1) - _W_TIE) & mask
    top_d = (deltas >= masked_max(deltas, mask).unsqueeze(1)) & mask
    return (top_w & top_d).sum(1).to(torch.float64) / top_w.sum(1).clamp_min(1).to(torch.float64)


def entropy(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) per row of a masked distribution ``w [B, N]``."""
    p = w.to(torch.float64).masked_fill(~mask, 0.0)
    return -(torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))).sum(1)


def _mean(x: torch.Tensor) -> float | None:
    return float(x.mean()) if x.numel() else None


def _std(x: torch.Tensor) -> float | None:
    return float(x.std(unbiased=False)) if x.numel() else None


def metrics_from_outputs(w: torch.Tensor, g: torch.Tensor, tau: torch.Tensor, data: LabelTensors,
                         wt: torch.Tensor | None = None) -> dict[str, Any]:
    """All metrics from collected outputs, plain floats (None when undefined); ``wt`` (``w~``) adds ``gain``."""
    mask, deltas = data.mask, data.deltas
    y, omega, flat = data.y, data.omega.to(torch.float64), data.flat
    kl = kl_per_sample(y.to(torch.float64), w.to(torch.float64), mask)
    nonflat = ~flat
    rho, defined = spearman_per_sample(w, deltas, mask)
    ent = entropy(w, mask)
    n = mask.sum(1)
    multi = n >= 2
    ent_norm = ent[multi] / n[multi].to(torch.float64).log()
    wsum = float(omega.sum())
    g64, tau64 = g.to(torch.float64), tau.to(torch.float64)
    return {
        "n": int(len(data)), "n_nonflat": int(nonflat.sum()),
        "kl": float((omega * kl).sum() / wsum) if wsum > 0 else None, "kl_nonflat": _mean(kl[nonflat]),
        "top1": _mean(top1_credit(w, deltas, mask)[nonflat]), "spearman": _mean(rho[defined]),
        "spearman_n": int(defined.sum()), "g_mean": _mean(g64), "g_std": _std(g64), "tau_mean": _mean(tau64),
        "tau_std": _std(tau64), "entropy_mean": _mean(ent), "entropy_norm_mean": _mean(ent_norm),
        **({} if wt is None else {"gain": _mean(first_order_gain(wt.to(torch.float64), deltas, mask))}),
    }


def evaluate(controller: FusionController, data: LabelTensors, *, seed: int = 0, batch_size: int = 512
             ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, torch.Tensor]]]:
    """``(metrics, outputs)`` of ``controller`` (keyed by its mode, e.g. ``"learned"``; ``"scale_only"`` for uniform
    weights times a kappa other than 1) and of the uniform (PRAG) and random (untrained, seeded) baselines:
    ``metrics[name]`` a dict of floats, ``outputs[name]`` holds ``w, g, tau``."""
    c = controller.config
    name = "scale_only" if c.controller_mode == "uniform" and c.kappa != 1.0 else c.controller_mode
    models = {name: controller}
    base = {"uniform": dict(controller_mode="uniform", kappa=1.0, calib_scale=False, cv=None),
            "random": dict(controller_mode="random", seed=seed, kappa=1.0, cv=None)}
    models.update({k: FusionController(dataclasses.replace(c, **v)) for k, v in base.items() if k not in models})
    outputs = {k: collect_outputs(m, data, batch_size) for k, m in models.items()}
    metrics = {k: metrics_from_outputs(o["w"], o["g"], o["tau"], data, o["wt"]) for k, o in outputs.items()}
    return metrics, outputs
