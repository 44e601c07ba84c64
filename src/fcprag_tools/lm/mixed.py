"""Mixed batches: per-sample adapter lists -> the union and the ``[B, K]`` weights that
:meth:`fcprag_plugin.slot.FusedSlot.mixed` switches on (every sample its own mixture, in one forward)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from fcprag_plugin.errors import MergeError


def adapter_key(adapter: Any) -> tuple:
    """How mixed batches tell adapters apart: by resolved path (``str`` / ``Path``), else by object identity."""
    return ("path", str(Path(adapter).resolve())) if isinstance(adapter, (str, Path)) else ("id", id(adapter))


def union_weights(per_sample_adapters: Sequence[Sequence[Any]], per_sample_weights: Sequence[Sequence[float]] | None
                  = None) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    """Per-sample adapter lists (+ weights ``w~``, default ones) -> (union, ``W [B, K]``, ``mask [B, K]``).

    Adapters are identified by :func:`adapter_key`, in order of first appearance.
    """
    union: list[Any] = []
    index: dict[Any, int] = {}
    entries: list[tuple[int, int, float]] = []  # (sample, position in the union, weight)
    if per_sample_weights is not None and len(per_sample_weights) != len(per_sample_adapters):
        raise MergeError(f"got adapter lists for {len(per_sample_adapters)} samples but weights for "
                         f"{len(per_sample_weights)}")
    for b, ads in enumerate(per_sample_adapters):
        ws = [1.0] * len(ads) if per_sample_weights is None else list(per_sample_weights[b])
        if len(ws) != len(ads):
            raise MergeError(f"sample {b}: {len(ads)} adapters but {len(ws)} weights")
        if not ads:
            raise MergeError(f"sample {b} has no adapters")
        for a, w in zip(ads, ws):
            i = index.setdefault(adapter_key(a), len(union))
            if i == len(union):
                union.append(a)
            entries.append((b, i, float(w)))
    W = torch.zeros(len(per_sample_adapters), len(union))
    mask = torch.zeros(len(per_sample_adapters), len(union), dtype=torch.bool)
    for b, i, w in entries:
        if mask[b, i]:
            raise MergeError(f"sample {b} lists adapter {union[i]!r} twice")
        W[b, i], mask[b, i] = w, True
    return union, W, mask
