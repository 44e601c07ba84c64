"""``FusedSlot``: a LoRA slot injected once into a live model; per query only its buffers are rewritten.

Per layout group (:mod:`.buffers`): ``A [L, K*R, in]`` and ``BT [L, K*R, out]``, adapter i in rows ``i*R ..
i*R+R`` (``cat``: ``w~_i s_i A_i`` and ``B_i^T``, the exact ``sum_i w~_i s_i B_i A_i``; DyPRAG's ``separate``: the
sums in the first R rows); one forward hook per target module adds ``BT^T (A x)``. No model parameter is written.
Routes (``slot.route``): ``hooks``; ``weights`` (:mod:`.fused_weights`, swapped in at :meth:`FusedSlot.write`);
``auto`` (default): hooks, switched to fused weights at the first no-grad forward that continues a KV cache (a
``generate``'s first decoding step) when the copy fits ``slot.weights_budget``, on an accelerator only."""

from __future__ import annotations

import logging
import weakref
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch import nn

from ..adapter import PEFT_PREFIX, LoraAdapter, strip_peft_prefix
from ..compat import is_compiling, kv_cache_continues
from ..errors import MergeError
from ..merge.core import check_weights
from .buffers import SlotBuffers
from .fused_weights import WeightSwap
from .layout import Layout, PackedAdapter, layout_from_shapes, layout_of, pack_adapter
from .mixture import Mixture, mixture_weights

logger = logging.getLogger(__name__)

SLOT_MODES = ("cat", "separate")
ROUTES = ("auto", "hooks", "weights")
AUTO_ON_CPU = False  # route 'auto' on CPU weights: keep the hooks (measured: benchmarks/bench_generate.py)
DEFAULT_MAX_RANK = 8


@dataclass(slots=True, eq=False)
class _Entry:
    """What one module's hook reads: its views into the segment buffers (set at every allocation)."""

    name: str
    A: torch.Tensor | None = None
    BT: torch.Tensor | None = None


@dataclass(slots=True, eq=False)
class _State:
    active: bool = False  # the hooks add the update
    transform: Callable[[torch.Tensor, str], torch.Tensor] | None = None  # h [..., K*R] -> h (per-sample mixtures)
    pending: Callable[[], Any] | None = None  # route 'auto': switches to fused weights


def _make_hook(entry: _Entry, state: _State):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not state.active:
            return None  # output untouched: the base model, bit for bit
        A = entry.A
        h = inputs[0].to(A.dtype) @ A.T  # [..., K*R]
        if state.transform is not None:
            h = state.transform(h, entry.name)
        return output + (h @ entry.BT).to(output.dtype)

    return hook


def _make_pre_hook(state: _State):
    """Route ``auto``: before a forward without autograd that continues a KV cache (not while compiling or
    capturing a CUDA graph), switch the pending merge to fused weights."""
    def pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if state.pending is not None and not is_compiling() and not torch.is_grad_enabled() \
                and kv_cache_continues(kwargs) \
                and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            state.pending()

    return pre_hook


class _Hooks:
    """The forward hooks on the target ``modules`` (per layout group, per layer), attached while the merge goes
    through them, and route ``auto``'s pre-hook on ``model``; after :meth:`remove`, :meth:`attach` does nothing."""

    def __init__(self, model: nn.Module, modules: list[list[nn.Module]], entries: list[list[_Entry]],
                 state: _State) -> None:
        self.hooks = [(mod, _make_hook(e, state)) for es, mods in zip(entries, modules) for e, mod in zip(es, mods)]
        self.handles: list[Any] = []
        self.pre, self.removed = None, False
        try:
            self.attach()
            root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
            if isinstance(root, nn.Module):  # where generate() calls forward (a PeftModel's inner model)
                self.pre = root.register_forward_pre_hook(_make_pre_hook(state), with_kwargs=True)
        except Exception:
            self.remove()
            raise

    def attach(self) -> None:
        if not self.handles and not self.removed:
            for mod, fn in self.hooks:
                self.handles.append(mod.register_forward_hook(fn))

    def detach(self) -> None:
        while self.handles:
            self.handles.pop().remove()

    def remove(self) -> None:
        self.removed = True
        self.detach()
        if self.pre is not None:
            self.pre.remove()
            self.pre = None


def resolve_module(table: dict[str, nn.Module], name: str, shape: tuple[int, int] | None = None) -> nn.Module:
    """Find a target module by its base-model path in ``dict(model.named_modules())``, also inside a ``PeftModel``;
    with ``shape``, its weight must be ``[out, in]`` (a :class:`MergeError` names the module and both shapes)."""
    for cand in (name, PEFT_PREFIX + name, PEFT_PREFIX + PEFT_PREFIX + name):
        mod = table.get(cand)
        if mod is not None:
            base = getattr(mod, "base_layer", None)  # a peft LoRA wrapper: hook its frozen base layer
            mod = base if isinstance(base, nn.Module) else mod
            weight = getattr(mod, "weight", None)
            if shape is not None and (weight is None or tuple(weight.shape) != shape):
                raise MergeError(f"module '{name}': model weight is {None if weight is None else list(weight.shape)}, "
                                 f"the slot's targets expect {list(shape)}")
            return mod
    sample = [n for n in table if n.endswith(name.split(".")[-1])][:2]
    raise MergeError(f"module '{name}' of the adapter is not in the model (e.g. the model has {sample})")


def _targets_rank(targets: Any, default: int) -> int:
    """The largest rank of an adapter given as ``targets``; ``default`` for module names."""
    if isinstance(targets, PackedAdapter):
        return targets.max_rank
    return max(targets.ranks.values()) if isinstance(targets, LoraAdapter) else default


def _check_sizes(max_adapters: Any, max_rank: Any) -> None:
    for key, v in (("max_adapters", max_adapters), ("max_rank", max_rank)):
        if not isinstance(v, int) or v < 1:
            raise MergeError(f"{key} must be a positive integer, got {v!r}")


def _target_layout(model: nn.Module, targets: Any) -> Layout:
    """The layout of ``targets``; module paths use the base model's names (no PEFT prefix)."""
    if isinstance(targets, PackedAdapter):
        return targets.layout
    if isinstance(targets, LoraAdapter):
        return layout_of(targets)
    if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets:
        raise MergeError(f"targets must be a LoraAdapter, a PackedAdapter or a non-empty list of module names, "
                         f"got {targets!r}")
    table = dict(model.named_modules())
    out: dict[str, tuple[int, int]] = {}
    suffixes = {t for t in targets if "." not in t}
    for t in targets:
        if "." in t:  # a full path
            mod = resolve_module(table, t)
            w = getattr(mod, "weight", None)
            if w is None or w.ndim != 2:
                raise MergeError(f"target module '{t}' has no 2-D weight (got {type(mod).__name__})")
            out[t] = (int(w.shape[0]), int(w.shape[1]))
    if suffixes:
        found = set()
        for name, mod in table.items():
            parts = name.split(".")
            if "base_layer" in parts or any(p.startswith("lora_") for p in parts) or parts[-1] not in suffixes:
                continue
            base = getattr(mod, "base_layer", None)
            mod = base if isinstance(base, nn.Module) else mod
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.Tensor) and w.ndim == 2:
                out[strip_peft_prefix(name)[0]] = (int(w.shape[0]), int(w.shape[1]))
                found.add(parts[-1])
        missing = sorted(suffixes - found)
        if missing:
            raise MergeError(f"target module name(s) {missing} match no module with a 2-D weight in the model")
    return layout_from_shapes(out)


_SLOTS: "weakref.WeakKeyDictionary[nn.Module, FusedSlot]" = weakref.WeakKeyDictionary()


class FusedSlot:
    """A reusable LoRA slot for up to ``max_adapters`` (K) adapters of rank <= ``max_rank`` (R, default the
    template's, else 8) on a transformers model or a ``PeftModel`` (its frozen base layers are hooked). ``targets``:
    an adapter whose modules every later adapter must share, or module names (full paths or bare names like
    ``"gate_proj"``). ``dtype``: buffer dtype (default: each target weight's). ``store``: the :class:`AdapterStore`
    for adapters given as paths. ``out_major``: keep ``B`` as stored, ``[L, out, K*R]``. ``buffers_from``: a packed
    adapter, used only by the slot, whose stacks become the buffers where they fit."""

    route = "auto"  # see the module docstring; per slot or for all slots

    def __init__(self, model: nn.Module, targets: Any, *, max_adapters: int, max_rank: int | None = None,
                 dtype: torch.dtype | None = None, store: Any = None, out_major: bool = False,
                 buffers_from: PackedAdapter | None = None) -> None:
        max_rank = _targets_rank(targets, DEFAULT_MAX_RANK) if max_rank is None else max_rank
        _check_sizes(max_adapters, max_rank)
        self._model_ref = weakref.ref(model)  # the hooks live on the modules; the slot must not keep a model alive
        self.layout: Layout = _target_layout(model, targets)
        self.dtype, self.store, self.out_major = dtype, store, out_major
        self.merge_mode: str | None = None  # what write() wrote: "cat" or "separate" (None: a mixture)
        self.n_active = 0
        self._state, self._in_context, self._removed = _State(), False, False
        entries = [[_Entry(n) for n in g.names] for g in self.layout.groups]  # per group, per layer
        table = dict(model.named_modules())
        modules = [[resolve_module(table, n, (g.out_features, g.in_features)) for n in g.names]
                   for g in self.layout.groups]
        self._buffers = SlotBuffers(self.layout, modules, entries, dtype, out_major)
        self._buffers.allocate(max_adapters, max_rank, buffers_from)
        self._weights = WeightSwap([modules[s.group][l] for s in self._buffers.segments for l in range(s.l0, s.l1)])
        self._hooks = _Hooks(model, modules, entries, self._state)
        logger.debug("FusedSlot: %d modules in %d groups, K=%d, R=%d, %d bytes", self.layout.num_modules,
                     len(self.layout.groups), max_adapters, max_rank, self.nbytes)

    @classmethod
    def for_model(cls, model: nn.Module, targets: Any, *, max_adapters: int, max_rank: int | None = None,
                  store: Any = None, **kwargs: Any) -> "FusedSlot":
        """The one slot on ``model``: the existing one covering ``targets`` (grown, given ``store``), else a new one."""
        slot = cls.of(model)
        if slot is not None:
            same_paths = isinstance(targets, list) and all("." in n for n in targets) \
                and set(targets) == set(slot.layout.module_names)  # skip resolving them in the model (per question)
            want = slot.layout if same_paths else _target_layout(model, targets)
            if want is slot.layout or want == slot.layout:
                max_rank = _targets_rank(targets, slot.max_rank) if max_rank is None else max_rank
                if max_adapters > slot.max_adapters or max_rank > slot.max_rank:
                    slot.resize(max(max_adapters, slot.max_adapters), max(max_rank, slot.max_rank))
                slot.store = slot.store if slot.store is not None else store
                return slot
            logger.info("FusedSlot: the target modules changed (%d -> %d modules); replacing the slot",
                        slot.layout.num_modules, want.num_modules)
            slot.remove()
        slot = cls(model, targets, max_adapters=max_adapters, max_rank=max_rank, store=store, **kwargs)
        _SLOTS[model] = slot
        return slot

    @staticmethod
    def of(model: nn.Module) -> "FusedSlot | None":
        """The slot :meth:`for_model` put on ``model``, or None."""
        slot = _SLOTS.get(model)
        return None if slot is None or slot._removed else slot

    model = property(lambda self: self._model_ref(), doc="The model (None once it is gone)")
    max_adapters = property(lambda self: self._buffers.k, doc="K: how many adapters the slot holds at most")
    max_rank = property(lambda self: self._buffers.r, doc="R: the largest rank of an adapter it holds")
    nbytes = property(lambda self: self._buffers.nbytes, doc="Bytes of the slot's buffers")
    active = property(lambda self: self._state.active or self.on_weights,
                      doc="Whether the slot's merge is on (through the hooks or fused weights)")
    on_weights = property(lambda self: self._weights.swapped, doc="Whether the target modules compute with fused "
                          "weights now (route ``auto`` / ``weights``)")
    weights_nbytes = property(lambda self: self._weights.nbytes, doc="Bytes of the fused-weight route: one copy of "
                              "the target weights (allocated at its first use)")

    @property
    def weights_budget(self) -> int | None:
        """The most bytes the fused-weight copies may take (None: half the device's free memory); over it, hooks."""
        return self._weights.budget

    @weights_budget.setter
    def weights_budget(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise MergeError(f"weights_budget must be a number of bytes (an int >= 0) or None, got {value!r}")
        self._weights.budget = value

    def _to_weights(self) -> bool:
        """Switch the current merge from the hooks to fused weights; False (hooks kept, logged once) when the copy
        does not fit or the weights cannot be swapped."""
        self._state.pending = None
        if self._weights.available() is not None:
            return False
        try:
            self._weights.fill([(s.A[l - s.l0, :s.dirty], s.BT[l - s.l0, :s.dirty])
                                for s in self._buffers.segments for l in range(s.l0, s.l1)])
            self._weights.swap_in()
            self._state.active = False
            self._hooks.detach()
        except BaseException:  # interrupted half way: back to the hooks, whole
            self._weights.restore()
            self._hooks.attach()
            self._state.active = True
            raise
        return True

    def __repr__(self) -> str:
        return (f"FusedSlot(modules={self.layout.num_modules}, max_adapters={self.max_adapters}, "
                f"max_rank={self.max_rank}, active={self.active}, n_active={self.n_active}, "
                f"merge_mode={self.merge_mode})")

    def _check_usable(self) -> None:
        if self._removed:
            raise MergeError("this FusedSlot was removed from its model; create a new one")

    def prepare(self, adapters: Sequence[Any]) -> list[PackedAdapter]:
        """Adapters (``PackedAdapter``, ``LoraAdapter`` or adapter directories) -> packed, checked against the slot."""
        packed, self.store = self._buffers.pack(adapters, self.store)
        return packed

    def write(self, adapters: Sequence[Any], merge_weights: Any = None, mode: str = "cat") -> "FusedSlot":
        """Write the weighted merge of ``adapters`` (``w~``, default ``[1]*N``) and switch it on: ``cat`` is the exact
        ``sum_i w~_i s_i B_i A_i``, ``separate`` DyPRAG's ``(sum u_i B_i)(sum u_i s_i A_i)``, ``u = w~/N``."""
        self._check_usable()
        if mode not in SLOT_MODES:
            raise MergeError(f"FusedSlot mode '{mode}' is not supported; expected one of {list(SLOT_MODES)} "
                             "(use fcprag_plugin.merge for 'svd')")
        if self.route not in ROUTES:
            raise MergeError(f"FusedSlot.route is {self.route!r}; expected one of {list(ROUTES)}")
        packed = self.prepare(adapters)
        n = len(packed)
        w = check_weights(merge_weights, n)
        self.deactivate()
        if mode == "cat":
            self._buffers.write_cat(packed, w)
        else:
            self._buffers.write_separate(packed, array("f", [v / n for v in w]).tolist())  # = float32 w / N
        self.n_active, self.merge_mode = len(packed), mode
        self._state.active = True
        if self.route == "weights":
            self._to_weights()
        elif self.route == "auto" and (AUTO_ON_CPU or self._weights.device_type != "cpu"):
            self._state.pending = self._to_weights
        return self

    @torch.no_grad()
    def write_mixed(self, adapters: Sequence[Any], merge_weights: Any, mode: str = "cat", mask: Any = None
                    ) -> "FusedSlot":
        """One mixture per sample of a batch: ``adapters`` (K' <= K, the batch's union), ``merge_weights [B, K']``
        (``w~`` per sample), ``mask [B, K']`` (default: the non-zero weights; ``separate`` divides by its row count).
        Applied in rank space (each sample as if alone, up to rounding); target inputs must be batch-first."""
        self._check_usable()
        if mode not in SLOT_MODES:
            raise MergeError(f"mixed-batch mode '{mode}' is not supported; expected one of {list(SLOT_MODES)}")
        w, m = mixture_weights(merge_weights, mask, len(adapters))
        packed = self.prepare(adapters)
        self.deactivate()
        self._buffers.write_cat(packed, [1.0] * len(packed))
        self.n_active, self.merge_mode = len(packed), None
        if mode == "separate":
            self._buffers.check_equal_ranks(packed, "mixed mode 'separate'")
        self._state.transform = Mixture(w, m, mode, self.max_adapters, self.max_rank)
        self._state.active = True
        return self

    def mixed(self, adapters: Sequence[Any], merge_weights: Any, mode: str = "cat", mask: Any = None
              ) -> ContextManager["FusedSlot"]:
        """``with slot.mixed(union, W): model(**batch)`` -- :meth:`write_mixed` inside the block only."""
        return self._block(lambda: self.write_mixed(adapters, merge_weights, mode, mask),
                           "FusedSlot.mixed() cannot run inside another block of the same slot")

    def deactivate(self) -> None:
        """Switch the slot off: the model computes exactly its base outputs again (buffers are kept)."""
        self._state.active = False
        self._state.transform = None
        self._state.pending = None
        self._weights.restore()
        self._hooks.attach()

    def fused(self, adapters: Sequence[Any], merge_weights: Any = None, mode: str = "cat"
              ) -> ContextManager["FusedSlot"]:
        """``with slot.fused(adapters, w~): model.generate(...)`` -- active inside the block only."""
        return self._block(lambda: self.write(adapters, merge_weights, mode),
                          "FusedSlot.fused() blocks cannot be nested: the slot holds one merge at a time")

    @contextmanager
    def _block(self, switch_on: Callable[[], Any], nested_error: str) -> Iterator["FusedSlot"]:
        """``switch_on()`` for the block only; a nested block raises :class:`MergeError` (``nested_error``)."""
        if self._in_context:
            raise MergeError(nested_error)
        switch_on()
        self._in_context = True
        try:
            yield self
        finally:
            self._in_context = False
            self.deactivate()

    def resize(self, max_adapters: int | None = None, max_rank: int | None = None) -> None:
        """Reallocate for a new K and/or R (content is cleared; the hooks stay, pointed at the new buffers)."""
        self._check_usable()
        if self._in_context:
            raise MergeError("cannot resize a FusedSlot inside a fused() block")
        k = self.max_adapters if max_adapters is None else max_adapters
        r = self.max_rank if max_rank is None else max_rank
        _check_sizes(k, r)
        self.deactivate()
        self._buffers.allocate(k, r)
        self.n_active, self.merge_mode = 0, None
        logger.info("FusedSlot resized to K=%d, R=%d (%d bytes)", k, r, self.nbytes)

    def current_adapter(self) -> LoraAdapter:
        """The slot's current merge as a :class:`LoraAdapter` (scaling 1; copies, for checks and saving)."""
        if self.merge_mode not in SLOT_MODES:
            raise MergeError("the slot holds no weighted merge; call write() first")
        rows = self.n_active * self.max_rank if self.merge_mode == "cat" else self.max_rank
        return self._buffers.as_adapter(rows, f"FusedSlot[{self.merge_mode},N={self.n_active}]")

    def remove(self) -> None:
        """Remove the hooks and free the buffers: the model is exactly as before the slot was created."""
        self._removed = True
        self._hooks.remove()  # first: deactivate() must not attach them again
        self.deactivate()
        self._weights.free()
        self._buffers.segments = []
        model = self.model
        if model is not None and _SLOTS.get(model) is self:
            del _SLOTS[model]

    def __enter__(self) -> "FusedSlot":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def activate(model: nn.Module, adapter: LoraAdapter, *, dtype: torch.dtype | None = None) -> FusedSlot:
    """Apply ``adapter`` to ``model`` until the returned one-adapter :class:`FusedSlot` is removed (``remove()`` or
    ``with``); buffers in ``dtype`` (default each weight's)."""
    packed = pack_adapter(adapter, out_major=True)
    slot = FusedSlot(model, packed, max_adapters=1, dtype=dtype, out_major=True, buffers_from=packed)
    try:
        slot.write([packed])
    except Exception:
        slot.remove()
        raise
    return slot
