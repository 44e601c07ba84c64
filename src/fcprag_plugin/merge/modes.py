"""The built-in merge modes: ``fn(adapters, w, **options) -> MergeResult`` on validated inputs (``w``: ``w~``)."""

from __future__ import annotations

import math
from array import array
from typing import Callable, Sequence

import torch

from ..adapter import LoraAdapter, LoraModule
from ..errors import MergeError
from . import factors
from .core import MergeResult, register_merge_mode


def _merged_config(adapters: Sequence[LoraAdapter], r: int) -> dict:
    """The first adapter's config for a merge of rank ``r`` and scaling 1."""
    drop = {"rank_pattern", "alpha_pattern", "use_rslora"}
    return {**{k: v for k, v in adapters[0].config.items() if k not in drop}, "r": r, "lora_alpha": r}


def _per_module(adapters: Sequence[LoraAdapter], w: tuple[float, ...], mode: str,
                merge: Callable[[str, list[LoraModule]], tuple[torch.Tensor, torch.Tensor]]) -> MergeResult:
    """``merge(module name, its N LoraModules) -> (A, B)`` over every target module; scaling 1."""
    modules = {name: LoraModule(*merge(name, [ad.modules[name] for ad in adapters]), 1.0)
               for name in adapters[0].target_modules}
    r = next(iter(modules.values())).rank
    merged = LoraAdapter(modules, _merged_config(adapters, r), f"merge[{mode},N={len(adapters)}]")
    return MergeResult(merged, w, mode)


@register_merge_mode("cat")
def merge_cat(adapters: Sequence[LoraAdapter], w: tuple[float, ...], *, dtype: torch.dtype | None = None
              ) -> MergeResult:
    """Exact: ``A* = cat_i(w~_i s_i A_i)`` ``[sum r_i, in]``, ``B* = cat_i(B_i)`` ``[out, sum r_i]``, scaling 1;
    equals peft's ``add_weighted_adapter(weights=w~, combination_type="cat")``; ranks may differ."""
    return _per_module(adapters, w, "cat", lambda name, parts: factors.cat(
        [m.A for m in parts], [m.B for m in parts], [wi * m.scaling for wi, m in zip(w, parts)],
        dtype=dtype or torch.float32))


@register_merge_mode("separate")
def merge_separate(adapters: Sequence[LoraAdapter], w: tuple[float, ...], *, dtype: torch.dtype | None = None
                   ) -> MergeResult:
    """DyPRAG's: ``A* = sum_i u_i s_i A_i``, ``B* = sum_i u_i B_i``, ``u = w~/N`` (uniform: ``mean(B) @ mean(A)``,
    not the mean of the updates); all adapters need equal rank per module."""
    u = array("f", [wi / len(adapters) for wi in w]).tolist()  # float32 w~ / N

    def merge(name: str, parts: list[LoraModule]) -> tuple[torch.Tensor, torch.Tensor]:
        factors.check_equal_ranks([m.rank for m in parts], name, [ad.source for ad in adapters])
        return factors.separate([m.A for m in parts], [m.B for m in parts],
                                [ui * m.scaling for ui, m in zip(u, parts)], u, dtype=dtype or torch.float32)

    return _per_module(adapters, w, "separate", merge)


@register_merge_mode("svd")
def merge_svd(adapters: Sequence[LoraAdapter], w: tuple[float, ...], *, rank: int | None = None,
              dtype: torch.dtype | None = None) -> MergeResult:
    """The exact ``cat`` update compressed to rank ``k`` (default: the largest input rank), never forming dW;
    ``info["rel_error"]``: the relative Frobenius error over all modules (``rel_error_per_module``: per module)."""
    k = rank if rank is not None else max(max(ad.ranks.values()) for ad in adapters)
    if k < 1:
        raise MergeError(f"svd rank must be >= 1, got {k}")
    exact = merge_cat(adapters, w, dtype=torch.float64 if dtype is None else None).adapter  # exactness in fp64
    out_dtype = dtype or torch.float32
    modules, per_module = {}, {}
    err2 = tot2 = 0.0
    for name, m in exact.modules.items():
        newA, newB, e2, t2 = factors.svd(m.A, m.B, k)
        err2, tot2 = err2 + e2, tot2 + t2
        per_module[name] = math.sqrt(e2 / t2) if t2 > 0 else 0.0
        modules[name] = LoraModule(newA.to(out_dtype), newB.to(out_dtype), 1.0)
    rel = math.sqrt(err2 / tot2) if tot2 > 0 else 0.0
    merged = LoraAdapter(modules, _merged_config(adapters, k), f"merge[svd,k={k},N={len(adapters)}]")
    return MergeResult(merged, w, "svd", {"rank": k, "rel_error": rel, "rel_error_per_module": per_module})
