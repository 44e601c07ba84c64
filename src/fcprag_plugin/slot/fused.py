"""``FusedSlot``: a LoRA slot injected once into a live model; per query only its buffers are rewritten.

Per layout group (:mod:`.layout`): ``A [L, K*R, in]`` and ``BT [L, K*R, out]``, adapter i in rows ``i*R ..
i*R+R`` (``cat``: ``w~_i s_i A_i`` and ``B_i^T``, the exact ``sum_i w~_i s_i B_i A_i``; DyPRAG's ``separate``: the
sums in the first R rows); one forward hook per target module adds ``BT^T (A x)``. No model parameter is written.
Routes (``slot.route``): ``hooks``; ``weights`` (:mod:`.fused_weights`, swapped in at :meth:`FusedSlot.write`);
``auto`` (default): hooks, switched to fused weights at the first no-grad forward that continues a KV cache (a
``generate``'s first decoding step) when the copy fits ``slot.weights_budget``, on an accelerator only."""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch import nn

from ..adapter import PEFT_PREFIX, LoraAdapter, LoraModule, strip_peft_prefix
from ..errors import MergeError
from ..merge import factors
from ..merge.core import check_weights
from .fused_weights import WeightSwap
from .store import AdapterStore
from .layout import Layout, PackedAdapter, PackedGroup, check_layouts, layout_from_shapes, layout_of, pack_adapter

logger = logging.getLogger(__name__)

SLOT_MODES = ("cat", "separate")
ROUTES = ("auto", "hooks", "weights")
AUTO_ON_CPU = False  # route 'auto' on CPU weights: keep the hooks (measured: benchmarks/bench_generate.py)
DEFAULT_MAX_RANK = 8


@dataclass
class _Segment:
    """The slot buffers of one layout group's consecutive modules living on one device."""

    group: int  # index into layout.groups
    l0: int  # first layer (index within the group)
    l1: int
    A: torch.Tensor  # [l1-l0, K*R, in]
    BT: torch.Tensor  # [l1-l0, K*R, out] (out_major: a transposed view)
    dirty: int = 0  # rows [dirty:] of A are known to be zero
    views: dict = field(default_factory=dict)  # (kind, start, stop) -> cached row views
    scratch: dict = field(default_factory=dict)  # for 'separate': f32 accumulators / products

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        key = (kind, start, stop)
        v = self.views.get(key)
        if v is None:
            v = self.views[key] = (self.A if kind == "A" else self.BT)[:, start:stop]
        return v


@dataclass(slots=True, eq=False)
class _Entry:
    """What one module's hook reads: its views into the segment buffers (set by ``_allocate``, again on resize)."""

    name: str
    A: torch.Tensor | None = None
    BT: torch.Tensor | None = None


@dataclass(slots=True, eq=False)
class _State:
    active: bool = False  # the hooks add the update
    transform: Callable[[torch.Tensor, str], torch.Tensor] | None = None  # h [..., K*R] -> h (per-sample mixtures)
    pending: Callable[[], Any] | None = None  # route 'auto': switches to fused weights


_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


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


def _continues_cache(kwargs: dict[str, Any]) -> bool:
    """Whether a forward's keyword arguments carry a non-empty KV cache (a decoding step; transformers 5 names the
    argument ``cache``, 4.x ``past_key_values``)."""
    pkv = kwargs.get("past_key_values")
    pkv = kwargs.get("cache") if pkv is None else pkv
    length = getattr(pkv, "get_seq_length", None)
    return int(length()) > 0 if callable(length) else isinstance(pkv, (tuple, list)) and len(pkv) > 0


def _make_pre_hook(state: _State):
    """Route ``auto``: before a forward without autograd that continues a KV cache (not while compiling or
    capturing a CUDA graph), switch the pending merge to fused weights."""
    def pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if state.pending is not None and not _is_compiling() and not torch.is_grad_enabled() \
                and _continues_cache(kwargs) and not (torch.cuda.is_available()
                                                      and torch.cuda.is_current_stream_capturing()):
            state.pending()

    return pre_hook


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
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.dtype = dtype
        self.store = store
        self.out_major = out_major
        self.merge_mode: str | None = None  # what write() wrote: "cat" or "separate" (None: a mixture)
        self.n_active = 0
        self._state = _State()
        self._in_context = False
        self._removed = False
        self._handles: list[Any] = []
        self._entries = [[_Entry(n) for n in g.names] for g in self.layout.groups]  # per group, per layer
        table = dict(model.named_modules())
        self._modules = [[resolve_module(table, n, (g.out_features, g.in_features)) for n in g.names]
                         for g in self.layout.groups]
        self._allocate(buffers_from)
        self._weights = WeightSwap([self._modules[s.group][l] for s in self._segments for l in range(s.l0, s.l1)])
        self._hooks = [(mod, _make_hook(entry, self._state))
                       for gi, mods in enumerate(self._modules) for entry, mod in zip(self._entries[gi], mods)]
        self._pre_handle: Any = None
        try:
            self._attach_hooks()
            root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
            if isinstance(root, nn.Module):  # where generate() calls forward (a PeftModel's inner model)
                self._pre_handle = root.register_forward_pre_hook(_make_pre_hook(self._state), with_kwargs=True)
        except Exception:
            self.remove()
            raise
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

    def _allocate(self, buffers_from: PackedAdapter | None = None) -> None:
        KR = self.max_adapters * self.max_rank
        self._segments: list[_Segment] = []
        for gi, (g, mods) in enumerate(zip(self.layout.groups, self._modules)):
            # consecutive layers on the same device share one buffer (one segment per group without device_map)
            for _, run in itertools.groupby(range(len(mods)), lambda l: (mods[l].weight.device, mods[l].weight.dtype)):
                run = list(run)
                l0, l1 = run[0], run[-1] + 1
                w = mods[l0].weight
                dt = self.dtype or w.dtype
                pg = buffers_from.groups[gi] if buffers_from is not None else None
                if pg is not None and self._fits(pg, l1 - l0 == len(mods), KR, dt, w.device):
                    A, BT = pg.A, pg.BT  # taken over: no allocation (page faults of fresh pages) and no copy
                else:
                    A = torch.zeros(l1 - l0, KR, g.in_features, device=w.device, dtype=dt)
                    if self.out_major:  # B as stored, [L, out, K*R]; BT is its transposed view
                        BT = torch.zeros(l1 - l0, g.out_features, KR, device=w.device, dtype=dt).transpose(1, 2)
                    else:
                        BT = torch.zeros(l1 - l0, KR, g.out_features, device=w.device, dtype=dt)
                seg = _Segment(gi, l0, l1, A, BT)
                self._segments.append(seg)
                for l in range(l0, l1):  # the entry objects the hooks hold get the new views
                    self._entries[gi][l].A, self._entries[gi][l].BT = seg.A[l - l0], seg.BT[l - l0]

    def _fits(self, pg: PackedGroup, whole_group: bool, KR: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a packed group's stacks can serve as one segment's buffers as they are."""
        BT = pg.BT.transpose(1, 2) if self.out_major else pg.BT  # the layout the slot's writes assume
        return whole_group and pg.rank == KR and (pg.A.dtype, pg.A.device) == (dtype, device) \
            and pg.A.is_contiguous() and BT.is_contiguous()

    @property
    def model(self) -> nn.Module | None:
        return self._model_ref()

    @property
    def active(self) -> bool:
        """Whether the slot's merge is on (through the hooks or fused weights)."""
        return self._state.active or self.on_weights

    @property
    def on_weights(self) -> bool:
        """Whether the target modules compute with fused weights now (route ``auto`` / ``weights``)."""
        return self._weights.swapped

    @property
    def weights_budget(self) -> int | None:
        """The most bytes the fused-weight copies may take (None: half the device's free memory); over it, hooks."""
        return self._weights.budget

    @weights_budget.setter
    def weights_budget(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise MergeError(f"weights_budget must be a number of bytes (an int >= 0) or None, got {value!r}")
        self._weights.budget = value

    @property
    def weights_nbytes(self) -> int:
        """Bytes of the fused-weight route: one copy of the target weights (allocated at its first use)."""
        return self._weights.nbytes

    def _attach_hooks(self) -> None:
        if not self._handles and not self._removed:
            for mod, fn in self._hooks:
                self._handles.append(mod.register_forward_hook(fn))

    def _detach_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _to_weights(self) -> bool:
        """Switch the current merge from the hooks to fused weights; False (hooks kept, logged once) when the copy
        does not fit or the weights cannot be swapped."""
        self._state.pending = None
        if self._weights.available() is not None:
            return False
        try:
            self._weights.fill([(seg.A[l - seg.l0, :seg.dirty], seg.BT[l - seg.l0, :seg.dirty])
                                for seg in self._segments for l in range(seg.l0, seg.l1)])
            self._weights.swap_in()
            self._state.active = False
            self._detach_hooks()
        except BaseException:  # interrupted half way: back to the hooks, whole
            self._weights.restore()
            self._attach_hooks()
            self._state.active = True
            raise
        return True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._segments for t in (s.A, s.BT))

    def __repr__(self) -> str:
        return (f"FusedSlot(modules={self.layout.num_modules}, max_adapters={self.max_adapters}, "
                f"max_rank={self.max_rank}, active={self.active}, n_active={self.n_active}, "
                f"merge_mode={self.merge_mode})")

    def _check_usable(self) -> None:
        if self._removed:
            raise MergeError("this FusedSlot was removed from its model; create a new one")

    def prepare(self, adapters: Sequence[Any]) -> list[PackedAdapter]:
        """Adapters (``PackedAdapter``, ``LoraAdapter`` or adapter directories) -> packed, checked against the slot."""
        if isinstance(adapters, (str, Path, LoraAdapter, PackedAdapter)):
            raise MergeError("adapters must be a list (one per passage), got a single adapter")
        n = len(adapters)
        if n == 0:
            raise MergeError("no adapters to merge (N == 0)")
        if n > self.max_adapters:
            raise MergeError(f"{n} adapters do not fit this slot (max_adapters K={self.max_adapters}); create the slot "
                             f"with max_adapters>={n} or call slot.resize({n})")
        packed: list[PackedAdapter] = []
        for i, a in enumerate(adapters):
            if isinstance(a, PackedAdapter):
                packed.append(a)
            elif isinstance(a, LoraAdapter):
                packed.append(pack_adapter(a, out_major=self.out_major))
            elif isinstance(a, (str, Path)):
                if self.store is None:
                    self.store = AdapterStore()
                packed.append(self.store.get(a))
            else:
                raise MergeError(f"adapter {i} is a {type(a).__name__}; expected a PackedAdapter, a LoraAdapter "
                                 "or an adapter directory")
        check_layouts(self.layout, packed, "FusedSlot")
        for i, p in enumerate(packed):
            if p.max_rank > self.max_rank:
                raise MergeError(f"adapter {i} ({p.source}) has rank {p.max_rank} > the slot's max_rank "
                                 f"R={self.max_rank}; create the slot with max_rank>={p.max_rank} or call "
                                 f"slot.resize(max_rank={p.max_rank})")
        return packed

    def _zero_tail(self, seg: _Segment, used: int) -> None:
        if seg.dirty > used:
            seg.rows("A", used, seg.dirty).zero_()
        seg.dirty = used

    def _sources(self, seg: _Segment, p: PackedAdapter, coef: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Adapter ``p``'s rows for segment ``seg``: ``(A [l, r, in], BT [l, r, out], coef * its scaling)``."""
        pg = p.groups[seg.group]
        src_A, src_B = pg.A, pg.BT
        if seg.l0 != 0 or seg.l1 != src_A.shape[0]:
            src_A, src_B = src_A[seg.l0:seg.l1], src_B[seg.l0:seg.l1]
        if pg.scale is not None:
            return src_A, src_B, coef * pg.scale
        return src_A, src_B, (coef * pg.scales[seg.l0:seg.l1]).to(torch.float32).view(-1, 1, 1)

    @torch.no_grad()
    def _write_cat(self, packed: Sequence[PackedAdapter], coefs: Sequence[float]) -> None:
        """Adapter i -> rows ``i*R ..``: ``A = coefs[i] * s * A_i``, ``BT = B_i^T`` (:func:`factors.write_cat`)."""
        R = self.max_rank
        for seg in self._segments:
            srcs = [self._sources(seg, p, coefs[i]) for i, p in enumerate(packed)]  # (A, BT, coef) each
            spans = [(i * R, i * R + src_A.shape[1]) for i, (src_A, _, _) in enumerate(srcs)]
            for lo, hi in spans:
                if hi < lo + R and seg.dirty > hi:
                    seg.rows("A", hi, lo + R).zero_()  # leftovers of a larger adapter
            factors.write_cat([seg.rows("A", *sp) for sp in spans], [seg.rows("BT", *sp) for sp in spans], *zip(*srcs))
            self._zero_tail(seg, len(packed) * R)

    def _check_equal_ranks(self, packed: Sequence[PackedAdapter], what: str = "mode 'separate'") -> None:
        """:func:`factors.check_equal_ranks` for every layout group of the slot."""
        for gi, g in enumerate(self.layout.groups):
            factors.check_equal_ranks([p.groups[gi].ranks for p in packed], g.names[0], [p.source for p in packed],
                                      what, [p.groups[gi].rank for p in packed])

    @torch.no_grad()
    def _write_separate(self, packed: Sequence[PackedAdapter], u: Sequence[float]) -> None:
        """Rows ``0 .. r``: ``A = sum_i u_i s_i A_i``, ``BT = sum_i u_i B_i^T`` (:func:`factors.weighted_sum_into`)."""
        self._check_equal_ranks(packed)
        for seg in self._segments:
            r = packed[0].groups[seg.group].rank
            srcs = [self._sources(seg, p, u[i]) for i, p in enumerate(packed)]
            scratch = functools.partial(self._scratch, seg)
            factors.weighted_sum_into(seg.rows("A", 0, r), [s[0] for s in srcs], [s[2] for s in srcs], scratch, "A")
            factors.weighted_sum_into(seg.rows("BT", 0, r), [s[1] for s in srcs], u, scratch, "BT")
            self._zero_tail(seg, r)

    @staticmethod
    def _scratch(seg: _Segment, key: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = seg.scratch.get(key)
        if t is None or t.shape != like.shape or t.dtype != dtype:
            t = seg.scratch[key] = torch.empty(like.shape, dtype=dtype, device=like.device)
        return t

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
            self._write_cat(packed, w)
        else:
            self._write_separate(packed, array("f", [v / n for v in w]).tolist())  # = float32 w / N
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
        w, m = _mixture_weights(merge_weights, mask, len(adapters))
        packed = self.prepare(adapters)
        self.deactivate()
        self._write_cat(packed, [1.0] * len(packed))
        self.n_active, self.merge_mode = len(packed), None
        K, R, B = self.max_adapters, self.max_rank, w.shape[0]
        if mode == "cat":
            coef = torch.zeros(B, K, R)
            coef[:, :len(packed)] = w[:, :, None]
            coef = coef.view(B, K * R)
        else:
            self._check_equal_ranks(packed, "mixed mode 'separate'")
            n = m.sum(1, keepdim=True)
            if bool((n == 0).any()):
                bad = int(torch.nonzero(n[:, 0] == 0)[0])
                raise MergeError(f"mixed mode 'separate': sample {bad} uses no adapter (its mask row is all False)")
            coef = torch.zeros(B, K)
            coef[:, :len(packed)] = (w / n.to(torch.float32)) * m
        self._state.transform = _Mixture(coef, mode, K, R)
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
        self._attach_hooks()

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
        self.max_adapters, self.max_rank = k, r
        self._allocate()
        self.n_active, self.merge_mode = 0, None
        logger.info("FusedSlot resized to K=%d, R=%d (%d bytes)", k, r, self.nbytes)

    def current_adapter(self) -> LoraAdapter:
        """The slot's current merge as a :class:`LoraAdapter` (scaling 1; copies, for checks and saving)."""
        if self.merge_mode not in SLOT_MODES:
            raise MergeError("the slot holds no weighted merge; call write() first")
        rows = self.n_active * self.max_rank if self.merge_mode == "cat" else self.max_rank
        modules = {}
        for seg in self._segments:
            g = self.layout.groups[seg.group]
            for l in range(seg.l0, seg.l1):
                A = seg.A[l - seg.l0, :rows].float().cpu().clone()
                B = seg.BT[l - seg.l0, :rows].T.float().cpu().contiguous()
                B[:, (A == 0).all(1)] = 0  # padding rows: B may hold leftovers there (harmless: A is zero)
                modules[g.names[l]] = LoraModule(A, B, 1.0)
        return LoraAdapter(modules, {"r": rows, "lora_alpha": rows}, f"FusedSlot[{self.merge_mode},N={self.n_active}]")

    def remove(self) -> None:
        """Remove the hooks and free the buffers: the model is bit for bit what it was before the slot was created
        (its weights were never written)."""
        self._removed = True  # first: deactivate() must not attach the hooks again
        self.deactivate()
        self._weights.free()
        self._detach_hooks()
        if getattr(self, "_pre_handle", None) is not None:
            self._pre_handle.remove()
            self._pre_handle = None
        self._segments = []
        self._entries = []
        model = self.model
        if model is not None and _SLOTS.get(model) is self:
            del _SLOTS[model]

    def __enter__(self) -> "FusedSlot":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _mixture_weights(merge_weights: Any, mask: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked per-sample weights ``[B, k]`` (masked entries zeroed) and the mask (default: non-zero weights)."""
    w = torch.as_tensor(merge_weights, dtype=torch.float32).detach().cpu()
    if w.ndim != 2 or w.shape[1] != k or w.shape[0] < 1:
        raise MergeError(f"mixed-batch weights have shape {list(w.shape)}, expected [B, {k}] (one row per sample, "
                         "one column per adapter of the union)")
    if not bool(torch.isfinite(w).all()):
        raise MergeError("mixed-batch weights must be finite")
    m = w != 0 if mask is None else torch.as_tensor(mask).detach().cpu().to(torch.bool)
    if m.shape != w.shape:
        raise MergeError(f"mixed-batch mask has shape {list(m.shape)}, expected {list(w.shape)}")
    return w * m, m


class _Mixture:
    """The rank-space transform of :meth:`FusedSlot.write_mixed` for ``B`` samples: ``coef`` is ``[B, K*R]`` row
    weights (``cat``) or ``[B, K]`` ``u`` (``separate``: ``h* = sum_i u_bi h_i``, then ``sum_i u_bi B_i h*``)."""

    def __init__(self, coef: torch.Tensor, mode: str, k_slot: int, rank: int) -> None:
        self.coef, self.mode, self.k, self.r, self.batch = coef, mode, k_slot, rank, coef.shape[0]
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def __call__(self, h: torch.Tensor, name: str) -> torch.Tensor:
        if h.ndim < 2 or h.shape[0] != self.batch:
            raise MergeError(f"module '{name}': the mixed batch has {self.batch} samples but the module's input has "
                             f"shape {list(h.shape[:-1])} (batch first expected; beam search or other batch "
                             "expansion needs one weight row per expanded sample)")
        c = self._cache.get((h.device, h.dtype))
        if c is None:
            c = self._cache[(h.device, h.dtype)] = self.coef.to(device=h.device, dtype=h.dtype)
        lead = (self.batch,) + (1,) * (h.ndim - 2)
        if self.mode == "cat":
            return h * c.view(*lead, -1)
        u = c.view(*lead, self.k, 1)
        hs = (h.view(*h.shape[:-1], self.k, self.r) * u).sum(-2, keepdim=True)  # [..., 1, R] = A*_b x
        return (u * hs).reshape(h.shape)


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
