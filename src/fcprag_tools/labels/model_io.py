"""Loading the causal LM the labels are measured with: a transformers name/path, or a GGUF file."""

from __future__ import annotations

from typing import Any

import torch

from fcprag_plugin.errors import FcpragError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``auto``: ``cuda:{local_rank}`` when CUDA is available, else CPU. ``cuda`` alone also picks the local rank,
    so every process of a torchrun launch gets its own GPU."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise FcpragError("--device cuda: CUDA is not available on this machine")
        return torch.device(f"cuda:{local_rank}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise FcpragError(f"--device {device!r}: not a torch device ({e})") from None


def resolve_dtype(dtype: str) -> torch.dtype | None:
    """``auto`` keeps what the checkpoint loads as (None)."""
    if dtype == "auto":
        return None
    try:
        return DTYPES[dtype]
    except KeyError:
        raise FcpragError(f"--dtype {dtype!r}: expected one of {['auto', *DTYPES]}") from None


def load_model(name_or_path: str, *, gguf_file: str | None = None, tokenizer: str | None = None,
               dtype: str = "auto", device: str = "auto", local_rank: int = 0) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode on the chosen device. A tokenizer without a pad token gets EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device, local_rank)
    td = resolve_dtype(dtype)
    kwargs: dict[str, Any] = {} if td is None else {"torch_dtype": td}  # accepted by transformers 4.44 .. 5.x
    try:
        if gguf_file:
            model, tok = load_gguf_causal_lm(name_or_path, gguf_file, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
            tok = AutoTokenizer.from_pretrained(tokenizer or name_or_path)
    except (OSError, ValueError, NotImplementedError, ImportError) as e:  # e.g. a GGUF quant type unknown here
        what = f"{name_or_path} (gguf file {gguf_file})" if gguf_file else name_or_path
        raise FcpragError(f"model {what}: could not be loaded ({type(e).__name__}: {e})") from e
    if gguf_file and tokenizer:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return model.to(dev, td).eval(), tok


def load_gguf_causal_lm(pkg_dir: str, gguf_file: str, **kwargs: Any):
    """Load a GGUF causal LM and its tokenizer; set a chat template when old transformers read none from GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf_file, **kwargs)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHATML_TEMPLATE
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


# ChatML, the template SmolLM2-Instruct was trained with (written here for transformers that drop it from GGUF).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
