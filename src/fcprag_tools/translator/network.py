"""DyPRAG's parameter translator (written from its description, not from its code).

Per decoder layer and per MLP projection (``gate_proj``, ``up_proj``, ``down_proj``) two small hypernets turn a
passage embedding ``h [H]`` (the base model's last hidden state at the passage's last token, see
:mod:`.embed`) with the layer index appended, ``z = [h, layer]`` ``[H + 1]``, into that projection's LoRA factors:

    A = post_A(relu(pre_A(z))).view(r, in)        B = post_B(relu(pre_B(z))).view(out, r)

(``Linear`` layers without bias; ``width`` hidden units, DyPRAG's default 32; rank ``r``, PRAG's 2). The update they
stand for is ``B @ A`` with no ``alpha / r``, added to the projection's output as ``x @ (B @ A).T``.

State-dict layout, DyPRAG's ``ParameterTranslator``'s (a strict ``load_state_dict`` works both ways): per projection
``m`` and layer ``i`` the prefix ``projector.{m}_{i}.projector.``, then ``pre_A_linear.weight`` ``[width, H + 1]``,
``post_A_linear.weight`` ``[r * in, width]``, ``pre_B_linear.weight`` ``[width, H + 1]``, ``post_B_linear.weight``
``[out * r, width]``, and the same four tensors once more as ``A_hypernet.linear1`` / ``A_hypernet.linear2`` /
``B_hypernet.linear1`` / ``B_hypernet.linear2`` (DyPRAG registers each layer under two names). ``(in, out)`` is
``(H, I)`` for gate and up, ``(I, H)`` for down (``I``: the intermediate size).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from fcprag_plugin.adapter import PEFT_PREFIX, LoraAdapter, LoraModule
from fcprag_plugin.errors import FcpragError

MODULES = ("down_proj", "up_proj", "gate_proj")  # DyPRAG's order (its keys' order; a load does not depend on it)
INIT_STD = 1e-7  # DyPRAG draws every hypernet weight from N(0, 1e-7)


class TranslatorError(FcpragError, ValueError):
    """A translator checkpoint, its shapes or the translator's inputs are invalid (names the file, key or option)."""


@dataclass(frozen=True)
class TranslatorShape:
    """What a translator is built for: ``layers`` decoder layers (0 .. layers-1), hidden size ``hidden`` (``H``),
    intermediate size ``intermediate`` (``I``), LoRA ``rank``, hypernet ``width`` and the projections ``modules``."""

    layers: int
    hidden: int
    intermediate: int
    rank: int = 2
    width: int = 32
    modules: tuple[str, ...] = MODULES

    @classmethod
    def from_config(cls, config: Any, *, rank: int = 2, width: int = 32) -> "TranslatorShape":
        """The shape for a model config (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``)."""
        return cls(int(config.num_hidden_layers), int(config.hidden_size), int(config.intermediate_size), int(rank),
                   int(width))

    def io(self, module: str) -> tuple[int, int]:
        """``(in, out)`` features of projection ``module``."""
        return (self.intermediate, self.hidden) if module == "down_proj" else (self.hidden, self.intermediate)

    def key_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every state-dict key and its shape, in DyPRAG's order."""
        out: dict[str, tuple[int, ...]] = {}
        pre = (self.width, self.hidden + 1)
        for m in self.modules:
            d_in, d_out = self.io(m)
            post = {"A": (self.rank * d_in, self.width), "B": (d_out * self.rank, self.width)}
            for i in range(self.layers):
                p = f"projector.{m}_{i}.projector."
                for f in "AB":
                    out.update({f"{p}pre_{f}_linear.weight": pre, f"{p}post_{f}_linear.weight": post[f],
                                f"{p}{f}_hypernet.linear1.weight": pre, f"{p}{f}_hypernet.linear2.weight": post[f]})
        return out

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, intermediate {self.intermediate}, rank {self.rank}, "
                f"width {self.width}")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "modules": list(self.modules)}


def module_path(module: str, layer: int) -> str:
    """The projection's path in the model (a :class:`LoraAdapter` module name)."""
    return f"model.layers.{layer}.mlp.{module}"


def dyprag_keys(path: str) -> tuple[str, str]:
    """DyPRAG's output keys (PEFT's) of a projection path: ``(lora_A key, lora_B key)``."""
    return f"{PEFT_PREFIX}{path}.lora_A.weight", f"{PEFT_PREFIX}{path}.lora_B.weight"


class _Halves(nn.Module):
    """DyPRAG's second name for a hypernet's two layers (``linear1``, ``linear2``): the same modules again."""

    def __init__(self, linear1: nn.Linear, linear2: nn.Linear) -> None:
        super().__init__()
        self.linear1, self.linear2 = linear1, linear2


class FactorNets(nn.Module):
    """The two hypernets of one projection of one layer: ``z [N, H + 1]`` -> ``A [N, r, in]``, ``B [N, out, r]``."""

    def __init__(self, hidden: int, d_in: int, d_out: int, rank: int, width: int) -> None:
        super().__init__()
        self.rank, self.d_in, self.d_out = rank, d_in, d_out
        self.pre_A_linear = nn.Linear(hidden + 1, width, bias=False)
        self.post_A_linear = nn.Linear(width, rank * d_in, bias=False)
        self.A_hypernet = _Halves(self.pre_A_linear, self.post_A_linear)
        self.pre_B_linear = nn.Linear(hidden + 1, width, bias=False)
        self.post_B_linear = nn.Linear(width, d_out * rank, bias=False)
        self.B_hypernet = _Halves(self.pre_B_linear, self.post_B_linear)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.post_A_linear(F.relu(self.pre_A_linear(z)))  # [N, r * in], row-major [r, in]
        b = self.post_B_linear(F.relu(self.pre_B_linear(z)))  # [N, out * r], row-major [out, r]
        return a.view(-1, self.rank, self.d_in), b.view(-1, self.d_out, self.rank)


class Translator(nn.Module):
    """Passage embeddings ``[N, H]`` -> per projection path ``(A [N, r, in], B [N, out, r])``, batched over passages;
    :class:`TranslatorShape` says for what. Weights are drawn from ``N(0, init_std)`` (DyPRAG's 1e-7) by a
    generator seeded with ``seed``, on the CPU."""

    def __init__(self, shape: TranslatorShape, *, seed: int = 0, init_std: float = INIT_STD) -> None:
        super().__init__()
        self.shape = shape
        self.projector = nn.ModuleDict()
        for m in shape.modules:
            d_in, d_out = shape.io(m)
            for i in range(shape.layers):
                entry = nn.Module()  # DyPRAG nests the hypernets one level deeper: projector.{m}_{i}.projector.
                entry.projector = FactorNets(shape.hidden, d_in, d_out, shape.rank, shape.width)
                self.projector[f"{m}_{i}"] = entry
        g = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for p in self.parameters():  # each shared layer once
                p.copy_(torch.randn(p.shape, generator=g) * init_std)

    def paths(self) -> list[str]:
        """The projections' paths in the model, in the order :meth:`forward` returns them."""
        return [module_path(m, i) for m in self.shape.modules for i in range(self.shape.layers)]

    def forward(self, h: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        h = h.float()
        if h.ndim != 2 or h.shape[1] != self.shape.hidden:
            raise TranslatorError(f"the translator takes passage embeddings [N, {self.shape.hidden}], got "
                                  f"{list(h.shape)}")
        out = {}
        for m in self.shape.modules:
            for i in range(self.shape.layers):
                z = torch.cat([h, h.new_full((h.shape[0], 1), float(i))], dim=1)  # the layer index appended
                out[module_path(m, i)] = self.projector[f"{m}_{i}"].projector(z)
        return out

    def dyprag_outputs(self, h: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """One dict per passage as DyPRAG's translator returns it (``...lora_A.weight`` ``[r, in]``,
        ``...lora_B.weight`` ``[out, r]``)."""
        factors = self(h)
        outs: list[dict[str, torch.Tensor]] = [{} for _ in range(h.shape[0])]
        for path, (A, B) in factors.items():
            ka, kb = dyprag_keys(path)
            for j, o in enumerate(outs):
                o[ka], o[kb] = A[j], B[j]
        return outs


def generated_adapters(factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], names: list[str]
                       ) -> list[LoraAdapter]:
    """The passages' generated updates as :class:`LoraAdapter` s (float32 on the CPU, scaling 1: ``B @ A``, no
    ``alpha / r``), one per name in ``names`` (the batch's passages, in order); ``save_pretrained`` /
    ``from_pretrained`` keep them per passage id (a PEFT directory with ``r`` = ``lora_alpha``)."""
    out = []
    for j, name in enumerate(names):
        mods = {path: LoraModule(A[j].detach().float().cpu().clone(), B[j].detach().float().cpu().clone(), 1.0)
                for path, (A, B) in factors.items()}
        r = next(iter(mods.values())).rank
        cfg = {"r": r, "lora_alpha": r, "target_modules": sorted({p.split(".")[-1] for p in mods}),
               "task_type": "CAUSAL_LM"}
        out.append(LoraAdapter(mods, cfg, f"<translator: {name}>"))
    return out
