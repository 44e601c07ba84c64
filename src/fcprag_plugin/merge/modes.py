"""The built-in merge modes. Each is ``fn(adapters, w, **options) -> MergeResult`` on validated inputs."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..adapter import LoraAdapter, LoraModule
from ..errors import MergeError
from .core import MergeResult, register_merge_mode


def _merged_config(adapters: Sequence[LoraAdapter], **extra) -> dict:
    cfg = {k: v for k, v in adapters[0].config.items() if k not in {"rank_pattern", "alpha_pattern", "use_rslora"}}
    cfg.update(extra)
    return cfg


def _out_dtype(adapters: Sequence[LoraAdapter], dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None else torch.float32


@register_merge_mode("cat")
def merge_cat(adapters: Sequence[LoraAdapter], w: torch.Tensor, *, dtype: torch.dtype | None = None) -> MergeResult:
    """Exact: ``A* = cat_i(w~_i s_i A_i)`` ``[sum r_i, in]``, ``B* = cat_i(B_i)`` ``[out, sum r_i]``, scaling 1.

    Equals peft's ``add_weighted_adapter(weights=w~, combination_type="cat")``; ranks may differ.
    """
    out_dtype = _out_dtype(adapters, dtype)
    modules = {}
    for name in adapters[0].target_modules:
        parts = [ad.modules[name] for ad in adapters]
        A = torch.cat([(float(wi) * m.scaling) * m.A.float() for wi, m in zip(w.tolist(), parts)], dim=0)
        B = torch.cat([m.B.float() for m in parts], dim=1)
        modules[name] = LoraModule(A.to(out_dtype), B.to(out_dtype), 1.0)
    r = next(iter(modules.values())).rank
    merged = LoraAdapter(modules, _merged_config(adapters, r=r, lora_alpha=r), f"merge[cat,N={len(adapters)}]")
    return MergeResult(merged, w, "cat")


@register_merge_mode("separate")
def merge_separate(
    adapters: Sequence[LoraAdapter], w: torch.Tensor, *, dtype: torch.dtype | None = None
) -> MergeResult:
    """DyPRAG-compatible: ``A* = sum_i u_i s_i A_i``, ``B* = sum_i u_i B_i``, ``u = w~/N`` (sums to 1 if w~ does N).

    Uniform weights reproduce DyPRAG's ``mean(B) @ mean(A)``. This is *not* the mean of the updates:
    ``B* A* = sum_i sum_j u_i u_j s_j B_i A_j`` has cross terms ``i != j``. Per-adapter scalings are folded
    into A so adapters with different ``alpha/r`` combine consistently. All adapters need equal rank per module.
    """
    out_dtype = _out_dtype(adapters, dtype)
    u = (w / len(adapters)).tolist()
    modules = {}
    for name in adapters[0].target_modules:
        parts = [ad.modules[name] for ad in adapters]
        ranks = [m.rank for m in parts]
        if len(set(ranks)) != 1:
            raise MergeError(f"mode 'separate' needs equal ranks per module; module '{name}' has ranks {ranks} "
                             f"(adapters {[ad.source for ad in adapters]}); use mode 'cat'")
        A = sum((ui * m.scaling) * m.A.float() for ui, m in zip(u, parts))
        B = sum(ui * m.B.float() for ui, m in zip(u, parts))
        modules[name] = LoraModule(A.to(out_dtype), B.to(out_dtype), 1.0)
    r = next(iter(modules.values())).rank
    merged = LoraAdapter(modules, _merged_config(adapters, r=r, lora_alpha=r), f"merge[separate,N={len(adapters)}]")
    return MergeResult(merged, w, "separate")


@register_merge_mode("svd")
def merge_svd(
    adapters: Sequence[LoraAdapter], w: torch.Tensor, *, rank: int | None = None, dtype: torch.dtype | None = None
) -> MergeResult:
    """The exact ``cat`` update compressed to rank ``k`` (default: the largest input rank), never forming dW.

    ``B_cat = Q_b R_b`` and ``A_cat^T = Q_a R_a`` (thin QR), so ``dW = Q_b (R_b R_a^T) Q_a^T``; the SVD of the
    small ``[R, R]`` core gives the best rank-k factors. ``info["rel_error"]`` is the relative Frobenius error
    over all modules, ``info["rel_error_per_module"]`` per module.
    """
    k = rank if rank is not None else max(max(ad.ranks.values()) for ad in adapters)
    if k < 1:
        raise MergeError(f"svd rank must be >= 1, got {k}")
    exact = merge_cat(adapters, w, dtype=torch.float64 if dtype is None else None).adapter  # exactness in fp64
    out_dtype = _out_dtype(adapters, dtype)
    modules, per_module = {}, {}
    err2 = tot2 = 0.0
    for name, m in exact.modules.items():
        A, B = m.A.double(), m.B.double()
        Qb, Rb = torch.linalg.qr(B)  # [out, R], [R, R]
        Qa, Ra = torch.linalg.qr(A.T)  # [in, R], [R, R]
        U, S, Vh = torch.linalg.svd(Rb @ Ra.T)
        kk = min(k, S.shape[0])
        sq = S[:kk].sqrt()
        newB = (Qb @ U[:, :kk]) * sq  # [out, k]
        newA = sq[:, None] * (Vh[:kk] @ Qa.T)  # [k, in]
        e2, t2 = float((S[kk:] ** 2).sum()), float((S ** 2).sum())
        err2, tot2 = err2 + e2, tot2 + t2
        per_module[name] = math.sqrt(e2 / t2) if t2 > 0 else 0.0
        modules[name] = LoraModule(newA.to(out_dtype), newB.to(out_dtype), 1.0)
    rel = math.sqrt(err2 / tot2) if tot2 > 0 else 0.0
    merged = LoraAdapter(modules, _merged_config(adapters, r=k, lora_alpha=k), f"merge[svd,k={k},N={len(adapters)}]")
    return MergeResult(merged, w, "svd", {"rank": k, "rel_error": rel, "rel_error_per_module": per_module})
