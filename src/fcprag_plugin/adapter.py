"""``LoraAdapter``: one passage adapter as plain tensors (per target module ``A [r, in]``, ``B [out, r]``, scaling)
and its I/O: PEFT directories, safetensors files, state dicts and live PEFT models."""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from .compat import layer_has_lora_bias, layer_variant, live_lora_layers
from .errors import AdapterError, UnsupportedAdapterError
from .fileio import read_json_object, read_tensor_file, write_json

logger = logging.getLogger(__name__)


@dataclass
class LoraModule:
    """The low-rank update of one target module: ``dW = scaling * B @ A`` with ``A [r, in]``, ``B [out, r]`` and
    ``scaling`` ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA; 1.0 for merged adapters)."""

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
    """A LoRA adapter as plain tensors, keyed by the target module's path in the base model (``model.layers.0.mlp.
    gate_proj``: no ``base_model.model.`` prefix, no adapter name); ``config``: a PEFT LoRA config dict."""

    modules: dict[str, LoraModule]
    config: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu") -> "LoraAdapter":
        """Load a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors`` or ``.bin``)."""
        return load_adapter_dir(path, device=device)

    @classmethod
    def from_peft_model(cls, model: Any, adapter_name: str = "default") -> "LoraAdapter":
        """Copy the named adapter's ``A``, ``B`` and scaling out of a live model with LoRA layers."""
        where = f"live model adapter '{adapter_name}'"
        modules: dict[str, LoraModule] = {}
        for name, module in live_lora_layers(model, adapter_name):
            if adapter_name in getattr(module, "lora_embedding_A", {}):
                raise UnsupportedAdapterError(f"{where}: module '{name}' is an embedding LoRA: only Linear LoRA is "
                                              "supported")
            if variant := layer_variant(module, adapter_name):
                raise UnsupportedAdapterError(f"{where}: module '{name}' uses the LoRA variant {variant}, which is not "
                                              "supported (its update is not alpha/r * B @ A)")
            if layer_has_lora_bias(module, adapter_name):
                raise UnsupportedAdapterError(f"{where}: module '{name}' has a LoRA bias, which is not supported")
            A = module.lora_A[adapter_name].weight.detach().clone()
            B = module.lora_B[adapter_name].weight.detach().clone()
            modules[strip_peft_prefix(name)[0]] = LoraModule(A, B, float(module.scaling[adapter_name]))
        configs = getattr(model, "peft_config", {}) or {}
        if not modules:
            if adapter_name in configs:
                raise AdapterError(f"{where}: configured in peft_config but has no LoRA layers in the model "
                                   "(weights were loaded nowhere; a stale peft_config after unload()?)")
            raise AdapterError(f"{where}: not found; the model has adapters {sorted(configs)}")
        cfg = configs.get(adapter_name)
        cfg_dict = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg or {})
        cfg_dict = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg_dict.items()}
        cfg_dict.setdefault("r", next(iter(modules.values())).rank)
        cfg_dict.setdefault("lora_alpha", cfg_dict["r"])
        adapter = cls(modules, cfg_dict, where).validate()
        if adapter.is_zero():
            warn_zero(where)
        return adapter

    def save_pretrained(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write a PEFT directory that ``PeftModel.from_pretrained`` loads with the same dW (the most common (rank,
        scaling) as ``r`` / ``lora_alpha``, the others in ``rank_pattern`` / ``alpha_pattern``)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (r0, s0), _ = Counter((m.rank, m.scaling) for m in self.modules.values()).most_common(1)[0]
        other = {_pattern_key(n): m for n, m in self.modules.items() if (m.rank, m.scaling) != (r0, s0)}
        rank_pattern = {k: m.rank for k, m in other.items()}
        alpha_pattern = {k: m.scaling * m.rank for k, m in other.items()}
        cfg = {"peft_type": "LORA", "task_type": self.config.get("task_type", "CAUSAL_LM"),
               "base_model_name_or_path": self.config.get("base_model_name_or_path"), "r": r0, "lora_alpha": s0 * r0,
               "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
               "inference_mode": True, "init_lora_weights": True,
               "target_modules": sorted({n.split(".")[-1] for n in self.modules}), "rank_pattern": rank_pattern,
               "alpha_pattern": alpha_pattern, "modules_to_save": None,
               **{k: v for k, v in self.config.items() if k in {"revision", "layers_to_transform", "layers_pattern"}}}
        tensors = {f"{PEFT_PREFIX}{name}.lora_{kind}.weight": (t if dtype is None else t.to(dtype)).detach()
                   .contiguous().cpu() for name, m in self.modules.items() for kind, t in (("A", m.A), ("B", m.B))}
        write_json(path / CONFIG_NAME, cfg)
        save_file(tensors, str(path / SAFETENSORS_NAME), metadata={"format": "pt"})
        return path

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
        """Frobenius norms per module of ``A``, ``B`` and the update ``scaling * B @ A`` (without forming it:
        ``||B A||_F^2 = trace((B^T B)(A A^T))``)."""
        ab = {k: (m.A.float(), m.B.float(), m.scaling) for k, m in self.modules.items()}
        return {k: {"A": float(a.norm()), "B": float(b.norm()),
                    "delta": float(s * math.sqrt(float(torch.sum((b.T @ b) * (a @ a.T)).clamp_min(0))))}
                for k, (a, b, s) in ab.items()}

    def validate(self, *, values: bool = True) -> "LoraAdapter":
        """Check shapes, dtypes and (``values``) finiteness; an :class:`AdapterError` names the source and module."""
        if not self.modules:
            raise AdapterError(f"{self.source}: the adapter has no LoRA modules (no lora_A/lora_B weights found)")
        for name, m in self.modules.items():
            for kind, t in (("lora_A", m.A), ("lora_B", m.B)):
                if t.ndim != 2:
                    raise AdapterError(f"{self.source}: key '{name}.{kind}.weight' has shape {list(t.shape)}, "
                                       "expected a 2-D matrix")
                if not t.is_floating_point():
                    raise AdapterError(f"{self.source}: key '{name}.{kind}.weight' has dtype {t.dtype}, expected float")
                if values and not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    raise AdapterError(f"{self.source}: key '{name}.{kind}.weight' has {bad} non-finite values "
                                       "(NaN/inf)")
            if m.A.shape[0] != m.B.shape[1]:
                raise AdapterError(f"{self.source}: module '{name}': lora_A {list(m.A.shape)} and lora_B "
                                   f"{list(m.B.shape)} disagree on the rank (A is [r, in], B is [out, r])")
            if not math.isfinite(m.scaling):
                raise AdapterError(f"{self.source}: module '{name}' has a non-finite scaling {m.scaling}")
        return self

    def __repr__(self) -> str:
        ranks = sorted(set(self.ranks.values()))
        return f"LoraAdapter(source={self.source!r}, modules={len(self.modules)}, ranks={ranks}, dtype={self.dtype})"


def warn_zero(source: str) -> None:
    """The one warning for an adapter whose every ``B`` is zero."""
    logger.warning("%s: every lora_B is zero, so this adapter does nothing (was it saved before training?)", source)


CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
LEGACY_BIN_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
# <prefix>(<module>).lora_(A|B)[.<adapter name>].weight
# LoraConfig keys that select a LoRA variant (peft's lora_variants) or LoRA on bare parameters: refused
VARIANT_KEYS = ("use_dora", "alora_invocation_tokens", "arrow_config", "kasa_config", "monteclora_config",
                "use_bdlora", "velora_config", "target_parameters")
_KEY_RE = re.compile(r"^(?P<module>.+?)\.lora_(?P<kind>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")


def read_config(path: Path) -> dict[str, Any]:
    return read_json_object(path, AdapterError, f"adapter config not found (expected a PEFT '{CONFIG_NAME}')")


def check_config(cfg: Mapping[str, Any], where: str) -> None:
    """Reject LoRA variants whose update is not ``alpha/r * B @ A``."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterError(f"{where}: peft_type '{peft_type}' is not supported; only plain LoRA is")
    for key in VARIANT_KEYS:
        if cfg.get(key):
            what = "DoRA adapters are" if key == "use_dora" else "the LoRA variant it selects is"
            raise UnsupportedAdapterError(f"{where}: key '{key}' is set: {what} not supported (the update is not "
                                          "alpha/r * B @ A)")
    if cfg.get("init_lora_weights") == "mica":
        raise UnsupportedAdapterError(f"{where}: key 'init_lora_weights' is 'mica': the MiCA LoRA variant is not "
                                      "supported (the update is not alpha/r * B @ A)")
    if cfg.get("lora_bias"):
        raise UnsupportedAdapterError(f"{where}: key 'lora_bias' is true: LoRA with a bias on lora_B is not supported")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise AdapterError(f"{where}: key '{key}' must be a positive number, got {v!r}")


def _pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def module_scaling(cfg: Mapping[str, Any], module: str, rank: int, where: str) -> float:
    """``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), honouring ``rank_pattern`` / ``alpha_pattern``."""
    r_cfg = _pattern_value(cfg.get("rank_pattern"), module, cfg["r"])
    if int(r_cfg) != rank:
        raise AdapterError(f"{where}: module '{module}' has rank {rank} in its weights but the config says r={r_cfg}")
    alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg["lora_alpha"]))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def strip_peft_prefix(key: str) -> tuple[str, int]:
    """``key`` without its leading ``base_model.model.`` prefixes (PRAG's first run saves two), and how many."""
    n = 0
    while key.startswith(PEFT_PREFIX):
        key = key[len(PEFT_PREFIX):]
        n += 1
    return key, n


def adapter_from_state_dict(state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                            source: str = "<state_dict>", check_values: bool = True) -> LoraAdapter:
    """Parse PEFT-layout keys into per-module ``A``/``B`` (PRAG's doubled prefix repaired, with a warning);
    ``check_values=False`` skips the finiteness check and the all-zero warning."""
    cfg = dict(config)
    check_config(cfg, source)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    adapter_names: set[str] = set()
    doubled = 0
    for key, tensor in state_dict.items():
        if "lora_magnitude_vector" in key:
            raise UnsupportedAdapterError(f"{source}: key '{key}' is a DoRA magnitude vector: DoRA is not supported")
        if "lora_embedding_A" in key or "lora_embedding_B" in key:
            raise UnsupportedAdapterError(f"{source}: key '{key}' is an embedding LoRA: only Linear LoRA is supported")
        if re.search(r"\.lora_[AB](\.[^.]+)?\.bias$", key):
            raise UnsupportedAdapterError(f"{source}: key '{key}' is a LoRA bias: LoRA with a bias is not supported")
        stripped, n_prefix = strip_peft_prefix(key)
        m = _KEY_RE.match(stripped)
        if m is None:
            raise AdapterError(f"{source}: unknown key layout '{key}': expected '<module>.lora_A.weight' / "
                               f"'<module>.lora_B.weight' (optionally prefixed by '{PEFT_PREFIX}')")
        if not isinstance(tensor, torch.Tensor):
            raise AdapterError(f"{source}: key '{key}' holds a {type(tensor).__name__}, expected a tensor")
        doubled += n_prefix > 1
        if m.group("adapter"):
            adapter_names.add(m.group("adapter"))
        pairs.setdefault(m.group("module"), {})[m.group("kind")] = tensor
    if len(adapter_names) > 1:
        raise AdapterError(f"{source}: keys name several adapters {sorted(adapter_names)}; pass one adapter's keys")
    if doubled:
        logger.warning("%s: repaired a doubled '%s' key prefix on %d keys (saved by PRAG's first encode run)",
                       source, PEFT_PREFIX, doubled)
    modules: dict[str, LoraModule] = {}
    for name in sorted(pairs):
        p = pairs[name]
        for kind in ("A", "B"):
            if kind not in p:
                raise AdapterError(f"{source}: module '{name}' has no 'lora_{kind}.weight' key (A and B come in pairs)")
        A, B = p["A"], p["B"]
        if A.ndim == 2 and B.ndim == 2 and A.shape[0] != B.shape[1]:
            raise AdapterError(f"{source}: key '{name}.lora_A.weight' {list(A.shape)} and '{name}.lora_B.weight' "
                               f"{list(B.shape)} disagree on the rank (A is [r, in], B is [out, r])")
        rank = int(A.shape[0]) if A.ndim == 2 else -1
        modules[name] = LoraModule(A, B, module_scaling(cfg, name, rank, source) if rank > 0 else 1.0)
    adapter = LoraAdapter(modules, cfg, source).validate(values=check_values)
    if check_values and adapter.is_zero():
        warn_zero(source)
    return adapter


def load_safetensors(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    return read_tensor_file(path, device, AdapterError, "weights file not found")


def load_adapter_dir(path: str | Path, *, device: str | torch.device = "cpu", check_values: bool = True,
                     read_safetensors: Callable[[Path, Any], dict[str, torch.Tensor]] | None = None) -> LoraAdapter:
    """:meth:`LoraAdapter.from_pretrained`; ``check_values``: see :func:`adapter_from_state_dict`;
    ``read_safetensors(file, device)`` replaces the safetensors reader."""
    path = Path(path)
    if not path.exists():
        raise AdapterError(f"{path}: adapter directory not found")
    if not path.is_dir():
        raise AdapterError(f"{path}: expected a PEFT adapter directory ({CONFIG_NAME} + {SAFETENSORS_NAME})")
    cfg = read_config(path / CONFIG_NAME)
    st, legacy = path / SAFETENSORS_NAME, path / LEGACY_BIN_NAME
    src = st if st.is_file() else legacy
    if st.is_file():
        sd = (read_safetensors or load_safetensors)(st, device)
    elif legacy.is_file():
        try:
            sd = torch.load(str(legacy), map_location="cpu", weights_only=True)
        except Exception as e:  # the safe unpickler refuses anything but tensors
            raise AdapterError(f"{legacy}: cannot be read with torch.load(weights_only=True) ({e})") from e
        if not isinstance(sd, dict):
            raise AdapterError(f"{legacy}: expected a state dict, got {type(sd).__name__}")
        sd = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    else:
        raise AdapterError(f"{path}: no adapter weights found (expected '{SAFETENSORS_NAME}' or '{LEGACY_BIN_NAME}')")
    adapter = adapter_from_state_dict(sd, cfg, source=str(src), check_values=check_values)
    adapter.source = str(path)
    return adapter


def _pattern_key(module: str) -> str:
    # peft 0.13 matches rf".*\.{key}$" against the full module name: drop the first component so a dot precedes.
    parts = module.split(".")
    return re.escape(".".join(parts[1:]) if len(parts) > 1 else module)
