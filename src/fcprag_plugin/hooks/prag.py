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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..compat import (
    clear_stale_peft_config,
    has_stale_peft_config,
    live_lora_layers,
    lora_b_weight,
    peft_has_stale_config_bug,
    peft_version,
    set_lora_factors,
)
from ..controller import FusionController
from ..errors import HookError
from ..merge import get_merge_mode, merge_adapters
from ._prag_data import PragAdapterPath, PragDataFile, common_test_id, parse_adapter_path
from .base import MergeHook, PatchSet, clear_context, find_in_callers, get_context, run_script
from .base import set_context  # noqa: F401  (re-exported: prag.set_context(question, passages))

logger = logging.getLogger(__name__)

__all__ = ["PragShim", "install", "uninstall", "installed", "is_installed", "launch", "set_context", "clear_context"]

_PATCHES = PatchSet("prag")
_state: "PragShim | None" = None
# adapter name -> path, per live LoraModel (weak: PRAG builds a new one per question)
_paths: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


# ----------------------------------------------------------------------------- the handle
class PragShim:
    """An installed PRAG shim: the hook (controller, encoder, log), merge mode and data-file mapping.

    Use it as a context manager or call :meth:`uninstall`. ``merges`` counts merged questions and
    ``last_record`` holds the latest per-question log record.
    """

    def __init__(self, controller: FusionController | str | Path | None = None, encoder: Any = None,
                 mode: str = "cat", log: str | Path | None = None, data_file: str | Path | None = None,
                 repair: bool = True) -> None:
        get_merge_mode(mode)  # a typo fails now, not at the first question
        self.mode = mode
        self.hook = MergeHook(controller, encoder, mode=mode, log=log)
        _ = self.hook.encoder  # load it and check its dimension now, before the host script runs for hours
        self.data = PragDataFile(data_file) if data_file is not None else None
        self.repair = repair
        self.merges = 0
        self.last_record: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return _state is self

    def uninstall(self) -> None:
        if _state is self:
            uninstall()

    def __enter__(self) -> "PragShim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

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
        cw = self.hook.weights(ctx["question"], ctx["passages"])
        w_tilde = [float(x) for x in cw["merge_weights"]]
        host_weights = args.get("weights")
        if host_weights is not None and any(float(x) != 1.0 for x in host_weights):
            _warn_once("host_weights", "fcprag: add_weighted_adapter was called with non-uniform weights %s; "
                       "they are replaced by the controller's weights", list(host_weights))
        host_type = args.get("combination_type")
        args["weights"], args["combination_type"] = w_tilde, "cat"
        result = original(*bound.args, **bound.kwargs)
        if self.mode != "cat":
            _remerge(tuner, names, merge_name, w_tilde, self.mode)
        if ctx["source"] == "set_context":
            clear_context()  # consumed: a forgotten set_context must not leak into the next question
        record = {
            "test_id": ctx.get("test_id"),
            "question": ctx["question"],
            "adapters": names,
            "adapter_paths": paths,
            "merge_weights": w_tilde,
            "weights": cw["weights"],
            "scores": cw["scores"],
            "g": cw["g"],
            "tau": cw["tau"],
            "controller_mode": cw["controller_mode"],
            "mode": self.mode,
            "n": len(names),
            "context_source": ctx["source"],
            "host_combination_type": host_type,
            "merge_adapter": merge_name,
            "merge_time_s": time.perf_counter() - t0,
        }
        record = _finite_or_none(record)
        self.merges += 1
        self.last_record = record
        self.hook.log(record)
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
        if ctx.get("test_id") is None:
            found = find_in_callers(("test_id",), max_depth=30)
            ctx["test_id"] = found["test_id"] if found and isinstance(found["test_id"], (int, str)) else None
        return ctx

    # ----------------------------------------------------------------- stale peft_config repair
    def repair_stale_config(self, model: Any, where: str) -> None:
        if self.repair and peft_has_stale_config_bug() and has_stale_peft_config(model):
            if clear_stale_peft_config(model):
                _warn_once("stale", "fcprag: peft %s leaves peft_config on the base model after unload() (fixed in "
                           "peft 0.19); cleared it (seen at %s). Without this, later questions would merge only "
                           "some of their passages.", peft_version(), where)


def _finite_or_none(obj: Any) -> Any:
    """NaN/inf -> None so the log stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


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
    from ..adapter import LoraAdapter

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
        shim = _state
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
            shim = _state
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
        bound = _bind(sig, self, *args, **kwargs) if _state is not None else None
        if bound is not None:
            _remember(getattr(self, "base_model", None), bound.arguments.get("adapter_name"),
                      bound.arguments.get("model_id"))
        return result

    return load_adapter


def _wrap_unload(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unload(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, *args, **kwargs)
        if _state is not None:
            _state.repair_stale_config(model, f"{original.__name__}()")
        return model

    return unload


def _apply_patches() -> None:
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

    _PATCHES.patch(LoraModel, "add_weighted_adapter", _wrap_add_weighted_adapter)
    _PATCHES.patch(PeftModel, "from_pretrained", _wrap_from_pretrained(PeftModel))
    _PATCHES.patch(PeftModel, "load_adapter", _wrap_load_adapter)
    if peft_has_stale_config_bug():
        _PATCHES.patch(LoraModel, "unload", _wrap_unload)
        _PATCHES.patch(LoraModel, "merge_and_unload", _wrap_unload)


# ----------------------------------------------------------------------------- public API
def install(controller: FusionController | str | Path | None = None, encoder: Any = None, mode: str = "cat",
            log: str | Path | None = None, data_file: str | Path | None = None, *, repair: bool = True) -> PragShim:
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
    """
    global _state
    shim = PragShim(controller, encoder, mode, log, data_file, repair)
    _apply_patches()
    if _state is not None:
        logger.info("fcprag: PRAG shim was installed already; using the new options")
    _state = shim
    return shim


def uninstall() -> None:
    """Remove every patch, restoring peft's original functions exactly."""
    global _state
    _PATCHES.revert()
    _state = None


def is_installed() -> bool:
    return _state is not None


@contextlib.contextmanager
def installed(controller: FusionController | str | Path | None = None, encoder: Any = None, mode: str = "cat",
              log: str | Path | None = None, data_file: str | Path | None = None, *, repair: bool = True
              ) -> Iterator[PragShim]:
    """``with prag.installed(controller=DIR): ...``; restores the previous state (installed or not) on exit."""
    global _state
    previous = _state
    shim = install(controller, encoder, mode, log, data_file, repair=repair)
    try:
        yield shim
    finally:
        if previous is None:
            uninstall()
        else:
            _state = previous


def launch(script: str | Path, script_args: Sequence[str] = (), *, controller: Any = None, encoder: Any = None,
           mode: str | None = None, log: str | Path | None = None, data_file: str | Path | None = None,
           use_slot: bool | None = None) -> int:
    """Run PRAG's unmodified ``script`` as ``__main__`` (its directory on sys.path, argv set) with the shim.

    Returns the script's exit status (``sys.exit`` inside the script is caught and returned).
    """
    if use_slot:
        raise HookError("--use-slot is not available for PRAG yet (the pre-allocated fused slot is being built); "
                        "run without --use-slot")
    with installed(controller, encoder, mode or "cat", log, data_file) as shim:
        try:
            run_script(script, list(script_args))
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = int(e.code or 0)
            else:
                import sys

                print(e.code, file=sys.stderr)
                code = 1
        logger.info("fcprag: merged %d questions with %s weights", shim.merges,
                    "uniform" if shim.hook.controller is None else shim.hook.controller.config.mode)
    return code
