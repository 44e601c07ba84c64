"""The merge math, once (merge modes, slot writes, DyPRAG aggregation), over LoRA factors ``A_i [..., r_i, in]``,
``B_i [..., out, r_i]`` (in-place writers take ``B^T`` rows ``[..., r_i, out]``): scaled factors and sums are
computed in float32 (float64 for float64 inputs), in adapter order, and rounded once to the destination dtype."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..errors import MergeError


def check_equal_ranks(ranks: Sequence[Any], module: str, sources: Sequence[Any], what: str = "mode 'separate'",
                      shown: Sequence[int] | None = None) -> None:
    """``separate`` sums factors, so every adapter needs the same rank(s) (``ranks[i]``: an int, or a tuple per
    layer) in ``module``; else a :class:`MergeError` naming the module, the ranks (``shown``) and the adapters."""
    if any(r != ranks[0] for r in ranks):
        raise MergeError(f"{what} needs equal ranks per module; module '{module}' has ranks "
                         f"{list(shown if shown is not None else ranks)} (adapters {list(sources)}); use mode 'cat'")


def scaled_copy(dst: torch.Tensor, src: torch.Tensor, coef: float | torch.Tensor) -> None:
    """``dst[...] = coef * src``, computed in float32 (float64 for float64) and rounded once to ``dst``'s dtype;
    one pass in the usual same-device case. ``coef`` is a Python float or a tensor broadcasting against ``src``."""
    if isinstance(coef, torch.Tensor) and coef.device != dst.device:
        coef = coef.to(dst.device)
    if src.device != dst.device:
        src = src.to(dst.device)  # place packed adapters on the model's device to skip this
    if src.dtype in (torch.float32, dst.dtype) or (src.dtype == torch.float64 and dst.dtype == torch.float32):
        torch.mul(src, coef, out=dst)  # computed in opmath (float32 for half types), rounded once to dst's dtype
    elif dst.dtype in (torch.float32, torch.float64):
        dst.copy_(src)  # widening is exact; a direct mul would round the product to src's dtype
        dst.mul_(coef)
    else:
        torch.mul(src.float(), coef, out=dst)


def weighted_sum_into(dst: torch.Tensor, srcs: Sequence[torch.Tensor], coefs: Sequence[float | torch.Tensor],
                      scratch: Callable[[str, torch.Tensor, torch.dtype], torch.Tensor] | None = None,
                      key: str = "") -> None:
    """``dst[...] = sum_i coefs[i] * srcs[i]``, accumulated in order in float32 (float64 when any input is),
    rounded once. ``scratch(name, like, dtype)`` hands out reusable temporaries (default: fresh ones)."""
    if scratch is None:
        scratch = lambda name, like, dt: torch.empty(like.shape, dtype=dt, device=like.device)  # noqa: E731
    adt = torch.float64 if torch.float64 in (dst.dtype, *(s.dtype for s in srcs)) else torch.float32
    acc = dst if dst.dtype == adt else scratch(key + "acc", dst, adt)
    tmp = scratch(key + "tmp", dst, adt) if len(srcs) > 1 else None
    for i, (src, c) in enumerate(zip(srcs, coefs)):
        scaled_copy(acc if i == 0 else tmp, src, c)
        if i:
            acc.add_(tmp)
    if acc is not dst:
        dst.copy_(acc)


def weighted_sum(srcs: Sequence[torch.Tensor], coefs: Sequence[float | torch.Tensor],
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """``sum_i coefs[i] * srcs[i]`` as a new tensor of ``dtype`` (default: the first input's)."""
    out = torch.empty(srcs[0].shape, dtype=dtype or srcs[0].dtype, device=srcs[0].device)
    weighted_sum_into(out, srcs, coefs)
    return out


def cat(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], coefs: Sequence[float | torch.Tensor],
        dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = cat_i(coefs_i A_i)`` ``[..., sum r_i, in]``, ``B = cat_i(B_i)`` ``[..., out, sum r_i]`` (``B A = sum_i
    coefs_i B_i A_i`` exactly; ranks may differ), in ``dtype`` (default: the first A's / B's) on its device."""
    dt, dev = dtype or As[0].dtype, As[0].device
    acc = torch.float64 if torch.float64 in (dt, *(a.dtype for a in As)) else torch.float32
    # one torch.cat per factor (not a copy per adapter): the scaled copies are computed in ``acc`` and rounded once
    A = torch.cat([a.to(dev, acc) * (c.to(dev) if isinstance(c, torch.Tensor) else c) for a, c in zip(As, coefs)],
                  dim=-2)
    B = torch.cat([b.to(Bs[0].device, dtype or Bs[0].dtype) for b in Bs], dim=-1)
    return A.to(dt), B


def separate(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], a_coefs: Sequence[float | torch.Tensor],
             b_coefs: Sequence[float | torch.Tensor], dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = sum_i a_i A_i``, ``B = sum_i b_i B_i`` (equal ranks: see :func:`check_equal_ranks`)."""
    return weighted_sum(As, a_coefs, dtype), weighted_sum(Bs, b_coefs, dtype)


def svd(A: torch.Tensor, B: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The best rank-``k`` factors of ``B A`` (``A [R, in]``, ``B [out, R]``) in float64 without forming it (thin
    QRs ``B = Q_b R_b``, ``A^T = Q_a R_a``; SVD of the ``[R, R]`` core ``R_b R_a^T``). Returns ``(A_k [k', in],
    B_k [out, k'], dropped, total)`` squared Frobenius norms, ``k' = min(k, R)``."""
    A, B = A.double(), B.double()
    Qb, Rb = torch.linalg.qr(B)  # [out, R], [R, R]
    Qa, Ra = torch.linalg.qr(A.T)  # [in, R], [R, R]
    U, S, Vh = torch.linalg.svd(Rb @ Ra.T)
    kk = min(k, S.shape[0])
    sq = S[:kk].sqrt()
    newB = (Qb @ U[:, :kk]) * sq  # [out, k]
    newA = sq[:, None] * (Vh[:kk] @ Qa.T)  # [k, in]
    return newA, newB, float((S[kk:] ** 2).sum()), float((S ** 2).sum())
