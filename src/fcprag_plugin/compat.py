"""Everything that differs across torch / transformers / peft / sentence-transformers versions lives here, and only
here (supported: latest, and the PRAG / DyPRAG pins, peft 0.13.2 with transformers 4.44.2 / 4.49.0); the call sites
ask what differs, never which version (tests/test_compat_only.py)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from packaging.version import Version


@functools.lru_cache(maxsize=None)
def package_version(name: str) -> Version:
    from importlib.metadata import version

    return Version(version(name))


def peft_has_stale_config_bug() -> bool:
    """peft < 0.19 leaves ``peft_config`` on the base model after ``unload()``: the next ``load_adapter`` creates
    no layers, and ``add_weighted_adapter`` silently skips adapters without layers."""
    return package_version("peft") < Version("0.19")


# torch.compiler.is_compiling (torch >= 2.3): whether torch.compile is tracing the caller
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)
# the device's out-of-memory errors: torch.OutOfMemoryError from torch 2.5 on, torch.cuda's (the same class since)
OUT_OF_MEMORY_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError})


def peft_has_arrow() -> bool:
    """Whether peft has the training-free Arrow router (``ArrowConfig``, ``create_arrow_model``: peft >= 0.18)."""
    import peft

    return all(hasattr(peft, name) for name in ("ArrowConfig", "create_arrow_model"))


def embedding_dimension(model: Any) -> int:
    """A SentenceTransformer's embedding size (``get_embedding_dimension``; older sentence-transformers name it
    ``get_sentence_embedding_dimension``, which newer ones deprecate)."""
    return int((getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension)())


def gguf_limits() -> tuple[set[str] | None, set[int] | None]:
    """What transformers reads from a GGUF file (None: no limit): the architectures whose tokenizer it converts
    (before 5: one converter each) and the GGML tensor types it dequantizes (4.44 only a few, itself)."""
    from transformers.integrations import ggml

    tokenizers = getattr(ggml, "GGUF_TO_FAST_CONVERTERS", None)
    types = set(getattr(ggml, "GGML_TYPES", {}).values()) if hasattr(ggml, "load_dequant_gguf_tensor") else None
    return (None if tokenizers is None else set(tokenizers)), types


def from_pretrained_dtype_key() -> str:
    """The ``from_pretrained`` keyword that sets the weights' dtype: ``dtype`` from transformers 4.56 on (which warns
    at ``torch_dtype``); the pins (4.44, 4.49) know only ``torch_dtype``."""
    return "dtype" if package_version("transformers") >= Version("4.56") else "torch_dtype"


def kv_cache_continues(kwargs: dict[str, Any]) -> bool:
    """Whether a causal LM's forward keyword arguments carry a non-empty KV cache (a decoding step): transformers 5
    names the argument ``cache``, earlier versions ``past_key_values``, which may also be a legacy tuple."""
    pkv = kwargs.get("past_key_values")
    pkv = kwargs.get("cache") if pkv is None else pkv
    length = getattr(pkv, "get_seq_length", None)
    return int(length()) > 0 if callable(length) else isinstance(pkv, (tuple, list)) and len(pkv) > 0


_FORWARD_PARAMETERS: dict[type, frozenset[str]] = {}


def _forward_parameters(model: Any) -> frozenset[str]:
    """The parameter names of ``model.forward``, read once per class."""
    if type(model) not in _FORWARD_PARAMETERS:
        _FORWARD_PARAMETERS[type(model)] = frozenset(inspect.signature(model.forward).parameters)
    return _FORWARD_PARAMETERS[type(model)]


def kv_cache_argument_name(model: Any) -> str:
    """The name under which a causal LM's forward takes its KV cache (see :func:`kv_cache_continues`); a PEFT
    wrapper passes it on to its base model, whose signature is read."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in _forward_parameters(base) else "past_key_values"


def logits_to_keep_argument(model: Any) -> str | None:
    """The name of the forward's "logits for the last k positions only" argument (``logits_to_keep``; transformers
    4.44 / 4.49 ``num_logits_to_keep``), None where the model has none."""
    params = _forward_parameters(model)
    return next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)


def layer_variant(layer: Any, adapter_name: str) -> str | None:
    """The LoRA variant of a live layer's adapter (its update is then not ``scaling * B @ A``), None for plain LoRA:
    peft >= 0.16 keeps a ``lora_variant`` object per adapter, earlier versions only a ``use_dora`` dict."""
    variant = getattr(layer, "lora_variant", {}).get(adapter_name)
    if variant is not None:
        return type(variant).__name__
    return "DoRA" if getattr(layer, "use_dora", {}).get(adapter_name, False) else None


def layer_has_lora_bias(layer: Any, adapter_name: str) -> bool:
    """``lora_bias`` exists from peft 0.14 on; a LoRA B with a bias is not a pure low-rank update."""
    if getattr(layer, "lora_bias", {}).get(adapter_name, False):
        return True
    lora_b = getattr(layer, "lora_B", {})
    return adapter_name in lora_b and getattr(lora_b[adapter_name], "bias", None) is not None


def _own_peft_config(model: Any) -> bool:
    """Whether a plain model (not a ``PeftModel``) holds a ``peft_config`` attribute of its own (not its class's)."""
    from peft import PeftModel

    return "peft_config" in vars(model) and not isinstance(model, PeftModel)


def clear_stale_peft_config(model: Any) -> bool:
    """Remove a ``peft_config`` left on an unloaded base model (peft < 0.19). Returns True if one was removed."""
    if not _own_peft_config(model):
        return False
    del model.peft_config
    return True


def has_stale_peft_config(model: Any) -> bool:
    """A plain model with a ``peft_config`` but no PEFT tuner layer (what peft < 0.19 leaves after ``unload()``)."""
    if not _own_peft_config(model):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return not any(isinstance(m, BaseTunerLayer) for m in model.modules())


def live_lora_layers(model: Any, adapter_name: str) -> list[tuple[str, Any]]:
    """``(module name, LoRA layer)`` for every layer of ``model`` that holds ``adapter_name`` (Linear or embedding)."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)
            and (adapter_name in getattr(m, "lora_A", {}) or adapter_name in getattr(m, "lora_embedding_A", {}))]


def lora_b_weight(layer: Any, adapter_name: str) -> torch.Tensor:
    """The ``B`` factor of ``adapter_name`` in a live LoRA layer (a Linear's weight or an embedding parameter)."""
    if adapter_name in getattr(layer, "lora_B", {}):
        return layer.lora_B[adapter_name].weight
    return layer.lora_embedding_B[adapter_name]
