"""JSON Lines label files read back for a resume: appended by :class:`~fcprag_plugin.fileio.JsonlAppender` (a crash
can only leave a partial *last* line), scanned here, which drops that line before appending again."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fcprag_plugin.errors import LabelFileError
from fcprag_plugin.fileio import decode_utf8, json_error, parse_json_lines, split_lines

logger = logging.getLogger(__name__)


@dataclass
class StoredLine:
    """One complete line of a label file: its parsed record, its raw text (with newline) and its line number."""

    record: dict[str, Any]
    raw: str
    line: int


def read_label_lines(path: str | Path, *, partial: str = "error") -> list[StoredLine]:
    """The complete lines of a JSON Lines label file (each a JSON object with a string ``id``; errors name the file
    and line). ``partial``: what to do with a trailing line without its newline (an interrupted append):
    ``"error"``, ``"ignore"`` or ``"truncate"`` (cut it off the file)."""
    path = Path(path)
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1  # bytes up to and including the last newline
    if cut < len(data):
        tail = data[cut:]
        if partial == "error":
            lineno = data[:cut].count(b"\n") + 1
            raise LabelFileError(f"{path}:{lineno}: the last line is incomplete "
                                 f"({len(tail)} bytes without a newline; an interrupted run?). Re-run "
                                 "'fcprag labels build' on it to resume, which drops the partial line")
        if partial == "truncate":
            logger.warning("%s: dropping a partial last line (%d bytes) left by an interrupted run", path, len(tail))
            with path.open("r+b") as f:
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())
    lines: list[StoredLine] = []
    for lineno, raw, obj, e in parse_json_lines(split_lines(decode_utf8(data[:cut], path, LabelFileError), True)):
        if e is not None:
            raise LabelFileError(f"{path}:{lineno}: not valid JSON ({json_error(e)})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            raise LabelFileError(f"{path}:{lineno}: field 'id': expected a JSON object with a string 'id'")
        lines.append(StoredLine(obj, raw if raw.endswith("\n") else raw + "\n", lineno))
    return lines


def done_ids(path: str | Path, *, repair: bool) -> dict[str, int]:
    """Ids already in a label file (id -> line; a duplicate id is an error). ``repair`` drops a partial last
    line from the file."""
    path = Path(path)
    if not path.exists():
        return {}
    lines = read_label_lines(path, partial="truncate" if repair else "ignore")
    seen: dict[str, int] = {}
    for sl in lines:
        rid = sl.record["id"]
        if rid in seen:
            raise LabelFileError(f"{path}:{sl.line}: field 'id': duplicate id '{rid}' (first on line {seen[rid]})")
        seen[rid] = sl.line
    return seen
