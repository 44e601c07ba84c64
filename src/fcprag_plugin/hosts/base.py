"""What the host shims share: reversible patches, the weights, the log, ``use_slot``'s fused slots and the install
lifecycle (which question a merge is for: :mod:`.context`; running a host's script: ``fcprag_tools.launch``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from ..controller import FusionController, load_controller
from ..encoding import get_encoder
from ..errors import BARE, HookError, kw
from ..fusion import check_texts, switch_on
from ..slot.layout import FactorGetter, PackedAdapter, pack_factors
from ..slot.fused import FusedSlot
from ..fileio import append_json_lines, finite_or_none
from ..weights import FusionWeights, is_uniform, weigh

logger = logging.getLogger(__name__)

_MISSING = object()


class PatchSet:
    """A named group of attribute patches. ``apply`` is idempotent; ``revert`` restores the originals exactly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._patches: list[tuple[Any, str, Any]] = []  # (owner, attr, original in owner.__dict__ or _MISSING)

    def patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.attr`` with ``make(current)``; patching the same (owner, attr) twice is a no-op."""
        if any(o is owner and a == attr for o, a, _ in self._patches):
            return
        original = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        setattr(owner, attr, make(getattr(owner, attr)))
        self._patches.append((owner, attr, original))

    def revert(self) -> None:
        for owner, attr, original in reversed(self._patches):
            if original is not _MISSING:
                setattr(owner, attr, original)
            else:  # it was inherited or absent
                with contextlib.suppress(AttributeError):
                    delattr(owner, attr)
        self._patches.clear()


def wrapping(fn: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``make(orig)`` for :meth:`PatchSet.patch`: ``fn(orig, *args, **kwargs)`` dressed as ``orig``
    (``functools.wraps``), with ``orig`` kept as ``__fcprag_original__``."""
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(orig, *args, **kwargs)

        wrapper.__fcprag_original__ = orig  # type: ignore[attr-defined]
        return wrapper

    return make


class WeightProvider:
    """Controller + encoder -> one question's merge weights (:meth:`weights`; no controller or a ``uniform`` one: ``w~ =
    [kappa]*N``). ``encoder``: a TextEncoder, a model name/path (loaded on first need) or None (the controller's)."""

    def __init__(self, controller: FusionController | str | Path | None = None, encoder: Any = None) -> None:
        self.controller = load_controller(controller)
        self._encoder_name = str(encoder) if isinstance(encoder, (str, Path)) else None
        self._encoder = None if self._encoder_name is not None else encoder

    @property
    def encoder(self) -> Any:
        if self._encoder is None and not is_uniform(self.controller):
            # shared per process: the controller's own encoder unless a model was named
            self._encoder = get_encoder(self._encoder_name) if self._encoder_name else self.controller.encoder
        if self._encoder is not None and self.controller is not None:
            self.controller.check_encoder(self._encoder)
        return self._encoder

    def weights(self, question: str, passages: Sequence[str], adapters: Any = None) -> FusionWeights:
        """The weights of one question (:func:`~fcprag_plugin.weights.weigh`): ``retrieval_rank`` is the position
        (passages come in retrieval order), no retrieval scores; ``adapters``: a callable, read when needed."""
        check_texts(question, passages)
        return weigh(self.controller, question, passages, encoder=self.encoder, adapters=adapters,
                     retrieval_ranks=[float(i + 1) for i in range(len(passages))])


def check_max_adapters(max_adapters: Any, use_slot: bool, who: str) -> int | None:
    """Validate the ``max_adapters`` option (``None``: the slot grows with the largest question)."""
    if max_adapters is None:
        return None
    if not use_slot:
        raise HookError(f"{who}: {kw('max_adapters')} only applies with {kw('use_slot', True)}",
                        params=[("max_adapters", BARE), ("use_slot", True)])
    if isinstance(max_adapters, bool) or not isinstance(max_adapters, int) or max_adapters < 1:
        raise HookError(f"{who}: max_adapters must be a positive integer (the most passages one question may have), "
                        f"got {max_adapters!r}")
    return max_adapters


class ShimSlots:
    """The models whose slot (:meth:`FusedSlot.for_model`) one shim used, held weakly for :meth:`close`.
    ``max_adapters``: fixed capacity K (more is a :class:`HookError`); ``None``: the slot grows as needed."""

    def __init__(self, max_adapters: int | None, who: str) -> None:
        self.max_adapters, self.who = max_adapters, who
        self._models: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self.resizes = 0

    def get(self, model: nn.Module, targets: Any, n: int, rank: int) -> FusedSlot:
        """The slot on ``model`` for ``targets`` (module paths or a packed adapter), ``n`` adapters of ``rank``."""
        if self.max_adapters is not None and n > self.max_adapters:
            raise HookError(f"{self.who}: this question merges {n} adapters but the fused slot holds "
                            f"{kw('max_adapters', self.max_adapters)}; raise {kw('max_adapters')} or leave it "
                            "unset so the slot grows with the largest question",
                            params=[("max_adapters", self.max_adapters), ("max_adapters", BARE)])
        before = FusedSlot.of(model)
        size = None if before is None else (before.max_adapters, before.max_rank)
        slot = FusedSlot.for_model(model, targets, max_adapters=self.max_adapters or n, max_rank=rank)
        self._models.add(model)
        if slot is not before:
            logger.info("%s: fused slot installed on %d modules (K=%d, R=%d, %d bytes)", self.who,
                        slot.layout.num_modules, slot.max_adapters, slot.max_rank, slot.nbytes)
        elif size != (slot.max_adapters, slot.max_rank):
            self.resizes += 1
        return slot

    def write(self, model: nn.Module, modules: Sequence[str], rank: int, factors: Sequence[FactorGetter],
              sources: Sequence[str], merge_weights: Sequence[float], mode: str) -> FusedSlot:
        """Pack ``factors[i](module) -> (A, B, s)`` (``sources[i]`` in errors) and write their ``mode`` merge with
        ``w~ = merge_weights`` into the slot of ``model``, switched on."""
        slot = self.get(model, list(modules), len(factors), rank)
        packed = [pack_factors(slot.layout, f, src, error=HookError) for f, src in zip(factors, sources)]
        return switch_on(model, packed, merge_weights, mode, max_adapters=slot.max_adapters)

    def write_packed(self, model: nn.Module, packed: Sequence[PackedAdapter], merge_weights: Sequence[float],
                     mode: str) -> FusedSlot:
        """Write the ``mode`` merge of already packed adapters into the slot of ``model`` (switched on)."""
        slot = self.get(model, packed[0], len(packed), max(p.max_rank for p in packed))
        return switch_on(model, packed, merge_weights, mode, max_adapters=slot.max_adapters)

    def slot_of(self, model: nn.Module) -> FusedSlot | None:
        return FusedSlot.of(model) if model in self._models else None

    def slots(self) -> list[FusedSlot]:
        return [s for s in map(FusedSlot.of, list(self._models)) if s is not None]

    def close(self) -> None:
        """Remove the slots of every model this shim used: the models are bit for bit what they were before the first
        question."""
        for slot in self.slots():
            slot.remove()
        self._models = weakref.WeakSet()


class Shim:
    """What every host shim holds: ``weigher``, ``mode``, the ``slots`` of ``use_slot``, its patches and the JSON
    Lines log (``log_path``, ``merges``, ``last_record``); subclasses set ``who``, ``lifecycle``, :meth:`apply`."""

    who = "fcprag"
    lifecycle: "Lifecycle"

    def __init__(self, weigher: WeightProvider, mode: str, *, log: str | Path | None = None, use_slot: bool = False,
                 max_adapters: int | None = None) -> None:
        self.weigher, self.mode = weigher, mode
        self.log_path = Path(log) if log is not None else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.use_slot = bool(use_slot)
        self.slots = ShimSlots(check_max_adapters(max_adapters, self.use_slot, self.who), self.who)
        self.patches = PatchSet(self.who)
        self.merges = 0
        self.last_record: dict[str, Any] | None = None
        self._warned: set[str] = set()
        _ = weigher.encoder  # load it and check its dimension now, before the host script runs for hours

    def apply(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Switch off and remove this shim's fused slots (the base models are left bit for bit unchanged)."""
        self.slots.close()

    def teardown(self) -> None:
        """Restore every patched attribute exactly and :meth:`close`."""
        self.patches.revert()
        self.close()

    @property
    def active(self) -> bool:
        return self.lifecycle.current is self

    def uninstall(self) -> None:
        if self.active:
            self.lifecycle.uninstall()
        else:
            self.teardown()

    def __enter__(self) -> "Shim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def warn_once(self, key: str, msg: str, *args: Any) -> None:
        """One warning per kind per installed shim (per run), not one per question."""
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def log_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """Count the question and append its record (strict JSON: NaN / inf become null) to the log, a whole line."""
        record = finite_or_none(record)
        self.merges += 1
        self.last_record = record
        if self.log_path is not None:
            append_json_lines(self.log_path, [record], default=_json_value)
        return record


def _json_value(obj: Any) -> Any:
    """A logged value JSON has no type for: an array or tensor as its (finite-or-null) list, anything else as text."""
    return finite_or_none(obj.tolist()) if hasattr(obj, "tolist") else str(obj)


class Lifecycle:
    """install / uninstall / installed of one host's shims: at most one is installed at a time."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.current: Shim | None = None

    def install(self, shim: Shim) -> Shim:
        """Install ``shim`` (its patches), replacing the installed one."""
        if self.current is not None:
            logger.info("%s: replacing the installed shim", self.who)
            self.uninstall()
        shim.apply()
        self.current = shim
        return shim

    def uninstall(self) -> None:
        """Undo :meth:`install` (no-op when nothing is installed)."""
        shim, self.current = self.current, None
        if shim is not None:
            shim.teardown()

    def is_installed(self) -> bool:
        return self.current is not None

    @contextlib.contextmanager
    def installed(self, shim: Shim) -> Iterator[Shim]:
        """Install ``shim`` for the block; restores the previous state (installed or not) on exit."""
        previous = self.current
        self.install(shim)
        try:
            yield shim
        finally:
            self.uninstall()
            if previous is not None:
                self.install(previous)
