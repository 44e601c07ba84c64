"""The weights of one fusion (:class:`FusionWeights`), from the controller to the merge and the logs, and
:func:`check_weights`, the one check every merge applies."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import MergeError
from .fileio import finite_or_none


def is_uniform(controller: Any) -> bool:
    """Whether ``controller`` gives ``w~ = [kappa]*N`` (None: PRAG's merge; mode ``uniform``): no text is encoded."""
    return controller is None or controller.config.controller_mode == "uniform"


@dataclass(frozen=True)
class FusionWeights:
    """One query's weights (N passages): ``merge_weights`` ``w~`` (float32-rounded; all ones: PRAG's sum),
    ``probabilities`` ``w`` (sum 1), ``scores``, gate ``g``, ``tau`` (uniform: 0.5, 0, None), ``controller_mode``."""

    merge_weights: tuple[float, ...]
    probabilities: tuple[float, ...]
    scores: tuple[float, ...]
    g: float
    tau: float | None
    controller_mode: str

    @property
    def n(self) -> int:
        return len(self.merge_weights)

    @property
    def uniform_merge(self) -> bool:
        """``w~ == [1]*N``: the merge is PRAG's (whatever produced the weights)."""
        return all(w == 1.0 for w in self.merge_weights)

    @classmethod
    def uniform(cls, n: int, scale: float = 1.0) -> "FusionWeights":
        """Uniform weights for ``n`` passages: ``w~ = [scale]*n`` (1: PRAG's merge), ``w = [1/n]*n``."""
        return cls(check_weights([scale] * n, n), (1.0 / n,) * n, (0.5,) * n, 0.0, None, "uniform")

    @classmethod
    def from_output(cls, out: Any, controller_mode: str, b: int = 0) -> "FusionWeights":
        """Sample ``b`` of a controller output (``scores``, ``probabilities``, ``merge_weights`` ``[B, N]``, ``g``,
        ``tau`` ``[B]``, ``mask [B, N]``), its real passages only."""
        m = out.mask[b]
        merge_weights = out.merge_weights[b][m].tolist()
        return cls(check_weights(merge_weights, len(merge_weights)), tuple(out.probabilities[b][m].tolist()),
                   tuple(out.scores[b][m].tolist()), float(out.g[b]), float(out.tau[b]), controller_mode)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON of every field (``tau`` null when uniform)."""
        return finite_or_none({"merge_weights": list(self.merge_weights), "probabilities": list(self.probabilities),
                               "scores": list(self.scores), "g": self.g, "tau": self.tau,
                               "controller_mode": self.controller_mode})


def side_inputs(controller: Any, *, adapters: Any = None, retrieval_ranks: Sequence[float] | None = None,
                retrieval_scores: Sequence[float] | None = None) -> dict[str, Any]:
    """The side-feature keyword arguments of ``controller.predict`` the controller was trained with (None values
    included: ``predict`` decides). ``adapters`` (:class:`~fcprag_plugin.adapter.LoraAdapter` s, or a callable
    returning them) are read only for ``adapter_stats``."""
    names = () if is_uniform(controller) else tuple(getattr(controller.config, "side_features", None) or ())
    stats = lambda: list(adapters() if callable(adapters) else adapters) if adapters is not None else None  # noqa
    return {key: value() for name, key, value in (("retrieval_rank", "retrieval_ranks", lambda: retrieval_ranks),
                                                  ("retrieval_score", "retrieval_scores", lambda: retrieval_scores),
                                                  ("adapter_stats", "adapter_stats", stats)) if name in names}


def check_weights(weights: Any, n: int) -> tuple[float, ...]:
    """Validated merge weights ``w~``: finite, 1-D, one per adapter (``n >= 1``), as a tuple of float32-rounded
    Python floats; ``None`` is ``[1] * n``. Lists and tuples skip tensor ops (the hot path); tensors work too."""
    if n == 0:
        raise MergeError("no adapters to merge (N == 0)")
    if weights is None:
        return (1.0,) * n
    try:  # rounds to float32 like torch does
        vals = array("f", [float(v) for v in weights]).tolist() if isinstance(weights, (list, tuple)) else None
    except (TypeError, ValueError, OverflowError):
        vals = None
    if vals is None or len(vals) != n:
        w = torch.as_tensor(weights, dtype=torch.float32).detach().cpu()
        if w.ndim != 1 or w.shape[0] != n:
            raise MergeError(f"merge weights have shape {list(w.shape)}, expected [{n}] (one per adapter)")
        vals = w.tolist()
    if not all(map(math.isfinite, vals)):
        raise MergeError(f"merge weights must be finite, got {vals}")
    return tuple(vals)
