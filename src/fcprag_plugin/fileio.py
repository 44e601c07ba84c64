"""File I/O of the library, one of each: strict JSON values, the record reader (a JSON array or JSON Lines, gzipped
or not), the JSON object reader, the atomic file writer, the JSON Lines writers and the safetensors
reader. Errors name the file (and the line)."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator


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


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (temp file beside it, ``fsync``,
    ``os.replace``; none left)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
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


def json_line(record: Any, default: Callable[[Any], Any] | None = None) -> str:
    """``record`` as one JSON Lines line (with its newline): strict JSON (a NaN or inf is a ``ValueError``; pass
    :func:`finite_or_none` values to store null), non-ASCII as is, ``default`` as in ``json.dumps``."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False, default=default) + "\n"


def write_json_lines(path: str | Path, records: Iterable[Any], *, default: Callable[[Any], Any] | None = None) -> int:
    """Write ``records`` as a whole JSON Lines file (:func:`json_line` each), atomically; returns their number."""
    lines = [json_line(r, default) for r in records]
    write_atomic(path, "".join(lines))
    return len(lines)


class JsonlAppender:
    """Appends records to a JSON Lines file (made with its folder), each as :func:`json_line` written whole (an
    ``os.write`` loop on an ``O_APPEND`` descriptor), then ``fsync``: a crash leaves at most a partial *last* line
    (the resumable stores' readers drop it), and a record is on disk once :meth:`append` returns."""

    def __init__(self, path: str | Path, *, default: Callable[[Any], Any] | None = None) -> None:
        self.path, self._default = Path(path), default
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: Any) -> None:
        view = memoryview(json_line(record, self._default).encode("utf-8"))
        while view:  # os.write may write less than asked for huge lines
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self._fd)


def append_json_lines(path: str | Path, records: Iterable[Any], *, default: Callable[[Any], Any] | None = None) -> None:
    """Append ``records`` to JSON Lines file ``path`` (:class:`JsonlAppender`)."""
    with JsonlAppender(path, default=default) as out:
        for record in records:
            out.append(record)


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
    """The bytes of file ``path``, decompressed when its name ends in ``.gz``; a broken gzip stream is an ``error``
    naming the file."""
    raw = Path(path).read_bytes()
    if not str(path).endswith(".gz"):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut-off stream an EOFError
        raise error(f"{path}: not a readable gzip file ({e})") from e


def read_records(path: str | Path, error: type[Exception]) -> list[tuple[int, Any]]:
    """``(line, record)`` of a JSON array or JSON Lines file, gzipped when its name ends in ``.gz``
    (:func:`iter_records`); errors name file:line."""
    out = []
    for line, value, problem in iter_records(decode_utf8(read_bytes(path, error), path, error), path, error):
        if problem is not None:
            raise error(f"{path}:{line}: {problem}")
        out.append((line, value))
    return out


def read_json_if_present(path: str | Path, error: type[Exception], *, fix: str = "") -> dict[str, Any] | None:
    """The JSON object in ``path``, None when there is no such file; invalid UTF-8 or JSON, or a value that is not
    an object, is an ``error`` naming the file (and the line), followed by ``fix`` (what to do) when given."""
    path = Path(path)
    if not path.is_file():
        return None
    tail = f"; {fix}" if fix else ""
    text = decode_utf8(path.read_bytes(), path, error)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: not valid JSON ({json_error(e)}){tail}") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, got {type(obj).__name__}{tail}")
    return obj


def read_json_object(path: str | Path, error: type[Exception], missing: str, *, fix: str = "") -> dict[str, Any]:
    """The JSON object in ``path`` (:func:`read_json_if_present`); a missing file is an ``error`` saying
    ``missing``."""
    obj = read_json_if_present(path, error, fix=fix)
    if obj is None:
        raise error(f"{path}: {missing}")
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
