"""The weights of one fusion: :func:`weigh` (the one call of ``fuse``, ``fuse_into``, both host shims and ``fcprag
study``) turns a controller, a query and its passages into :class:`FusionWeights`, for the merge and the logs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .controller import FusionController, load_controller
from .fileio import finite_or_none
from .merge.core import check_weights


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
    def from_output(cls, out: Any, controller_mode: str) -> "FusionWeights":
        """The one query of a controller output (``scores``, ``probabilities``, ``merge_weights`` ``[1, N]``, ``g``,
        ``tau`` ``[1]``, ``mask [1, N]``), its real passages only."""
        m = out.mask[0]
        merge_weights = out.merge_weights[0][m].tolist()
        return cls(check_weights(merge_weights, len(merge_weights)), tuple(out.probabilities[0][m].tolist()),
                   tuple(out.scores[0][m].tolist()), float(out.g[0]), float(out.tau[0]), controller_mode)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON of every field (``tau`` null when uniform)."""
        return finite_or_none(asdict(self))  # (its tuples become lists)


def weigh(controller: FusionController | str | Path | None, query: str, passages: Sequence[str], *,
          encoder: Any = None, adapters: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
          retrieval_ranks: Sequence[float] | None = None, retrieval_scores: Sequence[float] | None = None
          ) -> FusionWeights:
    """The weights of ``query`` and its N ``passages`` under ``controller`` (a ``FusionController``, its directory,
    read once per process, or None: PRAG's sum, ``w~ = [1]*N``); a ``uniform`` one encodes no text, the others embed
    with ``encoder`` (default: the controller's). ``adapters`` (``LoraAdapter`` s, or a callable returning them, read
    when the controller ``needs_adapters``) give ``adapter_stats`` and meet its recipe check (a warning, once).
    ``retrieval_ranks``, ``retrieval_scores``: one number per passage (missing: equal, a ``UserWarning`` once)."""
    ctrl = load_controller(controller)
    if ctrl is None:
        return FusionWeights.uniform(len(passages))
    if adapters is not None and (not callable(adapters) or ctrl.needs_adapters):
        adapters = list(adapters() if callable(adapters) else adapters)  # read once: the recipe and the statistics
        ctrl.check_adapters(adapters)  # another recipe than the controller's: a warning, once
    if is_uniform(ctrl):
        ctrl.warn_if_unproven()
        return FusionWeights.uniform(len(passages), ctrl.config.kappa)
    out = ctrl.predict(query, passages, encoder, retrieval_ranks=retrieval_ranks, retrieval_scores=retrieval_scores,
                       adapter_stats=None if callable(adapters) else adapters)
    return FusionWeights.from_output(out, ctrl.config.controller_mode)
