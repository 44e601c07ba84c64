"""Resumable unit stores: one JSON Lines file per stage under the study folder, a unit per line (appended with
fsync, a partial last line from a killed process dropped on the next read), so a finished unit is never redone.

Under a launcher (``RANK``/``WORLD_SIZE``) rank ``r`` of ``W`` appends to ``NAME.part{r}-of{W}.jsonl``;
:meth:`UnitStore.merge` (rank 0, after a barrier) folds every part into ``NAME.jsonl`` atomically. Done units are
read from the main file and every part file, so a run resumed with another world size skips them too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

from fcprag_plugin.fileio import append_json_lines, write_json_lines
from .shard import ShardInfo, part_path
from .store import read_label_lines


class UnitStore:
    """Rows of one stage, each with a string ``id`` (its unit); ``done()`` -> ``{id: row}`` (the last row wins)."""

    def __init__(self, path: Path, shard: ShardInfo = ShardInfo()) -> None:
        self.path, self.shard = Path(path), shard

    def files(self) -> list[Path]:
        stem = self.path.name.removesuffix(".jsonl")
        return [p for p in [self.path, *sorted(self.path.parent.glob(f"{stem}.part*-of*.jsonl"))] if p.is_file()]

    @property
    def target(self) -> Path:
        return part_path(self.path, self.shard.rank, self.shard.world) if self.shard.distributed else self.path

    def done(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for f in self.files():
            # our own file may end in a partial line (killed mid-write): drop it; others' are only read
            for sl in read_label_lines(f, partial="truncate" if f == self.target else "ignore"):
                out[sl.record["id"]] = sl.record
        return out

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        append_json_lines(self.target, rows)

    def merge(self) -> None:
        """Fold the part files into the main file (atomically), then delete them (rank 0, after a barrier)."""
        parts = [f for f in self.files() if f != self.path]
        if not parts:
            return
        rows = self.done()
        write_json_lines(self.path, rows.values())
        for f in parts:
            f.unlink()


def log_timing(out: Path, stage: str, seconds: float, **info: Any) -> None:
    """One line per finished (or resumed) stage in ``OUT/timings.jsonl``."""
    append_json_lines(Path(out) / "timings.jsonl", [{
        "stage": stage, "seconds": round(seconds, 2), "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}])
