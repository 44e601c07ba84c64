"""DyPRAG shim: DyPRAG's per-question average of translator-generated LoRA factors becomes a controller-weighted
aggregation (``u = w~/N``, :mod:`._dyprag_math`), without changing DyPRAG's code. Every ``ParameterTranslator``
output is captured and must be the N passages whose plain mean ``utils.delta_inject`` gets (else
:class:`HookError`); the capture is emptied at every ``delta_inject`` and on every error. ``use_slot=True``: a fused
slot carries the update (the patched ``delta_remove`` switches it off). See ``examples/dyprag/README.md``."""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ContextManager, Mapping

from ..adapter import LoraAdapter, LoraModule
from ..errors import HookError
from ..weights import FusionWeights
from . import _dyprag_math as dm
from .base import Lifecycle, Shim, WeightProvider, check_max_adapters, wrapping
from .context import caller_test_id, clear_context, get_context
from .context import set_context  # noqa: F401  (re-exported: dyprag.set_context(question, passages))

logger = logging.getLogger(__name__)

UTILS_MODULE = "utils"
PROJECTOR_MODULE = "projector"
TRANSLATOR_CLASS = "ParameterTranslator"
MODES = dm.DYPRAG_MODES
_WARN_PENDING = 1000  # captured outputs without a delta_inject: the inject patch is probably not in effect
_LIFE = Lifecycle("fcprag dyprag")


class DyPragShim(Shim):
    """The shim (:class:`~fcprag_plugin.hosts.base.Shim`) with the capture buffer; :func:`install`'s arguments."""

    who = "fcprag dyprag"
    lifecycle = _LIFE

    def __init__(self, controller: Any = None, encoder: Any = None, mode: str = "separate",
                 log: str | Path | None = None, *, utils: ModuleType | str | None = None,
                 projector: ModuleType | str | None = None, use_slot: bool = False,
                 max_adapters: int | None = None) -> None:
        if mode not in MODES:
            raise HookError(f"fcprag dyprag: mode '{mode}' is not one of {list(MODES)}")
        check_max_adapters(max_adapters, bool(use_slot), "fcprag dyprag")
        self.utils, self.projector = host_modules(utils, projector)
        _check_host(self.utils, self.projector)
        weigher = WeightProvider(controller, encoder)
        super().__init__(weigher, mode, log=log, use_slot=use_slot, max_adapters=max_adapters)
        logger.info("fcprag dyprag: installing (mode=%s, controller=%s, use_slot=%s)", mode,
                    "uniform" if weigher.controller is None else weigher.controller.config.controller_mode,
                    self.use_slot)
        self._captured: list[Any] = []
        self._lock = threading.Lock()

    @property
    def captured(self) -> list[Any]:
        """A copy of the translator outputs captured since the last ``delta_inject``."""
        with self._lock:
            return list(self._captured)

    def clear(self) -> None:
        """Drop the captured translator outputs (done automatically per question and on errors)."""
        self._take()

    def _capture(self, output: Any) -> None:
        with self._lock:
            self._captured.append(output)  # a reference: DyPRAG keeps these alive until its merge anyway
            pending = len(self._captured)
        if pending > _WARN_PENDING:
            self.warn_once("pending", "fcprag dyprag: %d ParameterTranslator outputs captured without a delta_inject "
                           "call; is delta_inject bound before the shim was installed (install before 'from utils "
                           "import')?", pending)

    def _take(self) -> list[Any]:
        with self._lock:
            outs, self._captured = self._captured, []
        return outs

    def reaggregate(self, merged: Mapping[str, Any]) -> dict[str, Any]:
        """Check the captured outputs against DyPRAG's ``merged`` and return the weighted dict (same keys).
        Consumes the capture buffer (also when it raises)."""
        outs, ctx, fw, u, times = self._weigh(merged)
        if self.mode == "separate" and fw.uniform_merge:
            new = dict(merged)  # uniform: exactly DyPRAG's average (checked equal to the capture above)
        else:
            new = dm.aggregate(outs, u, self.mode)
        self._record(merged, ctx, fw, u, times)
        return new

    def inject_on_slot(self, model: Any, merged: Mapping[str, Any]) -> None:
        """``use_slot``: :meth:`reaggregate`'s checks and weights, the update written into the fused slot (on)."""
        outs, ctx, fw, u, times = self._weigh(merged)
        factors = [dm.module_factors(o, i) for i, o in enumerate(outs)]
        rank = max(int(a.shape[0]) for a, _ in factors[0].values())
        getters = [lambda m, f=f: (*f[m], 1.0) for f in factors]  # DyPRAG's delta is B @ A: scaling 1
        sources = [f"ParameterTranslator output {i}" for i in range(len(outs))]
        # separate: A = sum u_i A_i, B = sum u_i B_i (the slot divides w~ by N); cat: sum u_i B_i A_i
        weights, mode = (fw.merge_weights, "separate") if self.mode == "separate" else (u, "cat")
        slot = self.slots.write(model, list(factors[0]), rank, getters, sources, weights, mode)
        self._record(merged, ctx, fw, u, times, slot=repr(slot))

    def _weigh(self, merged: Mapping[str, Any]
               ) -> tuple[list[Any], dict[str, Any], FusionWeights, list[float], tuple[float, float]]:
        """Take the capture, resolve the question, check the alignment; ``(outputs, context, w~, u = w~/N, (start,
        end) of the weights' computation)``."""
        outs = self._take()
        ctx = self._context()
        q_text, p_texts = ctx["question"], ctx["passages"]
        dm.check_alignment(outs, merged, len(p_texts), q_text)
        t0 = time.perf_counter()
        fw = self.weigher.weights(q_text, p_texts, lambda: [_translator_adapter(o, i) for i, o in enumerate(outs)])
        t1 = time.perf_counter()
        return outs, ctx, fw, [w / fw.n for w in fw.merge_weights], (t0, t1)

    def _record(self, merged: Mapping[str, Any], ctx: dict[str, Any], fw: FusionWeights, u: list[float],
                times: tuple[float, float], slot: str | None = None) -> None:
        (t0, t1), t2 = times, time.perf_counter()
        self.log_record({
            "shim": "dyprag", "call": self.merges + 1, "test_id": caller_test_id(ctx), "question": ctx["question"],
            "n": len(u), "mode": self.mode, **fw.to_json(), "u": u, "context_source": ctx["source"],
            "keys": len(merged), "use_slot": self.use_slot, "weights_time_s": t1 - t0, "merge_time_s": t2 - t1,
            **({"slot": slot} if slot is not None else {})})
        logger.debug("dyprag merge: N=%d mode=%s w~=%s (%.1f ms)", len(u), self.mode, fw.merge_weights,
                     (t2 - t1) * 1e3)

    @staticmethod
    def _context() -> dict[str, Any]:
        try:  # DyPRAG's own loop keeps the passage texts in 'passages_list' ('passages' is their joined string)
            ctx = get_context(what="DyPRAG delta_inject merge", passages=("passages", "passages_list"))
        except HookError:
            raise HookError("fcprag dyprag: cannot tell which question and passages this delta_inject call is for: "
                            "call fcprag_plugin.hosts.set_context(question, passages) before delta_inject, or call "
                            "delta_inject from a function with local variables 'question' (a str) and 'passages' (a "
                            "list of str), as DyPRAG's inference_dyprag.py main() does") from None
        if ctx["source"] == "set_context":
            clear_context()  # one question per set_context: a stale context must not weight the next question
        return ctx

    def apply(self) -> None:
        if self.use_slot and not callable(getattr(self.utils, "delta_remove", None)):
            raise HookError(f"fcprag dyprag: {_where(self.utils)} has no function 'delta_remove'; "
                            "use_slot needs it to switch the fused slot off after each question")

        def forward(orig: Callable[..., Any], module: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                out = orig(module, *args, **kwargs)
            except BaseException:
                self.clear()  # this question's capture is incomplete: never let it reach the next one
                raise
            self._capture(out)
            return out

        def delta_inject(orig: Callable[..., Any], model: Any, adapter_weights: Any, *args: Any, **kwargs: Any) -> Any:
            if self.use_slot:
                self.inject_on_slot(model, adapter_weights)  # no dense delta: the slot carries the update
                return None
            return orig(model, self.reaggregate(adapter_weights), *args, **kwargs)

        def delta_remove(orig: Callable[..., Any], model: Any, adapter_weights: Any, *args: Any, **kwargs: Any) -> Any:
            slot = self.slots.slot_of(model)
            if slot is not None and slot.active:
                slot.deactivate()  # this question's update lived in the slot; DyPRAG set no delta to delete
                return None
            return orig(model, adapter_weights, *args, **kwargs)

        self.patches.patch(getattr(self.projector, TRANSLATOR_CLASS), "forward", wrapping(forward))
        main = sys.modules.get("__main__")
        wrappers = [("delta_inject", delta_inject)] + ([("delta_remove", delta_remove)] if self.use_slot else [])
        for name, fn in wrappers:
            original = getattr(self.utils, name)
            self.patches.patch(self.utils, name, wrapping(fn))
            # A script that imported the function before install() holds the original: re-point that name too.
            if main is not None and main is not self.utils and getattr(main, name, None) is original:
                self.patches.patch(main, name, lambda _orig, patched=getattr(self.utils, name): patched)
                logger.info("fcprag dyprag: also patched __main__.%s (imported before install)", name)

    def close(self) -> None:
        """Drop the capture and remove the fused slots (the model is left bit for bit unchanged)."""
        self.clear()
        super().close()


def _translator_adapter(output: Mapping[str, Any], index: int) -> LoraAdapter:
    """One translator output as a :class:`LoraAdapter` (scaling 1: DyPRAG injects ``B @ A``), for adapter_stats."""
    mods = {m: LoraModule(A, B, 1.0) for m, (A, B) in dm.module_factors(output, index).items()}
    return LoraAdapter(mods, {}, f"ParameterTranslator output {index}")


def host_modules(utils: ModuleType | str | None = None,
                 projector: ModuleType | str | None = None) -> tuple[ModuleType, ModuleType]:
    """DyPRAG's ``utils`` and ``projector`` modules: given ones as they are, names (default: those) imported."""
    mods = []
    for mod, what in ((utils or UTILS_MODULE, "delta_inject"), (projector or PROJECTOR_MODULE, TRANSLATOR_CLASS)):
        try:
            mods.append(mod if isinstance(mod, ModuleType) else importlib.import_module(mod))
        except ImportError as e:
            raise HookError(
                f"fcprag dyprag: cannot import DyPRAG's '{mod}' module ({what}): {e}. Run from DyPRAG's src/ "
                f"directory, put it on sys.path, or use `fcprag run dyprag -- src/inference_dyprag.py ...`") from e
    return mods[0], mods[1]


def _where(module: ModuleType) -> str:
    return getattr(module, "__file__", module.__name__)


def _check_host(utils: ModuleType, projector: ModuleType) -> None:
    if not callable(getattr(utils, "delta_inject", None)):
        raise HookError(f"fcprag dyprag: {_where(utils)} has no function 'delta_inject'; "
                        "expected DyPRAG's src/utils.py")
    cls = getattr(projector, TRANSLATOR_CLASS, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "forward", None)):
        raise HookError(f"fcprag dyprag: {_where(projector)} has no class '{TRANSLATOR_CLASS}' with a forward(); "
                        "expected DyPRAG's src/projector.py")


def install(controller: Any = None, encoder: Any = None, mode: str = "separate", log: str | Path | None = None, *,
            utils: ModuleType | str | None = None, projector: ModuleType | str | None = None,
            use_slot: bool = False, max_adapters: int | None = None) -> DyPragShim:
    """Patch DyPRAG's ``utils.delta_inject`` and ``projector.ParameterTranslator.forward`` (before the script's
    ``from utils import delta_inject``; installing again replaces the shim); returns the shim (a context manager).
    ``controller``: a :class:`~fcprag_plugin.controller.FusionController`, its directory, or None (DyPRAG's own
    average); ``encoder``: default the controller's; ``mode``: ``separate`` (``A* = sum u_i A_i``, ``B* = sum u_i
    B_i``) or ``cat`` (exact ``sum u_i B_i A_i``): the merge modes on DyPRAG's weights ``u =
    w~/N`` (DyPRAG averages where PRAG sums); ``log``: JSON Lines, one record per question; ``utils``,
    ``projector``: the host modules or import names; ``use_slot``: a fused slot instead of DyPRAG's dense ``delta``
    (``max_adapters``: its fixed capacity, ``None``: grows)."""
    return _LIFE.install(DyPragShim(controller, encoder, mode, log, utils=utils, projector=projector,
                                    use_slot=use_slot, max_adapters=max_adapters))


uninstall = _LIFE.uninstall  # undo install() (no-op when not installed)
is_installed = _LIFE.is_installed


def installed(*args: Any, **kwargs: Any) -> ContextManager[DyPragShim]:
    """``with dyprag.installed(controller=DIR): ...`` (:func:`install`'s arguments); restores the previous state."""
    return _LIFE.installed(DyPragShim(*args, **kwargs))


def current() -> DyPragShim | None:
    """The installed shim, or None."""
    return _LIFE.current  # type: ignore[return-value]


__all__ = ["DyPragShim", "install", "uninstall", "installed", "is_installed", "current", "host_modules", "set_context",
           "clear_context", "MODES"]
