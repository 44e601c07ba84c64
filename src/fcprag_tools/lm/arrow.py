"""Arrow routing over plain LoRA adapters, many sequences at once, each sequence with its own adapter set.

The same arithmetic as PEFT's training-free Arrow router (``peft.ArrowConfig`` + ``create_arrow_model``, PEFT >=
0.18), without its per-question set-up (re-injected LoRA modules, a router adapter, prototypes rebuilt on each new
model). Per target module ``m`` and adapter ``e`` of a sequence's set ``S_b`` (``N_b`` adapters):

- the prototype ``p_e`` is the top right singular vector of ``B_e A_e``, found as PEFT finds it: :data:`ITERS` power
  iterations on ``A_e^T (B_e^T B_e) A_e`` in float32, from a unit start drawn by a generator seeded with
  :data:`SEED` on the adapter's device (the same start for every module of one input width), each step divided by
  ``norm + 1e-8``. It is computed once per adapter and kept with it (:func:`prototypes`);
- per token, with ``x`` the module's input cast to float32 (the output of the modules before it, themselves
  routed), the scores are ``|x . p_e|`` (the sign of a singular vector is arbitrary, so only its size counts);
- the ``k_b = min(top_k, N_b)`` largest scores are kept, the others set to ``-inf``, and ``c = softmax(scores / T)``;
- the module returns ``y + sum_e c_e s_e B_e A_e x``: the base output ``y`` once, plus the routed sum with each
  adapter's own scaling ``s_e`` (``alpha / r``), added in float32 and rounded back to ``y``'s dtype.

Routing is per token, so sequences in one batch never see each other's adapters: a batch equals each sequence
alone up to float rounding. :func:`arrow_routing` installs forward hooks on the target modules for one block and
removes them on exit; no model weight is written (tests: ``tests/tools/lm/test_arrow.py``, against PEFT's own
``create_arrow_model`` where PEFT has Arrow).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.errors import MergeError
from .mixed import union_weights

ITERS = 15  # PEFT's power iterations per prototype
SEED = 0  # PEFT's ArrowConfig.rng_seed as the study sets it
EPS = 1e-8


@dataclass(frozen=True)
class ArrowSettings:
    """``top_k`` adapters per token (at most the sequence's own count), the softmax ``temperature``, and how the
    prototypes are found (``iters`` power iterations from a start seeded with ``seed``)."""

    top_k: int = 3
    temperature: float = 1.0
    iters: int = ITERS
    seed: int = SEED

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise MergeError(f"Arrow top_k must be >= 1, got {self.top_k}")
        if not self.temperature > 0:
            raise MergeError(f"Arrow temperature must be > 0, got {self.temperature}")


# id(adapter) -> (weak reference, (iters, seed), {module: prototype [in] float32}); an entry leaves with its adapter
_PROTOS: dict[int, tuple[Any, tuple[int, int], dict[str, torch.Tensor]]] = {}


def _cached(adapter: LoraAdapter, key: tuple[int, int]) -> dict[str, torch.Tensor] | None:
    hit = _PROTOS.get(id(adapter))
    return hit[2] if hit is not None and hit[0]() is adapter and hit[1] == key else None


@torch.no_grad()
def prototypes(adapters: Sequence[LoraAdapter], settings: ArrowSettings = ArrowSettings()
               ) -> list[dict[str, torch.Tensor]]:
    """Each adapter's ``{module: prototype}`` (float32, on the adapter's device), computed once per adapter object
    and kept while it lives; the ones not yet known are computed together, one batched power iteration per
    (device, input width, output width, rank)."""
    key = (settings.iters, settings.seed)
    todo = [a for a in {id(a): a for a in adapters}.values() if _cached(a, key) is None]
    groups: dict[tuple, list[tuple[LoraAdapter, str]]] = {}
    for a in todo:
        for name, m in a.modules.items():
            groups.setdefault((m.A.device, m.in_features, m.out_features, m.rank), []).append((a, name))
    found: dict[int, dict[str, torch.Tensor]] = {id(a): {} for a in todo}
    for (dev, n_in, _, _), members in groups.items():
        A = torch.stack([a.modules[n].A for a, n in members]).to(torch.float32)  # [M, r, in]
        Bm = torch.stack([a.modules[n].B for a, n in members]).to(torch.float32)  # [M, out, r]
        C = Bm.transpose(1, 2) @ Bm  # [M, r, r]
        gen = torch.Generator(device=dev).manual_seed(settings.seed)
        v0 = torch.randn(n_in, dtype=torch.float32, device=dev, generator=gen)
        v = (v0 / (v0.norm() + EPS)).expand(len(members), n_in).unsqueeze(-1)  # [M, in, 1]
        for _ in range(settings.iters):
            w = A.transpose(1, 2) @ (C @ (A @ v))
            v = w / (w.norm(dim=1, keepdim=True) + EPS)
        for (a, name), p in zip(members, v.squeeze(-1)):
            found[id(a)][name] = p.contiguous()
    for a in todo:
        _PROTOS[id(a)] = (weakref.ref(a), key, found[id(a)])
        weakref.finalize(a, _PROTOS.pop, id(a), None)
    return [_cached(a, key) for a in adapters]


def rank_drop(k: Sequence[int]) -> torch.Tensor:
    """``[B, max k]``: True where the ``j``-th largest score of sequence ``b`` is dropped (``j >= k[b]``)."""
    k = [int(v) for v in k]
    return torch.arange(max(k)).unsqueeze(0) >= torch.tensor(k).unsqueeze(1)


def route(x: torch.Tensor, protos: torch.Tensor, mask: torch.Tensor, drop: torch.Tensor, temperature: float
          ) -> torch.Tensor:
    """Arrow's routing coefficients ``[B, T, K]`` of float32 inputs ``x [B, T, in]`` over prototypes ``[K, in]``:
    sequence ``b`` scores only its adapters (``mask [B, K]``), keeps its ``k_b`` largest ``|x . p|`` per token
    (``drop = rank_drop(k)``) and takes their softmax at ``temperature``; every other coefficient is 0."""
    sim = (x @ protos.T).abs().masked_fill(~mask.unsqueeze(1), float("-inf"))
    top, idx = sim.topk(drop.shape[1], dim=-1)  # largest first
    score = torch.full_like(sim, float("-inf")).scatter_(-1, idx, top.masked_fill(drop.unsqueeze(1), float("-inf")))
    return torch.softmax(score / temperature, dim=-1)


class _Routed:
    """One target module's routed update for a batch: the union's factors side by side (``A [R, in]``,
    ``BT [R, out]``, ``R`` = the sum of the ranks), prototypes ``P [K, in]``, scalings ``s [K]``, the row -> adapter
    index, which adapters each sequence has (``mask [B, K]``) and its ``k_b``."""

    def __init__(self, name: str, union: Sequence[LoraAdapter], protos: Sequence[dict[str, torch.Tensor]],
                 mask: torch.Tensor, k: Sequence[int], temperature: float, device: torch.device) -> None:
        mods = [a.modules[name] for a in union]
        f32 = dict(device=device, dtype=torch.float32)
        self.name, self.temperature = name, float(temperature)
        self.A = torch.cat([m.A.to(**f32) for m in mods])
        self.BT = torch.cat([m.B.to(**f32).T for m in mods])
        self.P = torch.stack([p[name].to(**f32) for p in protos])
        self.s = torch.tensor([float(m.scaling) for m in mods], **f32)
        self.row = torch.cat([torch.full((m.rank,), i, dtype=torch.long) for i, m in enumerate(mods)]).to(device)
        self.mask, self.drop = mask.to(device), rank_drop(k).to(device)

    def __call__(self, module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        if x.shape[0] != self.mask.shape[0]:
            raise MergeError(f"module '{self.name}': Arrow routing was set up for {self.mask.shape[0]} sequences but "
                             f"the module's input has shape {list(x.shape)} (batch first expected)")
        xf = x.reshape(x.shape[0], -1, x.shape[-1]).to(torch.float32)  # [B, T, in]
        c = route(xf, self.P, self.mask, self.drop, self.temperature) * self.s  # [B, T, K]
        h = (xf @ self.A.T) * c[..., self.row]  # [B, T, R]
        return (out + (h @ self.BT).reshape(*out.shape[:-1], -1)).to(out.dtype)


def _modules_of(model: nn.Module, names: Sequence[str], union: Sequence[LoraAdapter]) -> dict[str, nn.Module]:
    from fcprag_plugin.slot.fused import resolve_module

    table = dict(model.named_modules())
    first = union[0].modules
    return {n: resolve_module(table, n, (first[n].out_features, first[n].in_features)) for n in names}


@contextlib.contextmanager
def arrow_routing(model: nn.Module, per_sequence: Sequence[Sequence[LoraAdapter]],
                  settings: ArrowSettings = ArrowSettings()) -> Iterator[None]:
    """Inside the block, sequence ``b`` of every forward of ``model`` (batch first, ``len(per_sequence)``
    sequences) runs under Arrow routing over its own adapters ``per_sequence[b]`` (at least one each; an adapter
    listed by several sequences is one expert of the union). Every adapter must target the same modules. The
    forward hooks are removed on exit, also on an error; the model's weights are never written."""
    union, _, mask = union_weights(per_sequence)
    names = sorted(union[0].modules)
    odd = next((a for a in union if sorted(a.modules) != names), None)
    if odd is not None:
        raise MergeError(f"Arrow routing needs adapters on the same modules: {odd.source} targets "
                         f"{len(odd.modules)} modules, {union[0].source} {len(names)}")
    protos = prototypes(union, settings)
    k = [min(settings.top_k, len(s)) for s in per_sequence]
    mods = _modules_of(model, names, union)
    handles = []
    try:
        for name, mod in mods.items():
            handles.append(mod.register_forward_hook(_Routed(name, union, protos, mask, k, settings.temperature,
                                                             mod.weight.device)))
        yield
    finally:
        for h in handles:
            h.remove()
