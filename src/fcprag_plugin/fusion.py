"""``fuse()``: texts -> encoder -> controller -> merge weights -> merged adapter."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ._deprecated import renamed_attribute
from .adapter import LoraAdapter
from .controller import FusionController, load_controller
from .errors import FusionInputError
from .slot import AdapterStore, FusedSlot, pack_adapter
from .merge import MergeResult, merge_adapters
from .loading import finite_or_none
from .weights import FusionWeights, side_inputs

logger = logging.getLogger(__name__)


@dataclass
class FusionResult:
    """What ``fuse`` produced: the merged adapter (or the slot holding the merge), the :class:`FusionWeights` and
    the merge ``mode``. ``merge_weights`` is ``w~`` (length N); ``probabilities`` is ``w`` (sums to 1); ``tau`` is
    None for uniform weights (no temperature)."""

    adapter: LoraAdapter | None  # None with use_slot=True: the merge lives in ``slot`` on the model
    fusion_weights: FusionWeights
    mode: str
    info: dict[str, Any] = field(default_factory=dict)
    slot: Any = None  # the active FusedSlot when fused with use_slot=True

    merge_weights = property(lambda self: list(self.fusion_weights.merge_weights))
    probabilities = property(lambda self: list(self.fusion_weights.probabilities))
    scores = property(lambda self: list(self.fusion_weights.scores))
    g = property(lambda self: self.fusion_weights.g)
    tau = property(lambda self: self.fusion_weights.tau)
    controller_mode = property(lambda self: self.fusion_weights.controller_mode)

    weights = renamed_attribute("FusionResult.weights", "probabilities")

    def __enter__(self) -> "FusionResult":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Leaving a ``with fuse(..., use_slot=True):`` block switches the slot off (the model is the base again)."""
        if self.slot is not None:
            self.slot.deactivate()

    def to_json(self) -> dict[str, Any]:
        """Strict JSON (NaN / inf as null): the weights, ``mode``, ``controller_mode`` and the merge's info."""
        fw = self.fusion_weights.to_json()
        mode = fw.pop("controller_mode")
        extra = {k: v for k, v in self.info.items() if isinstance(v, (int, float, str, list, dict))}
        return finite_or_none({**fw, "mode": self.mode, "controller_mode": mode, **extra})


def _read_live(adapters: Sequence[Any], model: Any) -> list[Any]:
    """Names of the live ``model``'s adapters -> read from it; paths and ``LoraAdapter`` s pass through."""
    live = set(getattr(model, "peft_config", {}) or {}) if model is not None else set()
    out = [LoraAdapter.from_peft_model(model, a) if isinstance(a, str) and a in live else a for a in adapters]
    for i, a in enumerate(out):
        if not isinstance(a, (str, Path, LoraAdapter)):
            raise FusionInputError(f"adapter {i} is a {type(a).__name__}; expected a path, a LoraAdapter or the "
                                   "name of an adapter of `model`")
    return out


def resolve_adapters(adapters: Sequence[Any], model: Any = None) -> list[LoraAdapter]:
    """Paths -> loaded; ``LoraAdapter`` s pass through; names of a live model's adapters are read from it."""
    return [a if isinstance(a, LoraAdapter) else LoraAdapter.from_pretrained(a) for a in _read_live(adapters, model)]


def warn_duplicates(adapters: Sequence[Any]) -> list[str]:
    """Warn (one warning per fusion) when adapter paths repeat: each copy counts as its own passage update, so the
    same update is added twice (PRAG does the same, silently). Returns the repeated paths."""
    seen = Counter(os.path.realpath(a) for a in adapters if isinstance(a, (str, Path)))
    dups = [k for k, c in seen.items() if c > 1]
    if dups:
        logger.warning("fuse: adapter path(s) %s are given more than once; each copy counts as its own passage "
                       "update, so the same update is added several times", dups)
    return dups


def check_texts(query: str, passages: Sequence[str], n_adapters: int | None = None) -> None:
    """The query and passages are non-blank strings (blank: also only zero-width / control characters,
    :func:`~fcprag_plugin.encoding.is_blank`), one passage per adapter."""
    from .encoding import is_blank

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


def fuse(
    adapters: Sequence[Any],
    query: str,
    passages: Sequence[str],
    *,
    controller: FusionController | str | Path | None = None,
    encoder: Any = None,
    mode: str = "cat",
    model: Any = None,
    use_slot: bool = False,
    store: Any = None,
    retrieval_ranks: Sequence[float] | None = None,
    retrieval_scores: Sequence[float] | None = None,
    **merge_options: Any,
) -> FusionResult:
    """Merge the passage adapters with per-query weights from ``controller`` (``None``: uniform, PRAG's merge).

    Args:
        adapters: N adapter directories, :class:`LoraAdapter` s, or adapter names of the live ``model``.
        passages: the N passage texts, in the same order as ``adapters``.
        controller: a :class:`FusionController` or its directory.
        encoder: a :class:`TextEncoder`; default: the controller's recorded embedding model (another: an error).
        mode: merge mode (``cat``, ``separate``, ``svd``).
        model: the live model (needed for adapter names and for ``use_slot``).
        use_slot: write the merge into the model's :class:`~fcprag_plugin.slot.FusedSlot` and switch it on instead
            of building a merged adapter (``result.adapter`` is None; leaving the ``with`` block or
            ``result.slot.deactivate()`` switches it off). Modes ``cat`` and ``separate``.
        store: the :class:`~fcprag_plugin.slot.AdapterStore` that caches adapter directories for the slot.
        retrieval_ranks, retrieval_scores: one number per passage, for a controller trained with these side
            features (ignored otherwise; missing: equal for every passage, with a ``UserWarning`` once per
            controller). Adapter statistics are computed from ``adapters``.
    """
    if isinstance(adapters, (str, Path, LoraAdapter)):
        raise FusionInputError("adapters must be a list (one per passage)")
    if len(adapters) == 0:
        raise FusionInputError("adapters is empty: need one adapter per passage")
    check_texts(query, passages, len(adapters))
    warn_duplicates(adapters)
    ctrl = load_controller(controller)
    side = {"retrieval_ranks": retrieval_ranks, "retrieval_scores": retrieval_scores}
    if use_slot:
        return _fuse_on_slot(adapters, query, passages, ctrl, encoder, mode, model, store, side)
    loaded = resolve_adapters(adapters, model)
    if ctrl is not None:
        ctrl.check_adapters(loaded)  # another adapter recipe than the controller's: a warning, once
    fw = FusionWeights.for_query(query, passages, ctrl, encoder, side_inputs(ctrl, adapters=loaded, **side))
    result: MergeResult = merge_adapters(loaded, fw.merge_weights, mode, **merge_options)
    logger.debug("fused %d adapters: w~=%s g=%.3f tau=%s", len(loaded), fw.merge_weights, fw.g, fw.tau)
    return FusionResult(result.adapter, fw, mode, result.info)


def _fuse_on_slot(adapters: Sequence[Any], query: str, passages: Sequence[str], ctrl: FusionController | None,
                  encoder: Any, mode: str, model: Any, store: Any, side: dict[str, Any]) -> FusionResult:
    """Fast path: the merge is written into the model's fused slot (no merged adapter is materialised)."""
    if model is None:
        raise FusionInputError("use_slot=True needs the live model: fuse(..., model=model, use_slot=True)")
    existing = FusedSlot.of(model)
    if store is None:  # the model's slot keeps one store across calls
        store = existing.store if existing is not None and existing.store is not None else AdapterStore()
    packed = [store.get(a) if isinstance(a, (str, Path)) else pack_adapter(a) for a in _read_live(adapters, model)]
    # sized for this fusion's largest rank, so adapters of ranks [2, 4] fit in any order
    slot = FusedSlot.for_model(model, packed[0], max_adapters=len(packed), max_rank=max(p.max_rank for p in packed),
                               store=store)
    if ctrl is not None:
        ctrl.check_adapters(lambda: [p.to_lora() for p in packed])
    fw = FusionWeights.for_query(query, passages, ctrl, encoder,
                                 side_inputs(ctrl, adapters=lambda: [p.to_lora() for p in packed], **side))
    slot.write(packed, fw.merge_weights, mode)
    return FusionResult(None, fw, mode, {"slot": repr(slot)}, slot)
