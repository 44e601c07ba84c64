"""``fuse()``: texts -> encoder -> controller -> merge weights -> merged adapter."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .adapter import LoraAdapter
from .controller import FusionController, load_controller
from .errors import FusionInputError
from .merge import MergeResult, merge_adapters

logger = logging.getLogger(__name__)

AdapterLike = "str | Path | LoraAdapter"


@dataclass
class FusionResult:
    """What ``fuse`` produced. ``merge_weights`` is ``w~`` (length N); ``weights`` is ``w`` (sums to 1)."""

    adapter: LoraAdapter | None  # None with use_slot=True: the merge lives in ``slot`` on the model
    merge_weights: list[float]
    weights: list[float]
    scores: list[float]
    g: float
    tau: float
    mode: str
    controller_mode: str
    info: dict[str, Any] = field(default_factory=dict)
    slot: Any = None  # the active FusedSlot when fused with use_slot=True

    def __enter__(self) -> "FusionResult":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Leaving a ``with fuse(..., use_slot=True):`` block switches the slot off (the model is the base again)."""
        if self.slot is not None:
            self.slot.deactivate()

    def to_json(self) -> dict[str, Any]:
        return {"merge_weights": self.merge_weights, "weights": self.weights, "scores": self.scores, "g": self.g,
                "tau": self.tau, "mode": self.mode, "controller_mode": self.controller_mode,
                **{k: v for k, v in self.info.items() if isinstance(v, (int, float, str, list, dict))}}


def resolve_adapters(adapters: Sequence[Any], model: Any = None) -> list[LoraAdapter]:
    """Paths -> loaded; ``LoraAdapter`` s pass through; names of a live model's adapters are read from it."""
    out = []
    live = set(getattr(model, "peft_config", {}) or {}) if model is not None else set()
    for i, a in enumerate(adapters):
        if isinstance(a, LoraAdapter):
            out.append(a)
        elif isinstance(a, str) and a in live:
            out.append(LoraAdapter.from_peft_model(model, a))
        elif isinstance(a, (str, Path)):
            out.append(LoraAdapter.from_pretrained(a))
        else:
            raise FusionInputError(f"adapter {i} is a {type(a).__name__}; expected a path, a LoraAdapter or the "
                                   "name of an adapter of `model`")
    return out


def compute_weights(query: str, passages: Sequence[str], controller: FusionController | None,
                    encoder: Any = None) -> dict[str, Any]:
    """Controller outputs for one query as plain lists; ``controller=None`` is uniform (PRAG's merge)."""
    n = len(passages)
    if controller is None or controller.config.mode == "uniform":
        return {"merge_weights": [1.0] * n, "weights": [1.0 / n] * n, "scores": [0.5] * n, "g": 0.0,
                "tau": float("nan") if controller is None else controller.config.tau_max, "controller_mode": "uniform"}
    if encoder is None:
        encoder = controller.encoder  # loaded once per process, shared
    out = controller.predict(query, passages, encoder).sample(0)
    out["controller_mode"] = controller.config.mode
    return out


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
    **merge_options: Any,
) -> FusionResult:
    """Merge the passage adapters with per-query weights from ``controller`` (``None``: uniform, PRAG's merge).

    Args:
        adapters: N adapter directories, :class:`LoraAdapter` s, or adapter names of the live ``model``.
        query: the question.
        passages: the N passage texts, in the same order as ``adapters``.
        controller: a :class:`FusionController` or its directory.
        encoder: a :class:`TextEncoder`; default: the controller's recorded embedding model.
        mode: merge mode (``cat``, ``separate``, ``svd``).
        model: the live model (needed for adapter names and for ``use_slot``).
        use_slot: write the merge into the model's pre-allocated :class:`~fcprag_plugin.fast.FusedSlot` and switch
            it on, instead of building a merged :class:`LoraAdapter` (``result.adapter`` is then None; leave the
            ``with`` block or call ``result.slot.deactivate()`` to switch it off). Modes ``cat`` and ``separate``.
        store: the :class:`~fcprag_plugin.fast.AdapterStore` that caches adapter directories for the slot.
    """
    if isinstance(adapters, (str, Path, LoraAdapter)):
        raise FusionInputError("adapters must be a list (one per passage)")
    if len(adapters) == 0:
        raise FusionInputError("adapters is empty: need one adapter per passage")
    check_texts(query, passages, len(adapters))
    ctrl = load_controller(controller)
    if use_slot:
        return _fuse_on_slot(adapters, query, passages, ctrl, encoder, mode, model, store)
    loaded = resolve_adapters(adapters, model)
    cw = compute_weights(query, passages, ctrl, encoder)
    result: MergeResult = merge_adapters(loaded, torch.tensor(cw["merge_weights"]), mode, **merge_options)
    logger.debug("fused %d adapters: w~=%s g=%.3f tau=%.3f", len(loaded), cw["merge_weights"], cw["g"], cw["tau"])
    return FusionResult(result.adapter, cw["merge_weights"], cw["weights"], cw["scores"], cw["g"], cw["tau"], mode,
                        cw["controller_mode"], result.info)


def _fuse_on_slot(adapters: Sequence[Any], query: str, passages: Sequence[str], ctrl: FusionController | None,
                  encoder: Any, mode: str, model: Any, store: Any) -> FusionResult:
    """Fast path: the merge is written into the model's fused slot (no merged adapter is materialised)."""
    from .fast import AdapterStore, FusedSlot

    if model is None:
        raise FusionInputError("use_slot=True needs the live model: fuse(..., model=model, use_slot=True)")
    live = set(getattr(model, "peft_config", {}) or {})
    items = [LoraAdapter.from_peft_model(model, a) if isinstance(a, str) and a in live else a for a in adapters]
    for i, a in enumerate(items):
        if not isinstance(a, (str, Path, LoraAdapter)):
            raise FusionInputError(f"adapter {i} is a {type(a).__name__}; expected a path, a LoraAdapter or the "
                                   "name of an adapter of `model`")
    store = store if store is not None else AdapterStore()
    template = store.get(items[0]) if isinstance(items[0], (str, Path)) else items[0]
    slot = FusedSlot.for_model(model, template, max_adapters=len(items), store=store)
    if slot.store is None:
        slot.store = store
    cw = compute_weights(query, passages, ctrl, encoder)
    slot.activate(items, cw["merge_weights"], mode)
    return FusionResult(None, cw["merge_weights"], cw["weights"], cw["scores"], cw["g"], cw["tau"], mode,
                        cw["controller_mode"], {"slot": repr(slot)}, slot)
