"""The study's batch sizes chosen from the device and its free memory: :func:`default_batches`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

CPU = (16, 8, 16)  # group, augmentation, scoring on a CPU: stacking and batching gain little there, memory limits
MOST = 64  # the largest sizes measured on a GPU (docs/results/gpu.md): larger ones are not known to pay
SHARE = 0.5  # of the device's free memory, for one stage's batch (the rest: fragmentation, the estimate's error)
# the shape the GPU figures were measured on, used when no model is given: Llama-3.2-1B in bfloat16
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "vocab_size": 128256,
            "num_attention_heads": 32, "num_key_value_heads": 8}


@dataclass(frozen=True)
class BatchSizes:
    """``group``: adapters trained together per step (``--group``); ``aug_batch``: passages per augmentation
    ``generate`` (``--aug-batch``); ``batch_size``: sequences per scoring forward (``--batch-size``); ``why``:
    one line saying how they were chosen."""

    group: int
    aug_batch: int
    batch_size: int
    why: str


def unit_bytes(config: Any, dtype_bytes: int, *, max_tokens: int = 128, aug_prompt_tokens: int = 260,
               aug_new_tokens: int = 128, score_tokens: int = 96, new_tokens: int = 16) -> dict[str, int]:
    """Rough upper estimates of the device memory one unit of each stage takes beyond the model's weights:

    - ``group`` (one adapter of a stacked training step, one ``max_tokens`` sample): the activations kept for the
      backward pass, per layer and token about 6 hidden-size and 4 intermediate-size values, plus the float32
      logits of every token with their softmax and gradient (3 x vocab x 4 bytes);
    - ``aug_batch`` (one passage: two prompts of ``aug_prompt_tokens`` + ``aug_new_tokens``): their KV cache and
      float32 logits over every prompt position (transformers before 4.45 computes them all in ``generate``);
    - ``batch_size`` (one scored sequence of ``score_tokens`` + ``new_tokens``): its KV cache and the activations
      of one layer (no gradient), plus two float32 vocabulary rows.

    Not measured: they decide a starting size, and an out-of-memory error still halves it
    (:func:`fcprag_tools.lm.oom.halving`)."""
    g = (lambda k, d=0: int(getattr(config, k, None) or (config.get(k, d) if isinstance(config, dict) else d)))
    h, i, layers, vocab = g("hidden_size"), g("intermediate_size"), g("num_hidden_layers"), g("vocab_size")
    heads = g("num_attention_heads", 1)
    kv = g("num_key_value_heads", heads) or heads
    head_dim = g("head_dim", h // heads) or h // heads
    kv_token = 2 * layers * kv * head_dim * dtype_bytes  # K and V of one token, every layer
    aug_len = aug_prompt_tokens + aug_new_tokens
    score_len = score_tokens + new_tokens
    return {"group": max_tokens * (layers * (6 * h + 4 * i) * dtype_bytes + 3 * vocab * 4),
            "aug_batch": 2 * (aug_len * kv_token + aug_prompt_tokens * vocab * 4),
            "batch_size": score_len * (kv_token + (4 * h + 3 * i) * dtype_bytes) + 2 * vocab * 4}


def _pow2_at_most(x: float) -> int:
    return 1 if x < 2 else 2 ** int(math.floor(math.log2(x)))


def default_batches(device: torch.device | str, model: Any = None, *, free_bytes: int | None = None,
                    **shape: int) -> BatchSizes:
    """The study's batch sizes for ``device`` (its defaults where the user gives none).

    On a CPU (and any device but CUDA): 16 adapters per training step, 8 passages per augmentation call, 16
    sequences per scoring forward (on a CPU stacking gains nothing: docs/results/gpu.md's CPU section,
    ../shared/notes/measurements.md: batching 5 sequences gained 1.02-1.05x).

    On CUDA, each the largest power of two up to 64 whose :func:`unit_bytes` estimate fits half the free memory
    (``torch.cuda.mem_get_info``, measured after the model is loaded; or ``free_bytes``) for ``model``'s shape and
    dtype (without a model: Llama-3.2-1B in bfloat16). 64 is where the measured gains stop being measured: on one
    H200 (docs/results/gpu.md, 1B shape, bf16) stacked training ran at 30.9 adapters/s at 16 per step and 49.05 at
    64 (the real SmolLM2 study at the default 16: 11.3/s), augmentation at 2.01 passages/s at 8 per call, 8.01 at
    32 and 16.02 at 64, held-out scoring at 15.5 questions/s at 64 sequences per forward. ``shape`` passes token
    counts on to :func:`unit_bytes`.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        g, a, b = CPU
        return BatchSizes(g, a, b, f"{dev.type}: the CPU defaults (group {g}, aug-batch {a}, batch-size {b})")
    if free_bytes is None:
        free_bytes = int(torch.cuda.mem_get_info(dev)[0])
    if model is not None:
        config = model.config
        dtype_bytes = next(model.parameters()).element_size()
    else:
        config, dtype_bytes = LLAMA_1B, 2
    per = unit_bytes(config, dtype_bytes, **shape)
    budget = SHARE * free_bytes
    sizes = {k: min(MOST, _pow2_at_most(budget / v)) for k, v in per.items()}
    return BatchSizes(sizes["group"], sizes["aug_batch"], sizes["batch_size"],
                      f"{dev}: {free_bytes / 2**30:.1f} GiB free; group {sizes['group']}, aug-batch "
                      f"{sizes['aug_batch']}, batch-size {sizes['batch_size']} (at most {MOST}, each within "
                      f"{SHARE:.0%} of the free memory by estimate)")
