"""Label part files of a sharded build: rank ``r`` of ``W`` labels records ``i % W == r``
(:func:`shard_records`); :func:`merge_parts` validates the parts and concatenates them in manifest order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import LabelFileError
from fcprag_plugin.fileio import write_atomic
from ..lm.store import read_label_lines
from .manifest import ManifestRecord


def shard_records(records: Sequence[ManifestRecord], rank: int, world: int) -> list[ManifestRecord]:
    """Records ``i % world == rank`` (round robin keeps shards balanced when record sizes drift along the file)."""
    return [r for i, r in enumerate(records) if i % world == rank]


@dataclass
class MergeSummary:
    written: int
    missing: list[str]
    per_file: dict[str, int]


def merge_parts(parts: Sequence[str | Path], manifest: Sequence[ManifestRecord], out: str | Path, *,
                allow_missing: bool = False, allow_identical_duplicates: bool = False) -> MergeSummary:
    """Validate label part files against the manifest and write them to ``out`` in manifest order.

    Errors name the file and line: an id not in the manifest, a duplicate id (both places), a record whose
    ``metric_without`` length differs from the manifest's passage count, a record whose ``scales`` (none: built
    without ``--scales``) differ from the first record's or do not match its ``metric_at_scales``, a partial last
    line. Missing ids are an error unless ``allow_missing``. Lines are copied verbatim (no float re-formatting).
    ``allow_identical_duplicates`` accepts an id seen twice with byte-identical lines (a part that was already
    merged into ``out`` by an earlier run); differing duplicates are always an error.
    """
    order = {r.id: i for i, r in enumerate(manifest)}
    n_of = {r.id: r.n for r in manifest}
    found: dict[str, tuple[str, int, str]] = {}
    per_file: dict[str, int] = {}
    grid: tuple[Any, str] | None = None  # the first record's scales and place: one grid per label file
    if not parts:
        raise LabelFileError("no part files given to merge")
    for part in parts:
        part = Path(part)
        if not part.is_file():
            raise LabelFileError(f"{part}: part file not found")
        lines = read_label_lines(part, partial="error")
        per_file[str(part)] = len(lines)
        for sl in lines:
            rid = sl.record["id"]
            where = f"{part}:{sl.line}"
            if rid not in order:
                raise LabelFileError(f"{where}: field 'id': '{rid}' is not in the manifest")
            if rid in found:
                f0, l0, raw0 = found[rid]
                if allow_identical_duplicates and raw0 == sl.raw:
                    continue
                raise LabelFileError(f"{where}: field 'id': duplicate id '{rid}' (also at {f0}:{l0})")
            mw = sl.record.get("metric_without")
            if not isinstance(mw, list) or len(mw) != n_of[rid]:
                got = len(mw) if isinstance(mw, list) else type(mw).__name__
                raise LabelFileError(f"{where}: field 'metric_without': expected a list of {n_of[rid]} numbers "
                                     f"(one per manifest passage), got {got}")
            grid = _check_scales(sl.record, where, grid)
            found[rid] = (str(part), sl.line, sl.raw)
    missing = [r.id for r in manifest if r.id not in found]
    if missing and not allow_missing:
        shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise LabelFileError(f"{len(missing)} manifest ids have no labels in the given parts: {shown} "
                             "(re-run 'fcprag labels build' to fill them in, or pass --allow-missing)")
    ordered = sorted(found, key=order.__getitem__)
    write_atomic(out, "".join(found[rid][2] for rid in ordered))
    return MergeSummary(len(ordered), missing, per_file)


def _check_scales(record: dict[str, Any], where: str, grid: tuple[Any, str] | None) -> tuple[Any, str]:
    """The record's ``scales`` (``[]`` when absent) against the file's first (``grid``), and its
    ``metric_at_scales`` against its ``scales``; returns the grid."""
    scales = record.get("scales", [])
    if not isinstance(scales, list):
        raise LabelFileError(f"{where}: field 'scales': expected a list of numbers, got {type(scales).__name__}")
    if grid is not None and scales != grid[0]:
        raise LabelFileError(f"{where}: field 'scales': {scales} but {grid[1]} has {grid[0]}; a label file does not "
                             "mix scale grids: build every part with the same --scales")
    at = record.get("metric_at_scales")
    if scales and (not isinstance(at, list) or len(at) != len(scales)):
        got = len(at) if isinstance(at, list) else type(at).__name__
        raise LabelFileError(f"{where}: field 'metric_at_scales': expected a list of {len(scales)} numbers (one per "
                             f"entry of 'scales'), got {got}")
    return grid or (scales, where)
