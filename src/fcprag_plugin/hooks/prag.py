"""PRAG integration: replace PRAG's uniform ``add_weighted_adapter`` merge with controller weights.

One line in PRAG's ``src/inference.py`` (before the loop)::

    from fcprag_plugin.hooks import prag; prag.install(controller="path/to/controller", log="fusion.jsonl")

or the unmodified script through the launcher::

    fcprag run prag --controller DIR --log fusion.jsonl -- src/inference.py ARGS...

What the shim patches (class level, reversible, idempotent):

- ``LoraModel.add_weighted_adapter``: before every merge it checks that all N adapters really have LoRA layers
  with non-zero weights in the model, finds the question and passages (explicit :func:`set_context`, else the
  caller's locals ``question``/``passages``, else the adapter paths ``.../data_{test_id}/passage_{pid}`` mapped
  back to PRAG's data file), computes ``w~`` with the controller and merges: mode ``cat`` is peft's own cat with
  ``weights=w~`` (``dW = sum_i w~_i s_i B_i A_i``, exact); ``separate`` / ``svd`` go through
  :mod:`fcprag_plugin.merge`. One JSON line per question goes to the log.
- ``PeftModel.from_pretrained`` / ``PeftModel.load_adapter``: remember each adapter's path (for the log, the
  error messages and the data-file mapping).
- On peft < 0.19, ``LoraModel.unload`` / ``merge_and_unload`` (and ``from_pretrained`` on an already unloaded
  model): clear the ``peft_config`` that peft leaves on the base model. Without that, from the second question
  on ``load_adapter`` creates no layers and the merge silently uses only some passages.

No controller (or a ``uniform`` one) gives ``w~ = [1]*N``: PRAG's original merge.

``use_slot=True`` (``--use-slot``; modes ``cat`` and ``separate``): ``add_weighted_adapter`` builds no merged
PEFT modules. The merge ``sum_i w~_i s_i B_i A_i`` is written into a :class:`~fcprag_plugin.fast.FusedSlot` on
the base model's target Linear layers (installed once; PEFT keeps those very modules as ``base_layer`` when it
wraps them and puts them back on ``unload()``), read straight from the LoRA layers PRAG loaded. The merged name
gets a ``peft_config`` entry but no layers, so after ``set_adapter(merge)`` every PEFT adapter PRAG loaded is
inactive and the slot alone carries the update; forward pre-hooks on the base model (and its direct children)
switch the slot on exactly while the merged name is the active, enabled adapter. ``delete_adapter(merge)``,
``unload()`` and ``merge_and_unload()`` switch it off (the latter refuses while the merge is active: the slot
never writes weights). Outside a question the base model computes its original outputs bit for bit;
:func:`uninstall` removes the slot.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import time
import weakref
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..compat import (
    clear_stale_peft_config,
    has_stale_peft_config,
    layer_has_lora_bias,
    layer_use_dora,
    live_lora_layers,
    lora_b_weight,
    lora_layer_types,
    peft_has_stale_config_bug,
    peft_version,
    set_lora_factors,
)
from ..adapter import LoraAdapter
from ..controller import FusionController
from ..errors import HookError
from ..merge import get_merge_mode, merge_adapters
from ._prag_data import PragAdapterPath, PragDataFile, common_test_id, parse_adapter_path
from .base import Lifecycle, MergeHook, Shim, caller_test_id, clear_context, get_context
from .base import set_context  # noqa: F401  (re-exported: prag.set_context(question, passages))

logger = logging.getLogger(__name__)

__all__ = ["PragShim", "install", "uninstall", "installed", "is_installed", "launch", "set_context", "clear_context"]

_LIFE = Lifecycle("fcprag prag")
# adapter name -> path, per live LoraModel (weak: PRAG builds a new one per question)
_paths: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()
SLOT_MODES = ("cat", "separate")


# ----------------------------------------------------------------------------- the handle
class PragShim(Shim):
    """An installed PRAG shim: the hook (controller, encoder, log), merge mode and data-file mapping.

    Use it as a context manager or call :meth:`uninstall`. ``merges`` counts merged questions and
    ``last_record`` holds the latest per-question log record.
    """

    who = "fcprag prag"
    lifecycle = _LIFE

    def __init__(self, controller: FusionController | str | Path | None = None, encoder: Any = None,
                 mode: str = "cat", log: str | Path | None = None, data_file: str | Path | None = None,
                 repair: bool = True, use_slot: bool = False, max_adapters: int | None = None) -> None:
        get_merge_mode(mode)  # a typo fails now, not at the first question
        if use_slot and mode not in SLOT_MODES:
            raise HookError(f"fcprag prag: use_slot supports modes {list(SLOT_MODES)}, not '{mode}' (an SVD merge "
                            "needs the materialised adapter): run without use_slot / --use-slot")
        super().__init__(MergeHook(controller, encoder, mode=mode, log=log), mode, use_slot=use_slot,
                         max_adapters=max_adapters)
        self._bindings: "weakref.WeakKeyDictionary[Any, _SlotBinding]" = weakref.WeakKeyDictionary()
        _ = self.hook.encoder  # load it and check its dimension now, before the host script runs for hours
        self.data = PragDataFile(data_file) if data_file is not None else None
        self.repair = repair

    def apply(self) -> None:
        """Patch peft at class level (see the module docstring)."""
        from peft import PeftModel
        from peft.tuners.lora import LoraModel

        self.patches.patch(LoraModel, "add_weighted_adapter", _wrap_add_weighted_adapter)
        self.patches.patch(PeftModel, "from_pretrained", _wrap_from_pretrained(PeftModel))
        self.patches.patch(PeftModel, "load_adapter", _wrap_load_adapter)
        if peft_has_stale_config_bug() or self.use_slot:
            self.patches.patch(LoraModel, "unload", _wrap_unload("unload"))
            self.patches.patch(LoraModel, "merge_and_unload", _wrap_unload("merge_and_unload"))
        if self.use_slot:
            self.patches.patch(LoraModel, "delete_adapter", _wrap_delete_adapter)

    def close(self) -> None:
        """Switch off and remove this shim's fused slots (the base models are exactly as before)."""
        for b in list(self._bindings.values()):
            b.unbind()
        self._bindings = weakref.WeakKeyDictionary()
        super().close()

    # ----------------------------------------------------------------- the patched merge
    def merge(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        """Run ``LoraModel.add_weighted_adapter`` (arguments in ``bound``) with controller weights."""
        t0 = time.perf_counter()
        args = bound.arguments
        tuner, merge_name = args["self"], args["adapter_name"]
        if merge_name in tuner.peft_config:  # peft returns without doing anything: keep that
            return original(*bound.args, **bound.kwargs)
        names = [str(n) for n in args["adapters"]]
        paths = [_paths.get(tuner, {}).get(n) for n in names]
        if not names:
            raise HookError(f"add_weighted_adapter('{merge_name}'): no adapters to merge (N == 0); "
                            "load at least one passage adapter first")
        verify_adapters(tuner, names, paths)
        parsed = [parse_adapter_path(p) for p in paths]
        ctx = self._context(names, paths, parsed)
        fw = self.hook.weights(ctx["question"], ctx["passages"],
                               adapters=lambda: [LoraAdapter.from_peft_model(tuner.model, n) for n in names])
        w_tilde = list(fw.merge_weights)
        host_weights = args.get("weights")
        if host_weights is not None and any(float(x) != 1.0 for x in host_weights):
            self.warn_once("host_weights", "fcprag: add_weighted_adapter was called with non-uniform weights "
                            "%s; they are replaced by the controller's weights", list(host_weights))
        host_type = args.get("combination_type")
        if self.use_slot:
            slot_info = self._merge_on_slot(tuner, names, paths, merge_name, w_tilde)
            result = None  # peft's add_weighted_adapter returns None too
        else:
            args["weights"], args["combination_type"] = w_tilde, "cat"
            result = original(*bound.args, **bound.kwargs)
            if self.mode != "cat":
                _remerge(tuner, names, merge_name, w_tilde, self.mode)
            slot_info = None
        if ctx["source"] == "set_context":
            clear_context()  # consumed: a forgotten set_context must not leak into the next question
        record = {
            "test_id": ctx.get("test_id"),
            "question": ctx["question"],
            "adapters": names,
            "adapter_paths": paths,
            **fw.to_json(),
            "mode": self.mode,
            "n": len(names),
            "context_source": ctx["source"],
            "host_combination_type": host_type,
            "merge_adapter": merge_name,
            "use_slot": self.use_slot,
            "merge_time_s": time.perf_counter() - t0,
        }
        if slot_info is not None:
            record["slot"] = slot_info
        self.log_record(record)
        logger.debug("prag merge %s: w~=%s (%s)", merge_name, w_tilde, ctx["source"])
        return result

    def _context(self, names: list[str], paths: list[str | None],
                 parsed: list[PragAdapterPath | None]) -> dict[str, Any]:
        """Question and one passage per adapter (in adapter order), plus ``test_id`` and ``source``."""
        data = self.data

        def from_data_file() -> dict[str, Any] | None:
            if data is None:
                return None
            bad = [p or f"adapter '{n}' (path unknown)" for n, p, q in zip(names, paths, parsed) if q is None]
            if bad:
                raise HookError(f"cannot map {bad[0]} to the PRAG data file {data.path}: expected an adapter "
                                "loaded from '.../data_{test_id}/passage_{pid}'")
            return {**data.context(parsed), "source": "data_file", "aligned": True}  # type: ignore[arg-type]

        shown = [p or n for n, p in zip(names, paths)]
        ctx = get_context(from_data_file, what=f"merge of adapters {shown}")
        if not ctx.get("aligned"):
            ctx["passages"] = _align_passages(ctx["passages"], names, paths, parsed, ctx["source"])
        if ctx.get("test_id") is None:
            ctx["test_id"] = common_test_id(parsed)
        ctx["test_id"] = caller_test_id(ctx)
        return ctx

    # ----------------------------------------------------------------- use_slot
    def _merge_on_slot(self, tuner: Any, names: list[str], paths: list[str | None], merge_name: str,
                       w_tilde: list[float]) -> str:
        """Write the merge into the base model's slot and register ``merge_name`` as a layer-less adapter."""
        base = tuner.model
        old = self._bindings.get(base)
        if old is not None:
            if old.tuner() is tuner and old.merge_name in getattr(tuner, "peft_config", {}):
                raise HookError(f"fcprag prag (use_slot): add_weighted_adapter('{merge_name}') while the merged "
                                f"adapter '{old.merge_name}' still exists; the fused slot holds one merge per model: "
                                f"call delete_adapter('{old.merge_name}') first, or run without use_slot")
            old.unbind()  # a previous question whose PeftModel was dropped without delete_adapter / unload
        layers = {n: m for n, m in base.named_modules() if isinstance(m, lora_layer_types())}
        modules, rank = _slot_modules(layers, names, paths)

        def factors(name: str) -> Callable[[str], tuple[torch.Tensor, torch.Tensor, float]]:
            def get(module: str) -> tuple[torch.Tensor, torch.Tensor, float]:
                layer = layers[module]
                return (layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach(),
                        float(layer.scaling[name]))
            return get

        slot = self.slots.write(base, modules, rank, [factors(n) for n in names],
                                [f"adapter '{n}'" + (f" loaded from {p}" if p else "") for n, p in zip(names, paths)],
                                w_tilde, self.mode)
        slot.deactivate()  # written; on only while merge_name is the active adapter (the binding's pre-hook)
        cfg = copy.deepcopy(tuner.peft_config[names[0]])
        ranks = [max(int(layers[m].lora_A[n].weight.shape[0]) for m in modules) for n in names]
        total = sum(ranks) if self.mode == "cat" else ranks[0]
        cfg.r = cfg.lora_alpha = total  # informational: the slot holds the whole update (scaling folded in)
        tuner.peft_config[merge_name] = cfg
        probe = layers[modules[0]]
        self._bindings[base] = _SlotBinding(self, base, tuner, merge_name, slot, probe)
        return repr(slot)

    def binding_of(self, tuner: Any) -> "_SlotBinding | None":
        """The live slot binding of this ``LoraModel``, if its merged adapter lives in a slot."""
        b = self._bindings.get(getattr(tuner, "model", None)) if hasattr(tuner, "model") else None
        return b if b is not None and b.tuner() is tuner else None

    def slot_of(self, model: Any) -> Any:
        """The :class:`~fcprag_plugin.fast.FusedSlot` this shim installed on ``model`` (a base model), or None."""
        return self.slots.slot_of(model)

    def after_delete(self, tuner: Any, adapter_name: str) -> None:
        b = self.binding_of(tuner)
        if b is not None and b.merge_name == adapter_name:
            b.unbind()

    def before_unload(self, tuner: Any, how: str) -> None:
        b = self.binding_of(tuner)
        if b is None:
            return
        if how == "merge_and_unload" and b.merge_name in _active_names(tuner):
            raise HookError(f"fcprag prag (use_slot): merge_and_unload() with the merged adapter '{b.merge_name}' "
                            "active would drop it: its update lives in the fused slot, which never writes weights. "
                            f"Call delete_adapter('{b.merge_name}') first, or run without use_slot")
        b.unbind()

    # ----------------------------------------------------------------- stale peft_config repair
    def repair_stale_config(self, model: Any, where: str) -> None:
        if self.repair and peft_has_stale_config_bug() and has_stale_peft_config(model):
            if clear_stale_peft_config(model):
                self.warn_once("stale", "fcprag: peft %s leaves peft_config on the base model after unload() "
                                "(fixed in peft 0.19); cleared it (seen at %s). Without this, later questions would "
                                "merge only some of their passages.", peft_version(), where)


def _align_passages(passages: Sequence[str], names: list[str], paths: list[str | None],
                    parsed: list[PragAdapterPath | None], source: str) -> list[str]:
    """One passage per adapter: by the ``passage_{pid}`` in its path when all paths have one, else by position."""
    passages = list(passages)
    if parsed and all(p is not None for p in parsed):
        out = []
        for p in parsed:
            assert p is not None
            if p.pid >= len(passages):
                raise HookError(f"adapter {p.path} is passage {p.pid} but the {source} context has only "
                                f"{len(passages)} passages")
            out.append(passages[p.pid])
        return out
    if len(passages) != len(names):
        shown = [p or n for n, p in zip(names, paths)]
        raise HookError(f"merging {len(names)} adapters {shown} but the {source} context has {len(passages)} "
                        "passages; they must pair up in order")
    return passages


# ----------------------------------------------------------------------------- checks and merges on the live model
def verify_adapters(tuner: Any, names: Sequence[str], paths: Sequence[str | None]) -> None:
    """Every adapter must be configured, have LoRA layers in the model and a non-zero ``B`` somewhere.

    A failure names the adapter and the path it was loaded from.
    """
    hint = ("; peft %s < 0.19 leaves a stale peft_config after unload(), so load_adapter() creates no layers: "
            "install the shim before the first question" % peft_version()) if peft_has_stale_config_bug() else ""
    configured = set(getattr(tuner, "peft_config", {}) or {})
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


def _remerge(tuner: Any, names: list[str], merge_name: str, w_tilde: list[float], mode: str) -> None:
    """Overwrite the (cat-built) merged adapter with a ``separate`` / ``svd`` merge of the live adapters."""

    adapters = [LoraAdapter.from_peft_model(tuner.model, n) for n in names]
    merged = merge_adapters(adapters, w_tilde, mode).adapter
    layers = dict(live_lora_layers(tuner.model, merge_name))
    for module, m in merged.modules.items():
        if module not in layers:
            raise HookError(f"merged module '{module}' has no '{merge_name}' layer in the model")
        set_lora_factors(layers[module], merge_name, m.A, m.B, m.scaling)
    ranks = {m.rank for m in merged.modules.values()}
    cfg = tuner.peft_config[merge_name]
    cfg.r = cfg.lora_alpha = max(ranks)  # scaling 1; the live layers are authoritative


# ----------------------------------------------------------------------------- use_slot binding
def _active_names(tuner: Any) -> list[str]:
    active = getattr(tuner, "active_adapter", None)
    if isinstance(active, str):
        return [active]
    return list(active or [])


class _SlotBinding:
    """A merged adapter whose update lives in a slot: ``merge_name`` in one ``LoraModel``'s ``peft_config``.

    Forward pre-hooks on the base model and its direct children (peft < 0.14 runs the base model's ``forward``
    without ``__call__``, so its own hooks do not fire there; the backbone child's do) switch the slot on exactly
    while ``merge_name`` is the tuner's active adapter and its adapter layers are enabled, so ``set_adapter`` and
    ``disable_adapter()`` behave as with a materialised merge; :meth:`unbind` switches it off for good and removes
    the pre-hooks.
    """

    def __init__(self, shim: PragShim, base: Any, tuner: Any, merge_name: str, slot: Any, probe: Any) -> None:
        self.shim_ref = weakref.ref(shim)
        self.base_ref = weakref.ref(base)
        self.tuner = weakref.ref(tuner)
        self.merge_name = merge_name
        self.slot = slot
        self.probe = weakref.ref(probe)  # a LoRA layer of this tuner: its disable_adapters flag
        self.handles = [m.register_forward_pre_hook(self._pre_forward) for m in (base, *base.children())]

    def live(self) -> bool:
        tuner = self.tuner()
        if tuner is None or self.merge_name not in (getattr(tuner, "peft_config", None) or {}):
            return False
        if self.merge_name not in _active_names(tuner):
            return False
        probe = self.probe()
        return not (probe is not None and bool(getattr(probe, "disable_adapters", False)))

    def _pre_forward(self, module: Any, args: Any) -> None:
        on = self.live()
        if on and not self.slot.active:
            self.slot.resume()
        elif not on and self.slot.active:
            self.slot.deactivate()

    def unbind(self) -> None:
        self.slot.deactivate()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        shim, base = self.shim_ref(), self.base_ref()
        if shim is not None and base is not None and shim._bindings.get(base) is self:
            del shim._bindings[base]


def _slot_modules(layers: dict[str, Any], names: Sequence[str], paths: Sequence[str | None]) -> tuple[list[str], int]:
    """The Linear modules every adapter targets (the same set for all, else :class:`HookError`) and the largest
    rank. Embedding LoRA, DoRA and LoRA biases are refused with the module named."""
    ref: list[str] | None = None
    rank = 1
    for name, path in zip(names, paths):
        label = f"adapter '{name}'" + (f" loaded from {path}" if path else "")
        mods = []
        for m, layer in layers.items():
            if name in (getattr(layer, "lora_embedding_A", None) or {}):
                raise HookError(f"fcprag prag (use_slot): {label}: module '{m}' is an embedding LoRA; the fused slot "
                                "covers Linear layers only: run without use_slot")
            lora_A = getattr(layer, "lora_A", None)
            if lora_A is None or name not in lora_A:
                continue
            if layer_use_dora(layer, name) or layer_has_lora_bias(layer, name):
                raise HookError(f"fcprag prag (use_slot): {label}: module '{m}' uses DoRA or a LoRA bias, which the "
                                "fused slot cannot hold: run without use_slot")
            mods.append(m)
            rank = max(rank, int(lora_A[name].weight.shape[0]))
        if ref is None:
            ref = mods
        elif set(mods) != set(ref):
            missing, extra = sorted(set(ref) - set(mods)), sorted(set(mods) - set(ref))
            raise HookError(f"fcprag prag (use_slot): {label} targets other modules than adapter '{names[0]}' "
                            f"(missing {missing[:3]}, extra {extra[:3]}); the fused slot needs one set of target "
                            "modules per question: run without use_slot")
    assert ref is not None
    return ref, rank


# ----------------------------------------------------------------------------- patch factories
def _bind(sig: inspect.Signature, *args: Any, **kwargs: Any) -> inspect.BoundArguments | None:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None  # let peft report the bad call itself
    bound.apply_defaults()
    return bound


def _wrap_add_weighted_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def add_weighted_adapter(self: Any, *args: Any, **kwargs: Any) -> Any:
        shim = _LIFE.current
        bound = _bind(sig, self, *args, **kwargs) if shim is not None else None
        if shim is None or bound is None:
            return original(self, *args, **kwargs)
        return shim.merge(original, bound)

    return add_weighted_adapter


def _remember(tuner: Any, name: Any, path: Any) -> None:
    if tuner is not None and name is not None and path is not None:
        _paths.setdefault(tuner, {})[str(name)] = str(path)


def _wrap_from_pretrained(owner: type) -> Callable[[Any], Any]:
    def make(_bound_method: Any) -> Any:
        original_cm = vars(owner)["from_pretrained"]  # the classmethod object itself
        func = original_cm.__func__
        sig = inspect.signature(func)

        @functools.wraps(func)
        def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
            shim = _LIFE.current
            bound = _bind(sig, cls, *args, **kwargs) if shim is not None else None
            if shim is not None and bound is not None:
                shim.repair_stale_config(bound.arguments["model"], "PeftModel.from_pretrained")
            result = func(cls, *args, **kwargs)
            if bound is not None:
                _remember(getattr(result, "base_model", None), bound.arguments.get("adapter_name"),
                          bound.arguments.get("model_id"))
            return result

        return classmethod(from_pretrained)

    return make


def _wrap_load_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def load_adapter(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        bound = _bind(sig, self, *args, **kwargs) if _LIFE.current is not None else None
        if bound is not None:
            _remember(getattr(self, "base_model", None), bound.arguments.get("adapter_name"),
                      bound.arguments.get("model_id"))
        return result

    return load_adapter


def _wrap_unload(how: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def unload(self: Any, *args: Any, **kwargs: Any) -> Any:
            shim = _LIFE.current
            if shim is not None:
                shim.before_unload(self, how)  # use_slot: switch the slot off (the merge goes with the PeftModel)
            model = original(self, *args, **kwargs)
            if shim is not None:
                shim.repair_stale_config(model, f"{how}()")
            return model

        return unload

    return make


def _wrap_delete_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def delete_adapter(self: Any, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        result = original(self, adapter_name, *args, **kwargs)
        shim = _LIFE.current
        if shim is not None:
            shim.after_delete(self, adapter_name)
        return result

    return delete_adapter


# ----------------------------------------------------------------------------- public API
def install(controller: FusionController | str | Path | None = None, encoder: Any = None, mode: str = "cat",
            log: str | Path | None = None, data_file: str | Path | None = None, *, repair: bool = True,
            use_slot: bool = False, max_adapters: int | None = None) -> PragShim:
    """Install the PRAG shim (idempotent: installing again keeps one set of patches and the new options).

    Args:
        controller: a :class:`FusionController` or its directory; None = uniform (PRAG's own merge).
        encoder: a :class:`TextEncoder` or a model name/path; default: the controller's embedding model.
        mode: ``cat`` (exact, peft's own cat with ``w~``), ``separate`` or ``svd``.
        log: JSON Lines file, one record per merged question.
        data_file: PRAG's augmented data file (or its directory), to map adapter paths back to questions when
            neither :func:`set_context` nor the caller's locals give them.
        repair: clear the stale ``peft_config`` after ``unload()`` on peft < 0.19 (leave True; False only
            reproduces the bug).
        use_slot: merge into a pre-allocated :class:`~fcprag_plugin.fast.FusedSlot` instead of building merged
            PEFT modules (modes ``cat`` / ``separate``; see the module docstring). Default False.
        max_adapters: with ``use_slot``, a fixed slot capacity (more passages in one question is a
            :class:`HookError`); default None: sized for the first question and grown when a later one has more.
    """
    return _LIFE.install(PragShim(controller, encoder, mode, log, data_file, repair, use_slot, max_adapters))


def uninstall() -> None:
    """Remove every patch, restoring peft's original functions exactly, and the shim's fused slots."""
    _LIFE.uninstall()


def is_installed() -> bool:
    return _LIFE.is_installed()


def installed(controller: FusionController | str | Path | None = None, encoder: Any = None, mode: str = "cat",
              log: str | Path | None = None, data_file: str | Path | None = None, *, repair: bool = True,
              use_slot: bool = False, max_adapters: int | None = None) -> ContextManager[PragShim]:
    """``with prag.installed(controller=DIR): ...``; restores the previous state (installed or not) on exit."""
    return _LIFE.installed(PragShim(controller, encoder, mode, log, data_file, repair, use_slot, max_adapters))


def launch(script: str | Path, script_args: Sequence[str] = (), *, controller: Any = None, encoder: Any = None,
           mode: str | None = None, log: str | Path | None = None, data_file: str | Path | None = None,
           use_slot: bool | None = None, slot_max_adapters: int | None = None) -> int:
    """Run PRAG's unmodified ``script`` as ``__main__`` (its directory on sys.path, argv set) with the shim.

    ``use_slot`` / ``slot_max_adapters``: see :func:`install` (``use_slot`` / ``max_adapters``). The shim, its
    patches and its fused slot are removed when the script ends. Returns the script's exit status (``sys.exit``
    inside the script is caught and returned).
    """
    return _LIFE.launch(script, script_args, PragShim(controller, encoder, mode or "cat", log, data_file,
                                                      use_slot=bool(use_slot), max_adapters=slot_max_adapters))
