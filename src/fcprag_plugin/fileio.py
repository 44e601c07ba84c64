"""File I/O of the library: strict JSON values (:func:`finite_or_none`), the one record reader (a JSON array or JSON
Lines: :func:`iter_records`, :func:`read_records`), the JSON reader, the one atomic file writer and the safetensors
reader. Errors name the file (and the line)."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator


def finite_or_none(obj: Any) -> Any:
    """NaN / inf -> None, recursively through dicts, lists and tuples, so a record is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def split_lines(text: str, keepends: bool = False) -> list[str]:
    """``text``'s lines, broken at ``"\\n"`` only (unlike ``str.splitlines()``, not at U+2028, U+0085 and others
    that JSON strings written with ``ensure_ascii=False`` hold raw; a ``"\\r"`` stays, JSON reads it as space)."""
    lines = text.split("\n")
    last = lines.pop()  # "" when the text ends with a newline (or is empty)
    if keepends:
        lines = [line + "\n" for line in lines]
    return lines + [last] if last else lines


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (temp file beside it, ``fsync``, ``os.replace``; none left)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented strict JSON (NaN/inf as null, other non-JSON values as ``str``), atomically."""
    return write_atomic(path, json.dumps(finite_or_none(obj), indent=2, allow_nan=False, default=str) + "\n")


def parse_json_lines(lines: Iterable[str]) -> Iterator[tuple[int, str, Any, json.JSONDecodeError | None]]:
    """``(line number, raw line, value, error)`` per non-blank line; for invalid JSON ``value`` is None and
    ``error`` says why (each reader turns it into its own message)."""
    for lineno, raw in enumerate(lines, start=1):
        if raw.strip():
            try:
                value, error = json.loads(raw), None
            except json.JSONDecodeError as e:
                value, error = None, e
            yield lineno, raw, value, error


def decode_utf8(raw: bytes, path: Any, error: type[Exception]) -> str:
    """``raw`` as UTF-8 text; invalid bytes are an ``error`` naming the file and the line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not valid UTF-8 (byte {e.start})") from e


def json_error(e: json.JSONDecodeError) -> str:
    """Why ``e``, and where on its line: ``Expecting value at column 3`` (json's ``Unterminated string starting at``
    already ends in "at")."""
    return f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"


def iter_records(text: str, path: Any, error: type[Exception]) -> Iterator[tuple[int, Any, str | None]]:
    """``(line, value, problem)`` per record of ``text``: a JSON array when ``[`` comes first (a leading BOM dropped; an
    element's line is the one it starts on; invalid JSON raises ``error``), else JSON Lines (a line that is not JSON:
    value None and its ``problem``, for a reader that skips it)."""
    text = text.lstrip("\ufeff")
    if not text.lstrip(" \t\r\n").startswith("["):
        for n, _, value, e in parse_json_lines(split_lines(text)):
            yield n, value, None if e is None else f"not valid JSON ({json_error(e)})"
        return
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        said = "unexpected text after the closing ']' of the array" if e.msg == "Extra data" else "not valid JSON"
        raise error(f"{path}:{e.lineno}: {said} ({json_error(e)})") from None
    skip, dec = re.compile(r"[\s,]*"), json.JSONDecoder()  # valid JSON: an element starts after blanks and a comma
    line = text.count("\n", 0, start := skip.match(text, text.index("[") + 1).end()) + 1
    for value in values:
        yield line, value, None
        end = skip.match(text, dec.raw_decode(text, start)[1]).end()
        line, start = line + text.count("\n", start, end), end


def read_bytes(path: str | Path, error: type[Exception]) -> bytes:
    """The bytes of ``path``, decompressed when its name ends in ``.gz`` (records ship gzipped to keep the tree small);
    a corrupt gzip file is an ``error`` naming it."""
    p = Path(path)
    if p.suffix != ".gz":
        return p.read_bytes()
    try:
        return gzip.decompress(p.read_bytes())
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a truncated file an EOFError
        raise error(f"{p}: not a readable gzip file ({e})") from None


def read_records(path: str | Path, error: type[Exception]) -> list[tuple[int, Any]]:
    """``(line, record)`` of a JSON array or JSON Lines file (:func:`iter_records`), gzipped when its name ends in
    ``.gz``; errors name file:line."""
    out = []
    for line, value, problem in iter_records(decode_utf8(read_bytes(path, error), path, error), path, error):
        if problem is not None:
            raise error(f"{path}:{line}: {problem}")
        out.append((line, value))
    return out


def read_json_object(path: Path, error: type[Exception], missing: str) -> dict[str, Any]:
    """The JSON object in ``path``; a missing file (``missing``: what to say), invalid JSON or a non-object is an
    ``error`` naming it."""
    if not path.is_file():
        raise error(f"{path}: {missing}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_tensor_file(path: Path, device: Any, error: type[Exception], missing: str) -> dict[str, Any]:
    """The tensors of safetensors file ``path`` on ``device``; a missing or unreadable one is an ``error`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise error(f"{path}: {missing}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise error(f"{path}: corrupt or unreadable safetensors file ({e})") from e
