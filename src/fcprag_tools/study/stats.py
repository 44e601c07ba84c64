"""The study's one statistic: a paired difference over questions with its percentile-bootstrap 95% CI (the
library's :func:`fcprag_plugin.training.stats.bootstrap_ci`, each question its own group)."""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from fcprag_plugin.training import BOOTSTRAP, bootstrap_ci


def paired(diffs: Sequence[float], seed: str) -> tuple[float, list[float]]:
    """``(mean, [lo, hi])`` of the per-question differences ``diffs``; the resampling is seeded by ``seed``."""
    v = torch.tensor([float(d) for d in diffs], dtype=torch.float64)
    if len(v) == 0:
        return float("nan"), [float("nan"), float("nan")]
    lo, hi = bootstrap_ci(v, [str(i) for i in range(len(v))], zlib.crc32(seed.encode()), 0.95, BOOTSTRAP)
    return float(v.mean()), [float(lo), float(hi)]
