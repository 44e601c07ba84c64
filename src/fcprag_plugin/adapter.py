"""``LoraAdapter``: one passage adapter as plain tensors, per target module ``A [r, in]``, ``B [out, r]``, scaling.

Loading and saving live in :mod:`fcprag_plugin.adapter_io`; this module holds the data and its validation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from .errors import AdapterError

logger = logging.getLogger(__name__)


@dataclass
class LoraModule:
    """The low-rank update of one target module: ``dW = scaling * B @ A``.

    Attributes:
        A: ``[r, in]``
        B: ``[out, r]``
        scaling: ``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA); 1.0 for merged adapters.
    """

    A: torch.Tensor
    B: torch.Tensor
    scaling: float = 1.0

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.A.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.B.shape[0])

    def delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense update ``scaling * B @ A`` as ``[out, in]`` (for tests and inspection; merges never form it)."""
        return self.scaling * (self.B.to(dtype) @ self.A.to(dtype))


@dataclass
class LoraAdapter:
    """A LoRA adapter as plain tensors, keyed by the target module's path inside the base model.

    Module keys look like ``model.layers.0.mlp.gate_proj`` (no ``base_model.model.`` prefix, no adapter name).
    ``config`` is a PEFT-style LoRA config dict (``r``, ``lora_alpha``, ``target_modules``, ...).
    Build one with the ``from_*`` constructors (see :mod:`fcprag_plugin.adapter_io`).
    """

    modules: dict[str, LoraModule]
    config: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    # ----------------------------------------------------------------- constructors (I/O in adapter_io)
    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu") -> "LoraAdapter":
        """Load a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors`` or legacy ``.bin``)."""
        from .adapter_io import load_adapter_dir

        return load_adapter_dir(path, device=device)

    @classmethod
    def from_safetensors(
        cls, file: str | Path, config: Mapping[str, Any] | str | Path, *, device: str | torch.device = "cpu"
    ) -> "LoraAdapter":
        """Load a ``.safetensors`` file of PEFT-layout keys with a config (dict or path to a JSON file)."""
        from .adapter_io import load_safetensors_file

        return load_safetensors_file(file, config, device=device)

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any], *, source: str = "<state_dict>"
    ) -> "LoraAdapter":
        """Build from an in-memory PEFT-layout state dict (``...lora_A.weight`` / ``...lora_B.weight`` keys)."""
        from .adapter_io import adapter_from_state_dict

        return adapter_from_state_dict(state_dict, config, source=source)

    @classmethod
    def from_peft_model(cls, model: Any, adapter_name: str = "default") -> "LoraAdapter":
        """Read the named adapter out of a live ``PeftModel`` (or a model with injected LoRA layers)."""
        from .adapter_io import adapter_from_peft_model

        return adapter_from_peft_model(model, adapter_name)

    def save_pretrained(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write a PEFT adapter directory that ``PeftModel.from_pretrained`` loads."""
        from .adapter_io import save_adapter_dir

        return save_adapter_dir(self, path, dtype=dtype)

    # ----------------------------------------------------------------- views
    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __getitem__(self, name: str) -> LoraModule:
        return self.modules[name]

    @property
    def target_modules(self) -> list[str]:
        return sorted(self.modules)

    @property
    def ranks(self) -> dict[str, int]:
        return {k: m.rank for k, m in self.modules.items()}

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.modules.values())).A.dtype

    def num_bytes(self) -> int:
        return sum(m.A.numel() * m.A.element_size() + m.B.numel() * m.B.element_size() for m in self.modules.values())

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "LoraAdapter":
        mods = {k: LoraModule(m.A.to(device=device, dtype=dtype), m.B.to(device=device, dtype=dtype), m.scaling)
                for k, m in self.modules.items()}
        return LoraAdapter(mods, dict(self.config), self.source)

    def is_zero(self) -> bool:
        """True when every B is zero: the adapter changes nothing (e.g. saved before any training step)."""
        return all(not bool(torch.any(m.B != 0)) for m in self.modules.values())

    def norms(self) -> dict[str, dict[str, float]]:
        """Frobenius norms per module of ``A``, ``B`` and the update ``scaling * B @ A`` (without forming it)."""
        out = {}
        for k, m in self.modules.items():
            a, b = m.A.float(), m.B.float()
            # ||B A||_F^2 = trace((B^T B)(A A^T)): r x r products only.
            dw2 = torch.sum((b.T @ b) * (a @ a.T)).clamp_min(0)
            out[k] = {"A": float(a.norm()), "B": float(b.norm()), "delta": float(m.scaling * math.sqrt(float(dw2)))}
        return out

    def validate(self, *, values: bool = True) -> "LoraAdapter":
        """Check shapes and values; raise :class:`AdapterError` naming the source and module.

        ``values=False`` checks only shapes and dtypes (for callers that check finiteness in bulk afterwards).
        """
        if not self.modules:
            raise AdapterError(f"{self.source}: the adapter has no LoRA modules (no lora_A/lora_B weights found)")
        for name, m in self.modules.items():
            for kind, t in (("lora_A", m.A), ("lora_B", m.B)):
                if t.ndim != 2:
                    raise AdapterError(
                        f"{self.source}: key '{name}.{kind}.weight' has shape {list(t.shape)}, expected a 2-D matrix"
                    )
                if not t.is_floating_point():
                    raise AdapterError(f"{self.source}: key '{name}.{kind}.weight' has dtype {t.dtype}, expected float")
                if values and not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    raise AdapterError(f"{self.source}: key '{name}.{kind}.weight' has {bad} non-finite values (NaN/inf)")
            if m.A.shape[0] != m.B.shape[1]:
                raise AdapterError(
                    f"{self.source}: module '{name}': lora_A {list(m.A.shape)} and lora_B {list(m.B.shape)} "
                    f"disagree on the rank (A is [r, in], B is [out, r])"
                )
            if not math.isfinite(m.scaling):
                raise AdapterError(f"{self.source}: module '{name}' has a non-finite scaling {m.scaling}")
        return self

    def warn_if_zero(self) -> bool:
        if self.is_zero():
            logger.warning("%s: every lora_B is zero, so this adapter does nothing (was it saved before training?)",
                           self.source)
            return True
        return False

    def __repr__(self) -> str:
        ranks = sorted(set(self.ranks.values()))
        return f"LoraAdapter(source={self.source!r}, modules={len(self.modules)}, ranks={ranks}, dtype={self.dtype})"
