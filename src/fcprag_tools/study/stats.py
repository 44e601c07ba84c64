"""The study's statistics over questions, each question its own group (the library's
:func:`fcprag_plugin.training.stats.bootstrap_ci`): a paired difference, or a mean, with its percentile-bootstrap CI;
what a paired comparison can detect (:func:`detectable`)."""

from __future__ import annotations

import math
import statistics
import zlib
from statistics import NormalDist
from typing import Any, Sequence

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


def detectable(diffs: Sequence[float], level: float, target: float, power: float = 0.8) -> dict[str, Any]:
    """What a paired comparison of ``diffs`` (one per question) can see at two-sided ``level`` and ``power``:
    ``mde = (z_{1-a/2} + z_power) * sd / sqrt(n)`` (``a = 1 - level``, ``sd`` the sample SD of ``diffs``) and
    ``n_needed = ceil(((z_{1-a/2} + z_power) * sd / target)^2)`` for a true difference ``target`` (the normal
    approximation of the paired test). ``{"mde", "n_needed", "sd", "n", "n_nonzero"}``; ``mde`` and ``n_needed`` are
    None when fewer than two questions or every difference is the same (no spread to size a test from)."""
    v = [float(d) for d in diffs]
    n = len(v)
    sd = statistics.stdev(v) if n >= 2 else 0.0
    out: dict[str, Any] = {"mde": None, "n_needed": None, "sd": sd, "n": n, "n_nonzero": sum(d != 0 for d in v)}
    if n < 2 or sd == 0.0:
        return out
    z = NormalDist().inv_cdf(1 - (1 - level) / 2) + NormalDist().inv_cdf(power)
    out["mde"] = z * sd / math.sqrt(n)
    out["n_needed"] = math.ceil((z * sd / target) ** 2) if target > 0 else None
    return out
