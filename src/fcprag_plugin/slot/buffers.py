"""The buffers of a :class:`~fcprag_plugin.slot.FusedSlot` and their writes: per layout group and device, ``A [L,
K*R, in]`` and ``BT [L, K*R, out]`` (:class:`Segment`); adapters checked against them (:meth:`SlotBuffers.pack`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..adapter import LoraAdapter, LoraModule
from ..errors import MergeError
from ..merge import factors
from .layout import Layout, PackedAdapter, PackedGroup, check_layouts, pack_adapter
from .store import AdapterStore


@dataclass
class Segment:
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

    def scratch_like(self, key: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = self.scratch.get(key)
        if t is None or t.shape != like.shape or t.dtype != dtype:
            t = self.scratch[key] = torch.empty(like.shape, dtype=dtype, device=like.device)
        return t

    def zero_tail(self, used: int) -> None:
        if self.dirty > used:
            self.rows("A", used, self.dirty).zero_()
        self.dirty = used

    def sources(self, p: PackedAdapter, coef: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Adapter ``p``'s rows for this segment: ``(A [l, r, in], BT [l, r, out], coef * its scaling)``."""
        pg = p.groups[self.group]
        src_A, src_B = pg.A, pg.BT
        if self.l0 != 0 or self.l1 != src_A.shape[0]:
            src_A, src_B = src_A[self.l0:self.l1], src_B[self.l0:self.l1]
        if pg.scale is not None:
            return src_A, src_B, coef * pg.scale
        return src_A, src_B, (coef * pg.scales[self.l0:self.l1]).to(torch.float32).view(-1, 1, 1)


class SlotBuffers:
    """The buffers of ``modules`` (per layout group, per layer) for ``k`` adapters of rank <= ``r``; ``entries[g][l]``
    (what each module's hook reads) get their views at every :meth:`allocate`. ``dtype`` None: each weight's."""

    def __init__(self, layout: Layout, modules: list[list[nn.Module]], entries: list[list[Any]],
                 dtype: torch.dtype | None, out_major: bool) -> None:
        self.layout, self.modules, self.entries, self.dtype, self.out_major = layout, modules, entries, dtype, out_major
        self.k = self.r = 0
        self.segments: list[Segment] = []

    def allocate(self, k: int, r: int, buffers_from: PackedAdapter | None = None) -> None:
        """Zeroed buffers for ``k`` adapters of rank ``r`` (``buffers_from``'s stacks where they fit as they are)."""
        self.k, self.r, KR = k, r, k * r
        self.segments = []
        for gi, (g, mods) in enumerate(zip(self.layout.groups, self.modules)):
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
                seg = Segment(gi, l0, l1, A, BT)
                self.segments.append(seg)
                for l in range(l0, l1):  # the entry objects the hooks hold get the new views
                    self.entries[gi][l].A, self.entries[gi][l].BT = seg.A[l - l0], seg.BT[l - l0]

    def _fits(self, pg: PackedGroup, whole_group: bool, KR: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a packed group's stacks can serve as one segment's buffers as they are."""
        BT = pg.BT.transpose(1, 2) if self.out_major else pg.BT  # the layout the slot's writes assume
        return whole_group and pg.rank == KR and (pg.A.dtype, pg.A.device) == (dtype, device) \
            and pg.A.is_contiguous() and BT.is_contiguous()

    nbytes = property(lambda self: sum(t.numel() * t.element_size() for s in self.segments for t in (s.A, s.BT)))

    def pack(self, adapters: Sequence[Any], store: AdapterStore | None) -> tuple[list[PackedAdapter], Any]:
        """``FusedSlot.prepare``, directories read through ``store`` (a new one when None) -> (packed, store)."""
        if isinstance(adapters, (str, Path, LoraAdapter, PackedAdapter)):
            raise MergeError("adapters must be a list (one per passage), got a single adapter")
        n = len(adapters)
        if n == 0:
            raise MergeError("no adapters to merge (N == 0)")
        if n > self.k:
            raise MergeError(f"{n} adapters do not fit this slot (max_adapters K={self.k}); create the slot "
                             f"with max_adapters>={n} or call slot.resize({n})")
        packed: list[PackedAdapter] = []
        for i, a in enumerate(adapters):
            if isinstance(a, PackedAdapter):
                packed.append(a)
            elif isinstance(a, LoraAdapter):
                packed.append(pack_adapter(a, out_major=self.out_major))
            elif isinstance(a, (str, Path)):
                store = AdapterStore() if store is None else store
                packed.append(store.get(a))
            else:
                raise MergeError(f"adapter {i} is a {type(a).__name__}; expected a PackedAdapter, a LoraAdapter "
                                 "or an adapter directory")
        check_layouts(self.layout, packed, "FusedSlot")
        for i, p in enumerate(packed):
            if p.max_rank > self.r:
                raise MergeError(f"adapter {i} ({p.source}) has rank {p.max_rank} > the slot's max_rank "
                                 f"R={self.r}; create the slot with max_rank>={p.max_rank} or call "
                                 f"slot.resize(max_rank={p.max_rank})")
        return packed, store

    @torch.no_grad()
    def write_cat(self, packed: Sequence[PackedAdapter], coefs: Sequence[float]) -> None:
        """Adapter i -> rows ``i*R ..``: ``A = coefs[i] * s * A_i``, ``BT = B_i^T``."""
        R = self.r
        for seg in self.segments:
            for i, p in enumerate(packed):
                src_A, src_BT, coef = seg.sources(p, coefs[i])
                lo, hi = i * R, i * R + src_A.shape[1]
                if hi < lo + R and seg.dirty > hi:
                    seg.rows("A", hi, lo + R).zero_()  # leftovers of a larger adapter
                factors.scaled_copy(seg.rows("A", lo, hi), src_A, coef)
                seg.rows("BT", lo, hi).copy_(src_BT)
            seg.zero_tail(len(packed) * R)

    def check_equal_ranks(self, packed: Sequence[PackedAdapter], what: str = "mode 'separate'") -> None:
        """:func:`factors.check_equal_ranks` for every layout group."""
        for gi, g in enumerate(self.layout.groups):
            factors.check_equal_ranks([p.groups[gi].ranks for p in packed], g.names[0], [p.source for p in packed],
                                      what, [p.groups[gi].rank for p in packed])

    @torch.no_grad()
    def write_separate(self, packed: Sequence[PackedAdapter], u: Sequence[float]) -> None:
        """Rows ``0 .. r``: ``A = sum_i u_i s_i A_i``, ``BT = sum_i u_i B_i^T`` (:func:`factors.weighted_sum_into`)."""
        self.check_equal_ranks(packed)
        for seg in self.segments:
            r = packed[0].groups[seg.group].rank
            As, BTs, coefs = zip(*(seg.sources(p, ui) for p, ui in zip(packed, u)))
            factors.weighted_sum_into(seg.rows("A", 0, r), As, coefs, seg.scratch_like, "A")
            factors.weighted_sum_into(seg.rows("BT", 0, r), BTs, u, seg.scratch_like, "BT")
            seg.zero_tail(r)

    def as_adapter(self, rows: int, source: str) -> LoraAdapter:
        """The first ``rows`` rows as a :class:`LoraAdapter` (scaling 1; copies)."""
        modules = {}
        for seg in self.segments:
            g = self.layout.groups[seg.group]
            for l in range(seg.l0, seg.l1):
                A = seg.A[l - seg.l0, :rows].float().cpu().clone()
                B = seg.BT[l - seg.l0, :rows].T.float().cpu().contiguous()
                B[:, (A == 0).all(1)] = 0  # padding rows: B may hold leftovers there (harmless: A is zero)
                modules[g.names[l]] = LoraModule(A, B, 1.0)
        return LoraAdapter(modules, {"r": rows, "lora_alpha": rows}, source)
