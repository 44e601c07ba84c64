"""Loading the causal LM the labels are measured with: a transformers name/path, or a GGUF file."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Any, Iterator

import torch
from packaging.version import Version

from fcprag_plugin.compat import package_version
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


def looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a filesystem path: absolute, ``~``, ``./`` or ``../``, or a separator where a
    hub name (``name`` or ``owner/name``: one ``/`` at most, inside) cannot have one."""
    other_seps = {os.sep, os.altsep} - {"/", None}
    return (os.path.isabs(name) or name.startswith(("~", "./", "../")) or name in (".", "..")
            or name.count("/") > 1 or name.endswith("/") or any(s in name for s in other_seps))


def check_model_path(option: str, name: str) -> str:
    """``name`` as given, or expanded (``~``) when it is a path; a path that does not exist is a one-line error
    naming ``option`` here, not a hub URL built from it or "Repo id must be in the form ..." from below."""
    if not looks_like_path(name):
        return name
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        raise FcpragError(f"{option} {name}: no such file or directory; expected a local model folder or a hub name")
    return path


@contextlib.contextmanager
def quiet_loading(quiet: bool = True, gguf: bool = False) -> Iterator[None]:
    """No progress bars from transformers (and huggingface_hub) inside the block; their state is restored after.

    ``gguf``: transformers' GGUF de-quantisation uses ``tqdm`` directly (no switch in 4.44 .. 5.x), so that
    module's ``tqdm`` is swapped for a disabled one for the block, when the module imports.
    """
    if not quiet:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    module = None
    if gguf:
        try:
            module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        except ImportError:  # no GGUF support here: loading fails below with its own message
            pass
    gguf_tqdm = getattr(module, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        module.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            module.tqdm = gguf_tqdm
        if was_on:
            hf_logging.enable_progress_bar()  # also turns huggingface_hub's bars back on ...
        if hub_was_off:
            disable_progress_bars()  # ... unless they were off before


def load_model(name_or_path: str, *, gguf_file: str | None = None, tokenizer: str | None = None,
               dtype: str = "auto", device: str = "auto", local_rank: int = 0, progress: bool = True
               ) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode on the chosen device. A tokenizer without a pad token gets EOS.
    ``progress=False``: no loading progress bars (:func:`quiet_loading`)."""
    with quiet_loading(not progress, gguf=bool(gguf_file)):
        return _load_model(name_or_path, gguf_file=gguf_file, tokenizer=tokenizer, dtype=dtype, device=device,
                           local_rank=local_rank)


def _load_model(name_or_path: str, *, gguf_file: str | None, tokenizer: str | None, dtype: str, device: str,
                local_rank: int) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device, local_rank)
    td = resolve_dtype(dtype)
    # transformers >= 4.56 names it `dtype` (and warns at `torch_dtype`); the pins (4.44, 4.49) know only `torch_dtype`
    key = "dtype" if package_version("transformers") >= Version("4.56") else "torch_dtype"
    kwargs: dict[str, Any] = {} if td is None else {key: td}
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
