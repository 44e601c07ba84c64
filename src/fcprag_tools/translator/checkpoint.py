"""Translator checkpoints in DyPRAG's format: ``torch.save({"model_state_dict": state_dict})`` with the state-dict
layout of :mod:`.network` and nothing else, so DyPRAG's own ``inference_dyprag.py`` loads what we write
(``torch.load(path)["model_state_dict"]``, strict ``load_state_dict``) and we load DyPRAG's released translators.

Reading: ``torch.load(..., weights_only=True)`` (tensors and plain containers only), then the translator's shape is
read from the file (layers, projections, hidden and intermediate size, rank, width) and checked against the model's
config before any work: the first key that does not fit is a one-line :class:`TranslatorError` naming the file, the
key and both shapes.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

import torch

from fcprag_plugin.fileio import write_atomic

from .network import MODULES, Translator, TranslatorError, TranslatorShape

STATE_KEY = "model_state_dict"
_KEY = re.compile(r"^projector\.(?P<module>[A-Za-z_]+)_(?P<layer>\d+)\.projector\."
                  r"(?P<name>(?:pre|post)_[AB]_linear|[AB]_hypernet\.linear[12])\.weight$")


def write_binary(path: str | Path, fill: Callable[[BinaryIO], None]) -> Path:
    """``fill(f)`` writes ``path``'s bytes, atomically: into memory first, then
    :func:`fcprag_plugin.fileio.write_atomic` (a temp file beside it, ``fsync``, ``os.replace``); a failing ``fill``
    writes nothing."""
    buf = io.BytesIO()
    fill(buf)
    return write_atomic(path, buf.getvalue())


_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")  # write_binary's and fileio.write_atomic's temporaries


def _running(pid: int) -> bool:
    if pid == os.getpid():  # this process writes none yet: an earlier one of the same id left it
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Remove, under ``folder``, the temporary files of atomic writes (``.<name>.tmp-<pid>``: :func:`write_binary`,
    :func:`fcprag_plugin.fileio.write_atomic`) whose process is gone (killed mid-write, so its own clean-up never
    ran); nothing else is touched. Returns the files removed."""
    gone = [f for f in sorted(Path(folder).rglob(".*.tmp-*")) if f.is_file() and
            (m := _TEMP.match(f.name)) is not None and not _running(int(m["pid"]))]
    for f in gone:
        f.unlink(missing_ok=True)
    return gone


def save_torch(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (:func:`write_binary`)."""
    return write_binary(path, lambda f: torch.save(obj, f))


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A byte copy of checkpoint ``src`` at ``dst``, written atomically (:func:`write_binary`): the copy's sha256
    is the source's."""
    def fill(f: BinaryIO) -> None:
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 20)

    return write_binary(dst, fill)


def cpu_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as float32 CPU tensors; tensors that share storage (DyPRAG's second names) still
    share it, so the file holds each once."""
    memo: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    return {k: memo.setdefault((v.data_ptr(), tuple(v.shape)), v.detach().to("cpu", torch.float32))
            for k, v in module.state_dict().items()}


def save_translator(translator: Translator, path: str | Path) -> Path:
    """Write ``translator`` in DyPRAG's format (atomically); DyPRAG's loader finds exactly what it expects."""
    return save_torch({STATE_KEY: cpu_state_dict(translator)}, path)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The ``model_state_dict`` of a DyPRAG translator checkpoint (``weights_only=True``); a missing, unreadable or
    foreign file is a one-line :class:`TranslatorError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise TranslatorError(f"{path}: translator checkpoint not found (expected a file written by DyPRAG's "
                              "train_dyprag.py or fcprag's translator training)")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # the safe unpickler's messages run over many lines: keep the first
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TranslatorError(f"{path}: cannot be read as a translator checkpoint with torch.load(weights_only=True) "
                              f"({first})") from None
    sd = obj.get(STATE_KEY) if isinstance(obj, Mapping) else None
    if not isinstance(sd, Mapping) or not sd:
        what = f"keys {sorted(map(str, obj))[:5]}" if isinstance(obj, Mapping) else f"a {type(obj).__name__}"
        raise TranslatorError(f"{path}: expected DyPRAG's checkpoint, a dict with a non-empty '{STATE_KEY}'; "
                              f"got {what}")
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor) or v.ndim != 2 or not v.is_floating_point():
            got = f"shape {list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise TranslatorError(f"{path}: key '{k}' holds {got}; expected a 2-D float weight")
    return dict(sd)


def shape_of(sd: Mapping[str, torch.Tensor], path: str | Path) -> TranslatorShape:
    """The translator shape the file's keys and shapes describe (:mod:`.network`'s layout)."""
    layers: set[int] = set()
    modules: set[str] = set()
    for k in sd:
        m = _KEY.match(k)
        if m is None or m["module"] not in MODULES:
            raise TranslatorError(f"{path}: key '{k}' is not a key of DyPRAG's ParameterTranslator (expected "
                                  f"'projector.<module>_<layer>.projector.pre_A_linear.weight' and the like, "
                                  f"<module> one of {list(MODULES)})")
        layers.add(int(m["layer"]))
        modules.add(m["module"])

    def weight(module: str, name: str) -> torch.Tensor:
        key = f"projector.{module}_{min(layers)}.projector.{name}.weight"
        if key not in sd:
            raise TranslatorError(f"{path}: key '{key}' is missing")
        return sd[key]

    first = next(m for m in MODULES if m in modules)
    width, hidden = weight(first, "pre_A_linear").shape[0], weight(first, "pre_A_linear").shape[1] - 1
    # the factor whose size is the hidden size gives the rank, the other one the intermediate size
    h_side, i_side = ("post_B_linear", "post_A_linear") if first == "down_proj" else ("post_A_linear", "post_B_linear")
    rank = weight(first, h_side).shape[0] // max(hidden, 1)
    if rank < 1 or rank * hidden != weight(first, h_side).shape[0]:
        raise TranslatorError(f"{path}: key 'projector.{first}_{min(layers)}.projector.{h_side}.weight' has shape "
                              f"{list(weight(first, h_side).shape)}: its rows are not a multiple of the hidden size "
                              f"{hidden} (read from pre_A_linear)")
    inter = weight(first, i_side).shape[0] // rank
    return TranslatorShape(max(layers) + 1, int(hidden), int(inter), int(rank), int(width),
                           tuple(m for m in MODULES if m in modules))


def check_fits(sd: Mapping[str, torch.Tensor], path: str | Path, config: Any, model: str = "the model"
               ) -> TranslatorShape:
    """The shape the model's ``config`` needs at the file's rank and width; a key that is missing, left over or
    of another shape is a one-line :class:`TranslatorError` naming the file, the key and both shapes."""
    have = shape_of(sd, path)
    need = TranslatorShape.from_config(config, rank=have.rank, width=have.width)
    want = need.key_shapes()
    for k, v in sd.items():
        if k in want and tuple(v.shape) != want[k]:
            raise TranslatorError(f"{path}: key '{k}' has shape {list(v.shape)} but {model} needs {list(want[k])} "
                                  f"(the file's translator: {have.describe()}; {model}: {need.describe()})")
    for k, v in sd.items():
        if k not in want:
            raise TranslatorError(f"{path}: key '{k}' (shape {list(v.shape)}) has no place in {model}, whose "
                                  f"layers are 0..{need.layers - 1} (the file's translator: {have.describe()}; "
                                  f"{model}: {need.describe()})")
    for k, s in want.items():
        if k not in sd:
            raise TranslatorError(f"{path}: key '{k}' is missing; {model} needs it with shape {list(s)} (the file's "
                                  f"translator: {have.describe()}, projections {list(have.modules)}; {model}: "
                                  f"{need.describe()})")
    return need


def load_translator(path: str | Path, config: Any, *, model: str = "the model",
                    device: str | torch.device = "cpu") -> Translator:
    """A translator checkpoint in DyPRAG's format, checked against the model's ``config`` (:func:`check_fits`) and
    loaded strictly, on ``device``. ``model``: how messages name the model (e.g. ``--model NAME``)."""
    sd = read_state_dict(path)
    translator = Translator(check_fits(sd, path, config, model))
    translator.load_state_dict(sd, strict=True)
    return translator.to(device).eval()
