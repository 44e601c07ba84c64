"""PRAG's data layout, public for tools that write or read it: its adapter directories
``.../{group}/data_{test_id}/passage_{pid}`` (:func:`adapter_dir`, :func:`parse_adapter_path`) mapped back to record
``test_id`` (``question``, ``passages[pid]``) of PRAG's augmented data file ``{group}.json`` (a JSON list, or JSON
Lines; :class:`PragDataFile`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import HookError
from ..fileio import read_records

_DATA_RE = re.compile(r"^data_(\d+)$")
_PASSAGE_RE = re.compile(r"^passage_(\d+)$")


@dataclass(frozen=True)
class PragAdapterPath:
    """The parts of ``.../{group}/data_{test_id}/passage_{pid}``."""

    path: str
    group: str
    test_id: int
    pid: int


def adapter_dir(root: str | Path, test_id: int, pid: int) -> Path:
    """PRAG's adapter directory of passage ``pid`` of record ``test_id``: ``{root}/data_{test_id}/passage_{pid}``."""
    return Path(root) / f"data_{test_id}" / f"passage_{pid}"


def parse_adapter_path(path: str | Path | None) -> PragAdapterPath | None:
    """``PragAdapterPath`` when ``path`` follows PRAG's layout (:func:`adapter_dir` under a group folder), else None."""
    parts = Path(str(path).rstrip("/\\")).parts if path is not None else ()
    p, d = (_PASSAGE_RE.match(parts[-1]), _DATA_RE.match(parts[-2])) if len(parts) >= 3 else (None, None)
    return None if p is None or d is None else PragAdapterPath(str(path), parts[-3], int(d.group(1)), int(p.group(1)))


def pick_passages(parsed: Sequence[PragAdapterPath], passages: Sequence[str], where: str) -> list[str]:
    """One passage per adapter, by the ``passage_{pid}`` of its path (``where``: what holds ``passages``)."""
    for p in parsed:
        if p.pid >= len(passages):
            raise HookError(f"adapter {p.path}: passage {p.pid} does not exist, {where} has {len(passages)} passages")
    return [passages[p.pid] for p in parsed]


def common_test_id(paths: Sequence[PragAdapterPath | None]) -> int | None:
    """The ``test_id`` all parsed paths agree on, else None."""
    ids = {p.test_id for p in paths if p is not None}
    return ids.pop() if len(ids) == 1 and all(p is not None for p in paths) else None


class PragDataFile:
    """PRAG's augmented data: one file, or a directory of ``{group}.json`` / ``{group}.jsonl`` files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise HookError(f"{self.path}: PRAG data file not found (expected PRAG's augmented data: a JSON list of "
                            "records with 'question' and 'passages', or the directory holding such files)")
        self._cache: dict[Path, list[Any]] = {}

    def file_for(self, group: str, adapter_path: str) -> Path:
        if self.path.is_file():
            if self.path.stem != group:
                raise HookError(f"adapter {adapter_path} belongs to data file '{group}' but the PRAG data file given "
                                f"is {self.path} (stem '{self.path.stem}'); pass the data directory or the file "
                                f"'{group}.json'")
            return self.path
        for ext in (".json", ".jsonl"):
            cand = self.path / f"{group}{ext}"
            if cand.is_file():
                return cand
        raise HookError(f"adapter {adapter_path}: no data file '{group}.json' or '{group}.jsonl' in {self.path}")

    def context(self, parsed: Sequence[PragAdapterPath]) -> dict[str, Any]:
        """``{"question", "passages" (one per adapter, in adapter order), "test_id", "data_file"}``."""
        first = parsed[0]
        for p in parsed[1:]:
            if (p.group, p.test_id) != (first.group, first.test_id):
                raise HookError(f"the adapters being merged come from different questions: {first.path} and {p.path}")
        file = self.file_for(first.group, first.path)
        if file not in self._cache:
            self._cache[file] = [r for _, r in read_records(file, HookError)]
        recs = self._cache[file]
        if first.test_id >= len(recs):
            raise HookError(f"adapter {first.path}: test_id {first.test_id} is out of range for {file} "
                            f"({len(recs)} records)")
        rec = recs[first.test_id]
        where = f"{file}: record {first.test_id}"
        if not isinstance(rec, dict):
            raise HookError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        question, passages = rec.get("question"), rec.get("passages")
        if not isinstance(question, str):
            raise HookError(f"{where}: key 'question' must be a string, got {question!r:.80}")
        if not isinstance(passages, list) or not all(isinstance(t, str) for t in passages):
            raise HookError(f"{where}: key 'passages' must be a list of strings")
        return {"question": question, "passages": pick_passages(parsed, passages, where), "test_id": first.test_id,
                "data_file": str(file)}
