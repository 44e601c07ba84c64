"""``fuse()``: texts -> encoder -> controller -> merge weights -> merged adapter; ``fuse_into()``: the same
weights put into a live model until the returned :class:`LiveFusion` is closed."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .adapter import LoraAdapter
from .controller import FusionController
from .encoding import is_blank
from .errors import FusionInputError
from .slot import AdapterStore, FusedSlot, PackedAdapter, pack_adapter
from .merge import MergeResult, merge_adapters
from .fileio import finite_or_none
from .weights import FusionWeights, weigh

logger = logging.getLogger(__name__)


class _WeightsView:
    """Read access to a fusion's :class:`FusionWeights` (``merge_weights`` ``w~``, ``probabilities`` ``w``)."""

    fusion_weights: FusionWeights

    merge_weights = property(lambda self: list(self.fusion_weights.merge_weights))
    probabilities = property(lambda self: list(self.fusion_weights.probabilities))
    scores = property(lambda self: list(self.fusion_weights.scores))
    g = property(lambda self: self.fusion_weights.g)
    tau = property(lambda self: self.fusion_weights.tau)
    controller_mode = property(lambda self: self.fusion_weights.controller_mode)


@dataclass
class FusionResult(_WeightsView):
    """What :func:`fuse` produced: the merged ``adapter``, its weights, the merge ``mode`` and its ``info``."""

    adapter: LoraAdapter
    fusion_weights: FusionWeights
    mode: str
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON (NaN / inf as null): the weights, ``mode``, ``controller_mode`` and the merge's info."""
        fw = self.fusion_weights.to_json()
        controller_mode = fw.pop("controller_mode")
        extra = {k: v for k, v in self.info.items() if isinstance(v, (int, float, str, list, dict))}
        return finite_or_none({**fw, "mode": self.mode, "controller_mode": controller_mode, **extra})


@dataclass
class LiveFusion(_WeightsView):
    """A fusion switched on in a live model (:func:`fuse_into`) until :meth:`close` or the end of a ``with`` block;
    ``slot``: the model's :class:`~fcprag_plugin.slot.FusedSlot` holding the update."""

    fusion_weights: FusionWeights
    mode: str
    slot: FusedSlot

    @property
    def active(self) -> bool:
        return self.slot.active

    def close(self) -> None:
        """Switch the fusion off (idempotent); the slot stays on the model for the next fusion."""
        self.slot.deactivate()

    def __enter__(self) -> "LiveFusion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_live(adapters: Sequence[Any], model: Any) -> list[Any]:
    """Names of the live ``model``'s adapters -> read from it; paths and (packed) adapters pass through."""
    live = set(getattr(model, "peft_config", None) or {})  # (model None: no live adapters)
    out = [LoraAdapter.from_peft_model(model, a) if isinstance(a, str) and a in live else a for a in adapters]
    for i, a in enumerate(out):
        if not isinstance(a, (str, Path, LoraAdapter, PackedAdapter)):
            raise FusionInputError(f"adapter {i} is a {type(a).__name__}; expected a path, a LoraAdapter or the "
                                   "name of an adapter of `model`")
    return out


def check_texts(query: str, passages: Sequence[str], n_adapters: int | None = None) -> None:
    """The query and passages are non-blank strings (blank: also only zero-width / control characters,
    :func:`~fcprag_plugin.encoding.is_blank`), one passage per adapter."""
    if not isinstance(query, str) or is_blank(query):
        raise FusionInputError(f"query must be a non-empty string, got {query!r}")
    if isinstance(passages, str):
        raise FusionInputError("passages must be a list of strings, got a single string")
    if len(passages) == 0:
        raise FusionInputError("passages is empty: need one passage per adapter")
    for i, p in enumerate(passages):
        if not isinstance(p, str) or is_blank(p):
            raise FusionInputError(f"passage {i} must be a non-empty string, got {p!r}")
    if n_adapters is not None and n_adapters != len(passages):
        raise FusionInputError(f"got {n_adapters} adapters but {len(passages)} passages; they must pair up in order")


def _check_inputs(adapters: Sequence[Any], query: str, passages: Sequence[str]) -> None:
    """One adapter per passage (:func:`check_texts`); repeated paths are warned about (each copy adds its update)."""
    if isinstance(adapters, (str, Path, LoraAdapter, PackedAdapter)):
        raise FusionInputError("adapters must be a list (one per passage)")
    if len(adapters) == 0:
        raise FusionInputError("adapters is empty: need one adapter per passage")
    check_texts(query, passages, len(adapters))
    warn_repeated_adapters(adapters)


def warn_repeated_adapters(adapters: Sequence[Any], names: Sequence[str] | None = None) -> None:
    """Warn once when adapter paths among ``adapters`` are the same directory (by real path): each copy adds its
    update again (PRAG sums them too, silently; rarely meant). ``names``: how the warning calls each entry."""
    given: dict[str, list[str]] = {}
    for i, a in enumerate(adapters):
        if isinstance(a, (str, Path)):
            given.setdefault(os.path.realpath(a), []).append(str(a) if names is None else names[i])
    repeated = {real: as_given for real, as_given in given.items() if len(as_given) > 1}
    if repeated:
        logger.warning("the same adapter directory is given more than once (%s): each copy counts as its own passage "
                       "update, so its update is added once per copy", "; ".join(
                           f"{real} as {', '.join(as_given)}" for real, as_given in repeated.items()))


def fuse(adapters: Sequence[Any], query: str, passages: Sequence[str], *,
         controller: FusionController | str | Path | None = None, encoder: Any = None, mode: str = "cat",
         model: Any = None, retrieval_ranks: Sequence[float] | None = None,
         retrieval_scores: Sequence[float] | None = None, **merge_options: Any) -> FusionResult:
    """The merged adapter of the N passage ``adapters`` (directories, :class:`LoraAdapter` s, or names of adapters
    in the ``PeftModel`` ``model``) and their N ``passages``, weighted by :func:`~fcprag_plugin.weights.weigh`
    (``controller``: None is PRAG's sum; ``encoder``, ``retrieval_ranks``, ``retrieval_scores``). ``mode``: ``cat``,
    ``separate`` or ``svd``, with that mode's ``merge_options`` (another is a ``TypeError``)."""
    _check_inputs(adapters, query, passages)
    loaded = [a if isinstance(a, LoraAdapter) else a.to_lora() if isinstance(a, PackedAdapter)
              else LoraAdapter.from_pretrained(a) for a in _read_live(adapters, model)]
    fw = weigh(controller, query, passages, encoder=encoder, adapters=loaded, retrieval_ranks=retrieval_ranks,
               retrieval_scores=retrieval_scores)
    result: MergeResult = merge_adapters(loaded, fw.merge_weights, mode, **merge_options)
    logger.debug("fused %d adapters: w~=%s g=%.3f tau=%s", len(loaded), fw.merge_weights, fw.g, fw.tau)
    return FusionResult(result.adapter, fw, mode, result.info)


def fuse_into(model: Any, adapters: Sequence[Any], query: str, passages: Sequence[str], *,
              controller: FusionController | str | Path | None = None, encoder: Any = None, mode: str = "cat",
              store: AdapterStore | None = None, retrieval_ranks: Sequence[float] | None = None,
              retrieval_scores: Sequence[float] | None = None, **options: Any) -> LiveFusion:
    """Switch the fusion of the passage adapters (as in :func:`fuse`, packed adapters too) on in the live ``model``
    (a transformers model or a ``PeftModel``; no weight is written) until the returned :class:`LiveFusion` closes.
    ``mode``: ``cat`` (exact) or ``separate`` (DyPRAG's); ``store``: the :class:`AdapterStore` for adapter
    directories (default: the model's slot keeps one). A merge option of :func:`fuse` is a :class:`FusionInputError`."""
    if options:
        raise FusionInputError(f"fuse_into: unexpected option(s) {sorted(options)}: a live fusion takes no merge "
                               "options (they belong to fuse(), which builds the merged adapter)")
    _check_inputs(adapters, query, passages)
    if store is None:  # the model's slot keeps one store across calls
        existing = FusedSlot.of(model)
        store = existing.store if existing is not None and existing.store is not None else AdapterStore()
    packed = [a if isinstance(a, PackedAdapter) else store.get(a) if isinstance(a, (str, Path)) else pack_adapter(a)
              for a in _read_live(adapters, model)]
    fw = weigh(controller, query, passages, encoder=encoder, adapters=lambda: [p.to_lora() for p in packed],
               retrieval_ranks=retrieval_ranks, retrieval_scores=retrieval_scores)
    return LiveFusion(fw, mode, switch_on(model, packed, fw.merge_weights, mode, store=store))


def switch_on(model: Any, packed: Sequence[PackedAdapter], merge_weights: Sequence[float], mode: str = "cat", *,
              store: AdapterStore | None = None, max_adapters: int | None = None) -> FusedSlot:
    """The one place a fusion enters a live model: the ``mode`` merge of ``packed`` with ``w~ = merge_weights``,
    written into the model's fused slot (room for at least ``max_adapters``, default N) and switched on."""
    slot = FusedSlot.for_model(model, packed[0], max_adapters=max(max_adapters or 0, len(packed)),
                               max_rank=max(p.max_rank for p in packed), store=store)
    return slot.write(list(packed), merge_weights, mode)
