"""Packed adapters: per-layer stacks, so a merge is a handful of big ops. Target modules are grouped by pattern
(the path with layer numbers as ``*``) and shape: ``model.layers.{0..29}.mlp.gate_proj`` is one group of ``L = 30``
modules, per adapter ``A [L, r, in]``, ``BT [L, r, out]`` (``out_major``: a view of ``B [L, out, r]``) and ``scales
[L]`` (float64); ``r`` is the group's largest rank, smaller ones zero-padded. Layouts are interned by module names
and shapes, so adapters of one model share the same layout object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from ..adapter import LoraAdapter, LoraModule
from ..errors import AdapterError, MergeError


@dataclass(frozen=True)
class LayoutGroup:
    """Modules sharing one path pattern and one ``[out, in]`` shape, in layer order."""

    pattern: str
    in_features: int
    out_features: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """An ordered set of :class:`LayoutGroup` s; interned, so equal layouts are usually the same object."""

    groups: tuple[LayoutGroup, ...]

    module_names = property(lambda self: [n for g in self.groups for n in g.names])
    num_modules = property(lambda self: sum(len(g.names) for g in self.groups))

    def describe_difference(self, other: "Layout") -> str:
        """A short human-readable reason why ``other`` does not match this layout."""
        mine, theirs = set(self.module_names), set(other.module_names)
        missing, extra = sorted(mine - theirs), sorted(theirs - mine)
        if missing or extra:
            return (f"missing modules {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                    f"extra modules {extra[:3]}{'...' if len(extra) > 3 else ''}")
        shapes = {n: [g.out_features, g.in_features] for g in self.groups for n in g.names}
        for n, shape in ((n, [g.out_features, g.in_features]) for g in other.groups for n in g.names):
            if shapes[n] != shape:
                return f"module '{n}' is [out, in] = {shapes[n]} here but {shape} there"
        return "same modules in a different grouping"


_INTERNED: dict[Layout, Layout] = {}
_BY_SHAPES: dict[tuple, Layout] = {}  # (name, out, in) items in the order seen -> layout: skips regrouping


def layout_from_shapes(shapes: Mapping[str, tuple[int, int]]) -> Layout:
    """Build (and intern) the layout of modules ``name -> (out_features, in_features)``."""
    if not shapes:
        raise MergeError("no target modules: a layout needs at least one module")
    key = tuple((k, int(v[0]), int(v[1])) for k, v in shapes.items())
    if key in _BY_SHAPES:
        return _BY_SHAPES[key]
    buckets: dict[tuple[str, int, int], list[tuple[tuple[int, ...], str]]] = {}
    for name, out_f, in_f in key:
        parts = name.split(".")
        pattern = ".".join("*" if p.isdigit() else p for p in parts)
        buckets.setdefault((pattern, in_f, out_f), []).append((tuple(int(p) for p in parts if p.isdigit()), name))
    layout = Layout(tuple(LayoutGroup(pattern, in_f, out_f, tuple(n for _, n in sorted(members)))
                          for (pattern, in_f, out_f), members in sorted(buckets.items())))
    if len(_BY_SHAPES) < 256:  # a handful of models per process; bounded all the same
        layout = _BY_SHAPES[key] = _INTERNED.setdefault(layout, layout)
    return layout


def layout_of(adapter: LoraAdapter) -> Layout:
    return layout_from_shapes({k: (m.out_features, m.in_features) for k, m in adapter.modules.items()})


@dataclass
class PackedGroup:
    """One adapter's share of one layout group (see the module docstring for the shapes)."""

    A: torch.Tensor  # [L, r, in]
    BT: torch.Tensor  # [L, r, out] (out_major: the transposed view of a contiguous [L, out, r])
    scales: torch.Tensor  # [L] float64, on the CPU
    ranks: tuple[int, ...]  # the true rank of each module (<= r)
    scale: float | None = None  # the common scaling if all modules share one (the usual case)

    rank = property(lambda self: int(self.A.shape[1]))


@dataclass
class PackedAdapter:
    """An adapter as per-group contiguous stacks (:class:`PackedGroup`), read-only (slots copy from it)."""

    layout: Layout
    groups: tuple[PackedGroup, ...]
    source: str = "<memory>"
    config: dict[str, Any] = field(default_factory=dict)

    max_rank = property(lambda self: max(g.rank for g in self.groups))
    device = property(lambda self: self.groups[0].A.device)
    dtype = property(lambda self: self.groups[0].A.dtype)
    nbytes = property(lambda self: sum(t.numel() * t.element_size() for g in self.groups for t in (g.A, g.BT)))
    all_zero = property(lambda self: not any(bool(g.BT.any()) for g in self.groups),
                        doc="True when every ``B`` is zero: the adapter changes nothing (e.g. saved before training)")

    def to_lora(self) -> LoraAdapter:
        """Unpack into a :class:`LoraAdapter` (copies; for checks and interop, not for the hot path)."""
        modules = {name: LoraModule(pg.A[l, :pg.ranks[l]].clone(), pg.BT[l, :pg.ranks[l]].T.contiguous(),
                                    float(pg.scales[l]))
                   for lg, pg in zip(self.layout.groups, self.groups) for l, name in enumerate(lg.names)}
        return LoraAdapter(modules, dict(self.config), self.source)

    def __repr__(self) -> str:
        return (f"PackedAdapter(source={self.source!r}, groups={len(self.groups)}, modules={self.layout.num_modules}, "
                f"max_rank={self.max_rank}, dtype={self.dtype}, device={self.device}, bytes={self.nbytes})")


# module name -> (A [r, in], B [out, r], scaling)
FactorGetter = Callable[[str], "tuple[torch.Tensor, torch.Tensor, float]"]


def pack_factors(layout: Layout, factors: FactorGetter, source: str, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, error: type[Exception] = MergeError,
                 out_major: bool = False) -> PackedAdapter:
    """Pack one adapter given per module by ``factors(name) -> (A [r, in], B [out, r], scaling)`` into ``layout``
    on ``device`` in ``dtype`` (defaults: the factors' own); a factor of the wrong shape is an ``error`` naming the
    module, ``source`` and both shapes. ``out_major``: stack ``B`` as stored (``BT`` is its view)."""
    groups = []
    for g in layout.groups:
        As, BTs, scales, ranks = [], [], [], []
        for name in g.names:
            A, B, s = factors(name)
            if A.ndim != 2 or B.ndim != 2 or A.shape[1] != g.in_features or B.shape[0] != g.out_features \
                    or A.shape[0] != B.shape[1]:
                raise error(f"{source}: module '{name}': lora_A {list(A.shape)} / lora_B {list(B.shape)} do not "
                            f"fit the model's [out, in] = [{g.out_features}, {g.in_features}] (expected A [r, "
                            f"{g.in_features}], B [{g.out_features}, r])")
            As.append(A)
            BTs.append(B if out_major else B.T)
            scales.append(float(s))
            ranks.append(int(A.shape[0]))
        r = max(ranks)
        d, dt = As[0].device if device is None else device, dtype or As[0].dtype

        def stack(ts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
            # a smaller rank is zero-padded along its rank dim ``dim`` (rows of A / BT, columns of out-major B)
            ts = [t if t.shape[dim] == r else torch.nn.functional.pad(
                t, (0, r - t.shape[1]) if dim else (0, 0, 0, r - t.shape[0])) for t in ts]
            return torch.stack(ts).to(device=d, dtype=dt).contiguous()

        BT = stack(BTs, 1).transpose(1, 2) if out_major else stack(BTs)
        common = set(scales)
        groups.append(PackedGroup(stack(As), BT, torch.tensor(scales, dtype=torch.float64),
                                  tuple(ranks), common.pop() if len(common) == 1 else None))
    return PackedAdapter(layout, tuple(groups), source)


def pack_adapter(adapter: LoraAdapter, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, out_major: bool = False) -> PackedAdapter:
    """Copy ``adapter`` into per-group stacks (:func:`pack_factors`'s options)."""
    if not adapter.modules:
        raise AdapterError(f"{adapter.source}: the adapter has no LoRA modules to pack")
    mods = adapter.modules
    packed = pack_factors(layout_of(adapter), lambda n: (mods[n].A, mods[n].B, mods[n].scaling), adapter.source,
                          device=device, dtype=dtype, out_major=out_major)
    packed.config = dict(adapter.config)
    return packed


def check_layouts(reference: Layout, packed: Iterable[PackedAdapter], where: str) -> None:
    """Every packed adapter must have ``reference``'s layout; name the first that does not."""
    for i, p in enumerate(packed):
        if p.layout is not reference and p.layout != reference:
            raise MergeError(f"{where}: adapter {i} ({p.source}) does not fit: "
                             f"{reference.describe_difference(p.layout)}")
