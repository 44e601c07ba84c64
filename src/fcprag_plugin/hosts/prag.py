"""PRAG shim: PRAG's uniform ``add_weighted_adapter`` merge gets controller weights; PRAG's code stays as it is.
:func:`install` patches peft at class level (reversible, idempotent): ``add_weighted_adapter`` (checks, context,
``w~``, log), ``PeftModel.from_pretrained`` / ``load_adapter`` (remember adapter paths) and, on peft < 0.19,
``unload`` / ``merge_and_unload`` (clear the stale ``peft_config``). See ``examples/prag/``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
import weakref
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..compat import (clear_stale_peft_config, has_stale_peft_config, live_lora_layers, lora_b_weight,
                      package_version, peft_has_stale_config_bug)
from ..adapter import LoraAdapter
from ..controller import FusionController
from ..errors import HookError, kw
from ..slot import AdapterStore
from ..slot.fused import SLOT_MODES
from ..merge import get_merge_mode, merge_adapters
from ._prag_slot import SlotPeftModel
from .prag_data import PragDataFile, common_test_id, parse_adapter_path, pick_passages
from ..weights import FusionWeights
from .base import Lifecycle, Shim, WeightProvider, wrapping
from .context import caller_test_id, clear_context, get_context
from .context import set_context  # noqa: F401  (re-exported: prag.set_context(question, passages))

logger = logging.getLogger(__name__)

__all__ = ["PragShim", "install", "uninstall", "installed", "is_installed", "set_context", "clear_context"]

_LIFE = Lifecycle("fcprag prag")
# adapter name -> path, per live LoraModel (weak: PRAG builds a new one per question)
_paths: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()


class PragShim(Shim):
    """An installed PRAG shim (:class:`~fcprag_plugin.hosts.base.Shim`) with its data-file mapping."""

    who = "fcprag prag"
    lifecycle = _LIFE

    def __init__(self, controller: FusionController | str | Path | None = None, encoder: Any = None,
                 mode: str = "cat", log: str | Path | None = None, data_file: str | Path | None = None,
                 repair: bool = True, use_slot: bool = False, max_adapters: int | None = None) -> None:
        get_merge_mode(mode)  # a typo fails now, not at the first question
        if use_slot and mode not in SLOT_MODES:
            raise HookError(f"fcprag prag: use_slot supports modes {list(SLOT_MODES)}, not '{mode}' (an SVD merge "
                            f"needs the materialised adapter): run without {kw('use_slot', True)}",
                            params=[("use_slot", True)])
        super().__init__(WeightProvider(controller, encoder), mode, log=log, use_slot=use_slot,
                         max_adapters=max_adapters)
        self._slot_models: "weakref.WeakKeyDictionary[Any, SlotPeftModel]" = weakref.WeakKeyDictionary()
        self._stores: dict[torch.device, AdapterStore] = {}
        self.data = PragDataFile(data_file) if data_file is not None else None
        self.repair = repair

    def apply(self) -> None:
        """Patch peft at class level (see the module docstring)."""
        from peft import PeftModel
        from peft.tuners.lora import LoraModel

        self.patches.patch(LoraModel, "add_weighted_adapter", wrapping(_add_weighted_adapter))
        self.patches.patch(PeftModel, "from_pretrained", lambda orig: classmethod(
            wrapping(_from_pretrained)(orig.__func__)))  # the function under the classmethod
        self.patches.patch(PeftModel, "load_adapter", wrapping(_load_adapter))
        if peft_has_stale_config_bug():
            self.patches.patch(LoraModel, "unload", wrapping(_unload))
            self.patches.patch(LoraModel, "merge_and_unload", wrapping(_unload))

    def close(self) -> None:
        for sm in list(self._slot_models.values()):
            sm.close()
        self._slot_models = weakref.WeakKeyDictionary()
        self._stores.clear()
        super().close()

    def merge(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        """``LoraModel.add_weighted_adapter`` (arguments ``bound``) with the question's ``w~``, logged."""
        args = bound.arguments
        tuner, merge_name = args["self"], args["adapter_name"]
        if merge_name in tuner.peft_config:  # peft returns without doing anything: keep that
            return original(*bound.args, **bound.kwargs)
        names = [str(n) for n in args["adapters"]]
        paths = [_paths.get(tuner, {}).get(n) for n in names]
        host = {"weights": args.get("weights"), "combination_type": args.get("combination_type")}
        t0 = time.perf_counter()
        verify_adapters(tuner, names, paths)
        if self.use_slot:
            self.warn_once("peft_layers", "fcprag prag (use_slot): adapters %s are PEFT modules (loaded before the "
                           "shim was installed, or trainable): PEFT merges them, not the fused slot", names)
        ctx, fw = self.question_weights(merge_name, names, paths, lambda: live_adapters(tuner, names))
        if self.mode == "cat":  # PEFT's own cat merge with w~: exactly PRAG's merge when w~ = 1
            args["weights"], args["combination_type"] = list(fw.merge_weights), "cat"
            result = original(*bound.args, **bound.kwargs)
        else:
            merged = merge_adapters(live_adapters(tuner, names), fw.merge_weights, self.mode).adapter
            result = add_merged_adapter(tuner, merge_name, merged, like=names[0])
        self.log_merge(ctx, fw, names, paths, merge_name, host, t0)
        return result

    def question_weights(self, merge_name: str, names: list[str], paths: list[str | None],
                         adapters: Callable[[], list[LoraAdapter]]) -> tuple[dict[str, Any], FusionWeights]:
        """The context (question, one passage per adapter in adapter order, ``test_id``, ``source``) and weights of
        merge ``merge_name`` of adapters ``names`` loaded from ``paths`` (``adapters``: their factors, read when the
        controller needs them)."""
        if not names:
            raise HookError(f"add_weighted_adapter('{merge_name}'): no adapters to merge (N == 0); load at least one "
                            "passage adapter first")
        parsed = [parse_adapter_path(p) for p in paths]

        def from_data_file() -> dict[str, Any] | None:
            if self.data is None:
                return None
            bad = [p or f"adapter '{n}' (path unknown)" for n, p, q in zip(names, paths, parsed) if q is None]
            if bad:
                raise HookError(f"cannot map {bad[0]} to the PRAG data file {self.data.path}: expected an adapter "
                                "loaded from '.../data_{test_id}/passage_{pid}'")
            return {**self.data.context(parsed), "source": "data_file", "aligned": True}  # type: ignore[arg-type]

        shown = [p or n for n, p in zip(names, paths)]
        ctx = get_context(from_data_file, what=f"merge of adapters {shown}")
        if not ctx.get("aligned"):  # one passage per adapter: by the passage_{pid} of its path, else by position
            if all(p is not None for p in parsed):
                ctx["passages"] = pick_passages(parsed, ctx["passages"],  # type: ignore[arg-type]
                                                f"the {ctx['source']} context")
            elif len(ctx["passages"]) != len(names):
                raise HookError(f"merging {len(names)} adapters {shown} but the {ctx['source']} context has "
                                f"{len(ctx['passages'])} passages; they must pair up in order")
        if ctx.get("test_id") is None:
            ctx["test_id"] = common_test_id(parsed)
        ctx["test_id"] = caller_test_id(ctx)
        return ctx, self.weigher.weights(ctx["question"], ctx["passages"], adapters=adapters)

    def log_merge(self, ctx: dict[str, Any], fw: FusionWeights, names: list[str], paths: list[str | None],
                  merge_name: str, host: dict[str, Any], t0: float, slot_info: str | None = None) -> None:
        """Log one merged question (``host``: PRAG's own arguments to ``add_weighted_adapter``)."""
        host_weights = host.get("weights")
        if host_weights is not None and any(float(x) != 1.0 for x in host_weights):
            self.warn_once("host_weights", "fcprag: add_weighted_adapter was called with non-uniform weights "
                            "%s; they are replaced by the controller's weights", list(host_weights))
        if ctx["source"] == "set_context":
            clear_context()  # consumed: a forgotten set_context must not leak into the next question
        record = {"test_id": ctx.get("test_id"), "question": ctx["question"], "adapters": names,
                  "adapter_paths": paths, **fw.to_json(), "mode": self.mode, "n": len(names),
                  "context_source": ctx["source"], "host_combination_type": host.get("combination_type"),
                  "merge_adapter": merge_name, "use_slot": slot_info is not None,
                  "merge_time_s": time.perf_counter() - t0, **({"slot": slot_info} if slot_info else {})}
        self.log_record(record)
        logger.debug("prag merge %s: w~=%s (%s)", merge_name, fw.merge_weights, ctx["source"])

    def slot_model(self, base: Any, model_id: Any, adapter_name: Any) -> SlotPeftModel:
        """``PeftModel.from_pretrained(base, model_id, adapter_name)`` under ``use_slot``: a :class:`SlotPeftModel`
        with adapter ``adapter_name`` loaded and active (the previous question's one on ``base`` is closed)."""
        if isinstance(base, SlotPeftModel):
            raise HookError("fcprag prag (use_slot): PeftModel.from_pretrained() on a model that already holds "
                            "adapters; call unload() on it first and pass the model unload() returns")
        old = self._slot_models.get(base)
        if old is not None:
            old.close()  # a previous question dropped without unload(), as PEFT would leave its layers
        sm = SlotPeftModel(self, base, model_id, str(adapter_name))
        self._slot_models[base] = sm
        return sm

    def read_adapter(self, model_id: Any, base: Any) -> Any:
        """The packed adapter of directory ``model_id`` on ``base``'s device, through the shim's store."""
        device = next(base.parameters()).device
        return self._stores.setdefault(device, AdapterStore(device=device)).get(model_id)

    def repair_stale_config(self, model: Any, where: str) -> None:
        if self.repair and peft_has_stale_config_bug() and has_stale_peft_config(model):
            if clear_stale_peft_config(model):
                self.warn_once("stale", "fcprag: peft %s leaves peft_config on the base model after unload() "
                                "(fixed in peft 0.19); cleared it (seen at %s). Without this, later questions would "
                                "merge only some of their passages.", package_version("peft"), where)


def verify_adapters(tuner: Any, names: Sequence[str], paths: Sequence[str | None]) -> None:
    """Every adapter must be configured, have LoRA layers in the model and a non-zero ``B`` (else a HookError)."""
    hint = (f"; peft {package_version('peft')} < 0.19 leaves a stale peft_config after unload(), so load_adapter() "
            "creates no layers: install the shim before the first question") if peft_has_stale_config_bug() else ""
    configured = set(tuner.peft_config)
    for name, path in zip(names, paths):
        label = f"adapter '{name}'" + (f" loaded from {path}" if path else "")
        if name not in configured:
            raise HookError(f"{label} is not loaded in the model (loaded: {sorted(configured)})")
        layers = live_lora_layers(tuner.model, name)
        if not layers:
            raise HookError(f"{label} has no LoRA layers in the model: its weights were loaded nowhere{hint}")
        nonzero = torch.stack([lora_b_weight(layer, name).detach().ne(0).any() for _, layer in layers]).any()
        if not bool(nonzero):
            raise HookError(f"{label}: every lora_B weight in the model is zero, so it would change nothing "
                            "(weights not loaded, or the adapter was saved before training)")


def live_adapters(tuner: Any, names: Sequence[str]) -> list[LoraAdapter]:
    """The adapters ``names`` as PRAG loaded them into the live model (copies of their factors)."""
    return [LoraAdapter.from_peft_model(tuner.model, n) for n in names]


def add_merged_adapter(tuner: Any, name: str, merged: LoraAdapter, like: str) -> None:
    """Add ``merged`` (scaling 1) to the live model as adapter ``name``, configured like ``like`` with ``r =
    lora_alpha =`` its largest module rank (as PEFT's ``cat``); smaller ranks are zero-padded (``B A`` unchanged)."""
    r = max(m.rank for m in merged.modules.values())
    tuner.peft_config[name] = dataclasses.replace(tuner.peft_config[like], r=r, lora_alpha=r, rank_pattern={},
                                                  alpha_pattern={}, use_rslora=False)
    tuner.inject_adapter(tuner.model, name)
    layers = dict(live_lora_layers(tuner.model, name))
    with torch.no_grad():
        for module, m in merged.modules.items():
            if module not in layers:
                raise HookError(f"merged module '{module}' has no '{name}' layer in the model")
            a, b = layers[module].lora_A[name].weight, layers[module].lora_B[name].weight
            a.zero_()[: m.rank].copy_(m.A)
            b.zero_()[:, : m.rank].copy_(m.B)


_signature = functools.cache(inspect.signature)


def _bind(original: Callable[..., Any], *args: Any, **kwargs: Any) -> inspect.BoundArguments | None:
    """``original``'s call arguments (defaults applied) while a shim is installed; else, or for a bad call, None."""
    if _LIFE.current is None:
        return None
    try:
        bound = _signature(original).bind(*args, **kwargs)
    except TypeError:
        return None  # let peft report the bad call itself
    bound.apply_defaults()
    return bound


def _add_weighted_adapter(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    bound = _bind(original, self, *args, **kwargs)
    return original(self, *args, **kwargs) if bound is None else _LIFE.current.merge(original, bound)


def _remember(peft_model: Any, bound: inspect.BoundArguments | None) -> None:
    """Note the path of the adapter just loaded into ``peft_model`` (``bound``: the load call's arguments)."""
    a = bound.arguments if bound is not None else {}
    tuner, name, path = getattr(peft_model, "base_model", None), a.get("adapter_name"), a.get("model_id")
    if tuner is not None and name is not None and path is not None:
        _paths.setdefault(tuner, {})[str(name)] = str(path)


def _from_pretrained(func: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    shim = _LIFE.current
    bound = _bind(func, cls, *args, **kwargs)
    if bound is not None:
        a = bound.arguments
        if shim.use_slot and not a.get("is_trainable") and a.get("config") is None:
            return shim.slot_model(a["model"], a["model_id"], a.get("adapter_name", "default"))
        shim.repair_stale_config(a["model"], "PeftModel.from_pretrained")
    result = func(cls, *args, **kwargs)
    _remember(result, bound)
    return result


def _load_adapter(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(self, *args, **kwargs)
    _remember(self, _bind(original, self, *args, **kwargs))
    return result


def _unload(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    shim = _LIFE.current
    model = original(self, *args, **kwargs)
    if shim is not None:
        shim.repair_stale_config(model, f"{original.__name__}()")
    return model


def install(controller: FusionController | str | Path | None = None, encoder: Any = None, mode: str = "cat",
            log: str | Path | None = None, data_file: str | Path | None = None, *, repair: bool = True,
            use_slot: bool = False, max_adapters: int | None = None) -> PragShim:
    """Install the PRAG shim before PRAG's question loop (installing again keeps one set of patches, new options).
    ``controller``: a :class:`FusionController` or its directory (None: PRAG's own merge); ``encoder``: default the
    controller's; ``mode``: ``cat`` (exact, peft's own cat with ``w~``), ``separate`` or ``svd``; ``log``: JSON
    Lines, one record per question; ``data_file``: PRAG's augmented data file or directory (maps adapter paths to
    questions); ``repair``: clear the stale ``peft_config`` after ``unload()`` on peft < 0.19; ``use_slot``:
    ``from_pretrained`` returns a ``SlotPeftModel`` on a fused slot (``max_adapters``: its fixed capacity)."""
    return _LIFE.install(PragShim(controller, encoder, mode, log, data_file, repair, use_slot, max_adapters))


uninstall = _LIFE.uninstall  # every patch reverted exactly, the shim's fused slots removed
is_installed = _LIFE.is_installed


def installed(*args: Any, **kwargs: Any) -> ContextManager[PragShim]:
    """``with prag.installed(controller=DIR): ...`` (:func:`install`'s arguments); restores the previous state."""
    return _LIFE.installed(PragShim(*args, **kwargs))
