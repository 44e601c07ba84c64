"""The study's statistics over questions, each question its own group (the library's
:func:`fcprag_plugin.training.stats.bootstrap_ci`): a paired difference, or a mean, with its percentile-bootstrap CI."""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from fcprag_plugin.training import BOOTSTRAP, bootstrap_ci


def paired(diffs: Sequence[float], seed: str, level: float = 0.95, n_boot: int = BOOTSTRAP
           ) -> tuple[float, list[float]]:
    """``(mean, [lo, hi])`` of the per-question values ``diffs`` (differences, or values for a plain mean) with the
    ``level`` percentile-bootstrap interval of ``n_boot`` resamples, seeded by ``seed``."""
    v = torch.tensor([float(d) for d in diffs], dtype=torch.float64)
    if len(v) == 0:
        return float("nan"), [float("nan"), float("nan")]
    lo, hi = bootstrap_ci(v, [str(i) for i in range(len(v))], zlib.crc32(seed.encode()), level, n_boot)
    return float(v.mean()), [float(lo), float(hi)]
