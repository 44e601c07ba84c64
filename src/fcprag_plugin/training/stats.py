"""Statistics over questions (groups of records): grouped folds, group means, bootstrap CIs, loss shares."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

BOOTSTRAP = 2000
Z95 = 1.959963984540054  # the two-sided 95% normal quantile


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n`` (``(0, 1)`` for ``n = 0``)."""
    if n <= 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    den = 1 + z2 / n
    center = (p + z2 / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / den
    return max(0.0, center - half), min(1.0, center + half)


def loss_share(values: torch.Tensor, groups: Sequence[str], margin: float) -> dict[str, Any]:
    """The share of questions whose mean of ``values [R]`` (NaN rows ignored) is below ``-margin``, with its 95%
    Wilson CI: ``{"share", "ci95", "questions"}`` (share None when no question has a value)."""
    per_q = group_means(values, groups)
    per_q = per_q[~torch.isnan(per_q)]
    n, k = len(per_q), int((per_q < -margin).sum())
    return {"share": k / n if n else None, "ci95": list(wilson_interval(k, n)), "questions": n}


def group_kfold(groups: Sequence[str], k: int, seed: int) -> list[list[int]]:
    """Row indices of ``k`` folds (fewer with fewer groups), all rows of a group in one fold; the seeded shuffled
    groups are dealt largest-first onto the fold with the fewest rows."""
    by_group: dict[str, list[int]] = {}
    for i, gk in enumerate(groups):
        by_group.setdefault(gk, []).append(i)
    keys = list(by_group)
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    order = sorted((keys[i] for i in perm), key=lambda g: -len(by_group[g]))  # stable: shuffled within a size
    folds: list[list[int]] = [[] for _ in range(min(k, len(keys)))]
    for gk in order:
        min(folds, key=len).extend(by_group[gk])
    return [sorted(f) for f in folds]


def bootstrap_ci(values: torch.Tensor, groups: Sequence[str], seed: int, level: float = 0.95,
                 n_boot: int = BOOTSTRAP) -> tuple[float, float]:
    """Percentile-bootstrap CI at ``level`` of the record mean of ``values [R]``, resampling whole groups."""
    index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    gid = torch.tensor([index[g] for g in groups])
    G = len(index)
    sums = torch.zeros(G, dtype=torch.float64).index_add_(0, gid, values.to(torch.float64))
    counts = torch.bincount(gid, minlength=G).to(torch.float64)
    idx = torch.randint(0, G, (n_boot, G), generator=torch.Generator().manual_seed(seed))
    means = sums[idx].sum(1) / counts[idx].sum(1)
    q = (1 - level) / 2
    return tuple(torch.quantile(means, torch.tensor([q, 1 - q], dtype=torch.float64)).tolist())


def group_means(values: torch.Tensor, groups: Sequence[str]) -> torch.Tensor:
    """``values [R, ...]`` averaged per group (NaN rows ignored) -> ``[G, ...]`` in first-appearance order."""
    keys = list(dict.fromkeys(groups))
    index = {g: i for i, g in enumerate(keys)}
    gid = torch.tensor([index[g] for g in groups])
    ok = ~torch.isnan(values)
    sums = torch.zeros(len(keys), *values.shape[1:], dtype=torch.float64).index_add_(0, gid,
                                                                                  values.nan_to_num(0.0).double())
    counts = torch.zeros_like(sums).index_add_(0, gid, ok.double())
    return sums / counts  # NaN where a group has no measurement
