"""The weights of one fusion, as one object from the controller to the merge and the logs.

:class:`FusionWeights` is what :meth:`FusionWeights.for_query` (the controller's prediction, or uniform) hands to
:func:`~fcprag_plugin.fusion.fuse`, the shims and their logs; :func:`is_uniform` is the one place that decides
whether a controller gives PRAG's uniform merge. :func:`check_weights` is the one check every merge applies.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import MergeError


def is_uniform(controller: Any) -> bool:
    """True when ``controller`` gives PRAG's uniform merge ``w~ = [1]*N``: no controller, or a ``uniform`` one
    (then no text is ever encoded)."""
    return controller is None or controller.config.mode == "uniform"


@dataclass(frozen=True)
class FusionWeights:
    """The controller's outputs for one query (N passages), immutable.

    Attributes:
        merge_weights: ``w~`` (N), what the merge multiplies each adapter by; all ones is PRAG's uniform merge.
        weights: ``w`` (N), a distribution over the passages (sums to 1).
        scores: ``s`` (N) in (0, 1); 0.5 each when uniform.
        g: the gate in [0, 1] (0 when uniform).
        tau: the temperature; NaN when there is no controller (:meth:`to_json` writes null).
        mode: the controller mode that produced them (``uniform``, ``learned``, ``random``, ``fixed``); the JSON
            key is ``controller_mode``, as in ``fusion.json`` and the shims' logs.
    """

    merge_weights: tuple[float, ...]
    weights: tuple[float, ...]
    scores: tuple[float, ...]
    g: float
    tau: float
    mode: str

    @property
    def n(self) -> int:
        return len(self.merge_weights)

    @property
    def uniform_merge(self) -> bool:
        """``w~ == [1]*N``: the merge is PRAG's (whatever produced the weights)."""
        return all(w == 1.0 for w in self.merge_weights)

    @classmethod
    def uniform(cls, n: int, tau: float = float("nan"), scale: float = 1.0) -> "FusionWeights":
        """PRAG's merge for ``n`` passages: ``w~ = [scale]*n`` (``scale`` 1, a uniform controller's ``kappa``
        otherwise), ``w = [1/n]*n``."""
        return cls((float(scale),) * n, (1.0 / n,) * n, (0.5,) * n, 0.0, float(tau), "uniform")

    @classmethod
    def from_output(cls, out: Any, mode: str, b: int = 0) -> "FusionWeights":
        """Sample ``b`` of a controller output (``scores``, ``weights``, ``merge_weights`` ``[B, N]``, ``g``, ``tau``
        ``[B]``, ``mask [B, N]``), its real passages only."""
        m = out.mask[b]
        return cls(tuple(out.merge_weights[b][m].tolist()), tuple(out.weights[b][m].tolist()),
                   tuple(out.scores[b][m].tolist()), float(out.g[b]), float(out.tau[b]), mode)

    @classmethod
    def for_query(cls, query: str, passages: Sequence[str], controller: Any, encoder: Any = None,
                  side: dict[str, Any] | None = None) -> "FusionWeights":
        """The weights for one query: uniform (see :func:`is_uniform`; a uniform controller's ``kappa`` scales
        them), else ``controller.predict`` with ``encoder`` (default: the controller's shared encoder) and the
        side-feature arguments ``side`` (:func:`side_inputs`)."""
        if is_uniform(controller):
            if controller is None:
                return cls.uniform(len(passages))
            return cls.uniform(len(passages), controller.config.tau_max, getattr(controller.config, "kappa", 1.0))
        if encoder is None:
            encoder = controller.encoder  # loaded once per process, shared
        return cls.from_output(controller.predict(query, passages, encoder, **(side or {})), controller.config.mode)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON (no NaN / inf: null): ``merge_weights``, ``weights``, ``scores``, ``g``, ``tau``,
        ``controller_mode``."""
        return finite_or_none({"merge_weights": list(self.merge_weights), "weights": list(self.weights),
                               "scores": list(self.scores), "g": self.g, "tau": self.tau,
                               "controller_mode": self.mode})


def side_inputs(controller: Any, *, adapters: Any = None, retrieval_ranks: Sequence[float] | None = None,
                retrieval_scores: Sequence[float] | None = None) -> dict[str, Any]:
    """The side-feature keyword arguments of ``controller.predict``: only those the controller was trained with
    (``config.side_features``). ``adapters``, a sequence of :class:`~fcprag_plugin.adapter.LoraAdapter` or a
    zero-argument callable returning one, is read only when ``adapter_stats`` is needed. A needed value that is
    None reaches ``predict``, which refuses it with a message naming the argument."""
    names = () if is_uniform(controller) else tuple(getattr(controller.config, "side_features", None) or ())
    out: dict[str, Any] = {}
    if "retrieval_rank" in names:
        out["retrieval_ranks"] = retrieval_ranks
    if "retrieval_score" in names:
        out["retrieval_scores"] = retrieval_scores
    if "adapter_stats" in names:
        out["adapter_stats"] = list(adapters() if callable(adapters) else adapters) if adapters is not None else None
    return out


def check_weights(weights: Any, n: int) -> list[float]:
    """Validated merge weights ``w~``: finite, 1-D, one per adapter (``n >= 1``), as float32-rounded Python floats
    (the values a float32 merge computes with). ``None`` is ``[1] * n`` (PRAG's uniform merge). Lists and tuples
    skip tensor ops (the per-query hot path); tensors and arrays are accepted too."""
    if n == 0:
        raise MergeError("no adapters to merge (N == 0)")
    if weights is None:
        return [1.0] * n
    vals: list[float] | None = None
    if isinstance(weights, (list, tuple)):
        try:
            vals = array("f", [float(v) for v in weights]).tolist()  # rounds to float32 like torch does
        except (TypeError, ValueError, OverflowError):
            vals = None
    if vals is None or len(vals) != n:
        w = torch.as_tensor(weights, dtype=torch.float32).detach().cpu()
        if w.ndim != 1 or w.shape[0] != n:
            raise MergeError(f"merge weights have shape {list(w.shape)}, expected [{n}] (one per adapter)")
        vals = w.tolist()
    if not all(map(math.isfinite, vals)):
        raise MergeError(f"merge weights must be finite, got {vals}")
    return vals


def finite_or_none(obj: Any) -> Any:
    """NaN / inf -> None, recursively through dicts, lists and tuples, so a record is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj
