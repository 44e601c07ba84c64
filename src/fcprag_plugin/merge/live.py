"""Activate a (merged) adapter on a live model without touching its weights, and remove it afterwards.

The update is applied by forward hooks on the target ``nn.Linear`` modules (``y += scaling * B (A x)``), so
removing the hooks restores the model bit for bit: no parameter is ever written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapter import LoraAdapter
from ..adapter_io import PEFT_PREFIX
from ..errors import MergeError


def resolve_module(model: nn.Module, name: str, table: dict[str, nn.Module] | None = None) -> nn.Module:
    """Find a target module by its base-model path, in a plain model or inside a ``PeftModel``."""
    table = table if table is not None else dict(model.named_modules())
    for cand in (name, PEFT_PREFIX + name, PEFT_PREFIX + PEFT_PREFIX + name):
        mod = table.get(cand)
        if mod is not None:
            base = getattr(mod, "base_layer", None)  # a peft LoRA wrapper: hook its frozen base layer
            return base if isinstance(base, nn.Module) else mod
    sample = [n for n in table if n.endswith(name.split(".")[-1])][:2]
    raise MergeError(f"module '{name}' of the adapter is not in the model (e.g. the model has {sample})")


def resolve_target(model: nn.Module, name: str, out_features: int, in_features: int,
                   table: dict[str, nn.Module] | None = None, expected_by: str = "adapter expects") -> nn.Module:
    """:func:`resolve_module`, then check that its weight is ``[out, in]`` (error names the module and both shapes)."""
    mod = resolve_module(model, name, table)
    weight = getattr(mod, "weight", None)
    if weight is None or tuple(weight.shape) != (out_features, in_features):
        shape = None if weight is None else list(weight.shape)
        raise MergeError(f"module '{name}': model weight is {shape}, {expected_by} [{out_features}, {in_features}]")
    return mod


class ActiveAdapter:
    """Handle of an adapter activated on a model; ``remove()`` (or leaving the ``with`` block) undoes it."""

    def __init__(self, model: nn.Module, adapter: LoraAdapter, *, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.adapter = adapter
        self._handles: list[Any] = []
        table = dict(model.named_modules())
        try:
            for name, m in adapter.modules.items():
                mod = resolve_target(model, name, m.out_features, m.in_features, table)
                weight = mod.weight
                cdtype = dtype or weight.dtype
                A = (m.scaling * m.A.to(device=weight.device, dtype=torch.float32)).to(cdtype)  # scaling folded once
                B = m.B.to(device=weight.device, dtype=cdtype)
                self._handles.append(mod.register_forward_hook(_make_hook(A, B)))
        except Exception:
            self.remove()
            raise

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "ActiveAdapter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _make_hook(A: torch.Tensor, B: torch.Tensor):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        x = inputs[0]
        return output + ((x.to(A.dtype) @ A.T) @ B.T).to(output.dtype)

    return hook


def activate(model: nn.Module, adapter: LoraAdapter, *, dtype: torch.dtype | None = None) -> ActiveAdapter:
    """Apply ``adapter`` to ``model`` until the returned handle is removed (usable as a context manager)."""
    return ActiveAdapter(model, adapter, dtype=dtype)
