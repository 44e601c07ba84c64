"""Leave-one-out label files, the format between what writes labels (``fcprag labels build``) and what reads them
(the trainer, ``fcprag eval``, the study's verdict): parsing and validation (JSON Lines or a JSON array; the format,
the error messages ``FILE:LINE: field 'NAME': ...`` and ``on_error``: ``docs/label-format.md``,
``schemas/labels.schema.json``)."""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from .errors import FcpragError, LabelFileError
from .fileio import decode_utf8, iter_records, read_bytes

logger = logging.getLogger(__name__)

ON_ERROR = ("fail", "skip")
REQUIRED = ("id", "query", "passages")
# split values understood by the trainer; anything else is an error (a typo must not move data silently). A record
# of another split than "train" is held out: the trainer leaves it out (fcprag eval scores such records)
TRAIN_SPLITS = ("train",)
HELD_OUT_SPLITS = ("val", "validation", "dev", "test")
KNOWN_SPLITS = TRAIN_SPLITS + HELD_OUT_SPLITS
DELTA_TOLERANCE = 1e-6  # when both deltas and metric_all/metric_without are given they must agree


@dataclass
class LabelRecord:
    """One validated record. ``deltas`` is always filled (computed from the metrics when needed)."""

    id: str
    query: str
    passages: list[str]
    deltas: list[float]
    file: str = ""
    line: int = 0
    metric_all: float | None = None
    metric_without: list[float] | None = None
    adapters: list[str] | None = None
    answer: Any = None
    metric: str | None = None
    group: str | None = None
    split: str | None = None
    retrieval_ranks: list[float] | None = None
    retrieval_scores: list[float] | None = None
    adapter_stats: list[dict[str, float]] | None = None
    scales: list[float] | None = None  # total scales s at which the full set was measured (every w~_i = s) ...
    metric_at_scales: list[float] | None = None  # ... and the label metric there (fcprag labels build --scales)
    f1_all: float | None = None  # F1 of the greedy answer with all passages (PRAG's sum) ...
    f1_at_scales: list[float] | None = None  # ... and at each of ``scales`` (answer-level scale labels)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def scale_gains(self) -> dict[float, float] | None:
        """``{s: metric at scale s - metric_all}``: the measured gain of PRAG's sum times s over the sum (or None)."""
        return _gains(self.scales, self.metric_at_scales, self.metric_all)

    @property
    def f1_scale_gains(self) -> dict[float, float] | None:
        """``{s: F1 at scale s - f1_all}`` (or None)."""
        return _gains(self.scales, self.f1_at_scales, self.f1_all)

    @property
    def n(self) -> int:
        return len(self.passages)

    @property
    def group_key(self) -> str:
        """What a cross-validation fold keeps together: the ``group`` when given, else the ``id``."""
        return f"group:{self.group}" if self.group is not None else f"id:{self.id}"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


# the other fields a record may give: LabelRecord's, but where it was read (file, line) and the unknown keys (extra)
OPTIONAL = tuple(f.name for f in fields(LabelRecord) if f.name not in (*REQUIRED, "file", "line", "extra"))


def _gains(scales: list[float] | None, at: list[float] | None, base: float | None) -> dict[float, float] | None:
    return None if scales is None or at is None or base is None else {s: m - base for s, m in zip(scales, at)}


@dataclass
class SkippedRecord:
    file: str
    line: int
    field: str | None
    message: str  # the full message, as it would have been raised


@dataclass
class LabelSet:
    """Records read from one label file, plus what was skipped and why (``on_error="skip"``)."""

    path: str
    records: list[LabelRecord]
    skipped: list[SkippedRecord] = field(default_factory=list)
    sha256: str = ""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[LabelRecord]:
        return iter(self.records)

    def skip_counts(self) -> dict[str, int]:
        """Number of skipped records per offending field (``"<json>"`` for unparsable lines)."""
        return dict(Counter(s.field or "<json>" for s in self.skipped))

    def summary(self) -> str:
        s = f"{self.path}: {len(self.records)} records"
        if self.skipped:
            parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.skip_counts().items()))
            s += f", {len(self.skipped)} skipped ({parts})"
        return s


class _RecordError(Exception):
    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def _type_name(v: Any) -> str:
    return "null" if v is None else "object" if type(v) is dict else type(v).__name__


def _number(v: Any, fld: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _RecordError(fld, f"is a {_type_name(v)} ({v!r:.60}), expected a finite number")
    if not math.isfinite(v):
        raise _RecordError(fld, f"is {v}, expected a finite number")
    return float(v)


def _f1(v: Any, fld: str) -> float:
    f1 = _number(v, fld)
    if not 0 <= f1 <= 1:
        raise _RecordError(fld, f"is {f1}, expected an F1 in [0, 1]")
    return f1


def _number_list(v: Any, fld: str, n: int, per: str = "passage") -> list[float]:
    if not isinstance(v, list):
        raise _RecordError(fld, f"is a {_type_name(v)}, expected a list of {n} numbers (one per {per})")
    if len(v) != n:
        raise _RecordError(fld, f"has {len(v)} values but '{per}s' has {n}; expected one per {per}")
    return [_number(x, f"{fld}[{i}]") for i, x in enumerate(v)]


def _list_of_n(v: Any, fld: str, n: int, what: str) -> list:
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} entries" if isinstance(v, list) else f"a {_type_name(v)}"
        raise _RecordError(fld, f"is {got}, expected a list of {n} {what} (one per passage)")
    return v


def _nonempty_str(v: Any, fld: str) -> str:
    if not isinstance(v, str):
        raise _RecordError(fld, f"is a {_type_name(v)} ({v!r:.60}), expected a non-empty string")
    if not v.strip():
        raise _RecordError(fld, "is empty, expected a non-empty string")
    return v


def validate_record(obj: Any) -> LabelRecord:
    """Check one parsed JSON value; raises ``_RecordError(field, message)`` (no file/line yet)."""
    if not isinstance(obj, dict):
        raise _RecordError(None, f"record is a {_type_name(obj)}, expected a JSON object with keys "
                                 f"{list(REQUIRED)} and 'deltas' (or 'metric_all' + 'metric_without')")
    for k in REQUIRED:
        if k not in obj:
            raise _RecordError(k, "is missing (required)")
    rid = _nonempty_str(obj["id"], "id")
    query = _nonempty_str(obj["query"], "query")
    ps = obj["passages"]
    if not isinstance(ps, list) or not ps:
        raise _RecordError("passages", f"is a {_type_name(ps)}, expected a list of non-empty strings" if not
                           isinstance(ps, list) else "is empty, expected at least one passage")
    passages = [_nonempty_str(p, f"passages[{i}]") for i, p in enumerate(ps)]
    n = len(passages)

    has_deltas = "deltas" in obj
    has_all, has_without = "metric_all" in obj, "metric_without" in obj
    missing = "metric_without" if has_all else "metric_all" if has_without else "deltas"
    if not has_deltas and not (has_all and has_without):
        raise _RecordError(missing, "is missing; expected 'deltas' (N numbers) or both 'metric_all' (a number) "
                                    "and 'metric_without' (N numbers)")
    if has_all != has_without:
        raise _RecordError(missing, "is missing; 'metric_all' and 'metric_without' must be given together")
    metric_all = metric_without = None
    if has_all:
        metric_all = _number(obj["metric_all"], "metric_all")
        metric_without = _number_list(obj["metric_without"], "metric_without", n)
    if has_deltas:
        deltas = _number_list(obj["deltas"], "deltas", n)
        if metric_all is not None:
            for i, (d, mw) in enumerate(zip(deltas, metric_without)):
                if abs(d - (metric_all - mw)) > DELTA_TOLERANCE * max(1.0, abs(d)):
                    raise _RecordError(f"deltas[{i}]", f"is {d} but metric_all - metric_without[{i}] = "
                                                       f"{metric_all - mw}; expected them to agree (or give only one)")
    else:
        deltas = [metric_all - mw for mw in metric_without]
        if not all(math.isfinite(d) for d in deltas):  # finite inputs can still overflow
            raise _RecordError("metric_without", "metric_all - metric_without is not finite")

    adapters = obj.get("adapters")
    if adapters is not None:
        for i, a in enumerate(_list_of_n(adapters, "adapters", n, "paths")):
            _nonempty_str(a, f"adapters[{i}]")
    answer = obj.get("answer")
    if answer is not None and not (isinstance(answer, str) or
                                   (isinstance(answer, list) and all(isinstance(a, str) for a in answer))):
        raise _RecordError("answer", f"is a {_type_name(answer)}, expected a string or a list of strings")
    metric = None if obj.get("metric") is None else _nonempty_str(obj["metric"], "metric")
    group = obj.get("group")
    if group is not None:
        if isinstance(group, bool) or not isinstance(group, (str, int)):
            raise _RecordError("group", f"is a {_type_name(group)}, expected a string or an integer")
        group = str(group)
    split = obj.get("split")
    if split is not None:
        split = _nonempty_str(split, "split")
        if split not in KNOWN_SPLITS:
            raise _RecordError("split", f"is '{split}', expected one of {list(KNOWN_SPLITS)}")
    ranks = _number_list(obj["retrieval_ranks"], "retrieval_ranks", n) if "retrieval_ranks" in obj else None
    scores = _number_list(obj["retrieval_scores"], "retrieval_scores", n) if "retrieval_scores" in obj else None
    stats = _adapter_stats_field(obj["adapter_stats"], n) if "adapter_stats" in obj else None
    scales, at_scales = _scale_fields(obj, metric_all)
    f1_all, f1_at = _f1_scale_fields(obj, scales)
    extra = {k: v for k, v in obj.items() if k not in REQUIRED and k not in OPTIONAL}
    return LabelRecord(id=rid, query=query, passages=passages, deltas=deltas, metric_all=metric_all,
                       metric_without=metric_without, adapters=adapters, answer=answer, metric=metric,
                       group=group, split=split, retrieval_ranks=ranks, retrieval_scores=scores,
                       adapter_stats=stats, scales=scales, metric_at_scales=at_scales, f1_all=f1_all,
                       f1_at_scales=f1_at, extra=extra)


def _scale_fields(obj: dict[str, Any], metric_all: float | None) -> tuple[list[float] | None, list[float] | None]:
    """``scales`` (distinct numbers > 0) and ``metric_at_scales`` (one number each), given together and with
    ``metric_all``."""
    if ("scales" in obj) != ("metric_at_scales" in obj):
        missing = "metric_at_scales" if "scales" in obj else "scales"
        raise _RecordError(missing, "is missing; 'scales' and 'metric_at_scales' must be given together")
    if "scales" not in obj:
        return None, None
    if metric_all is None:
        raise _RecordError("metric_all", "is missing; scale measurements ('scales') are gains over 'metric_all'")
    raw = obj["scales"]
    if not isinstance(raw, list) or not raw:
        raise _RecordError("scales", f"is a {_type_name(raw)}, expected a non-empty list of numbers > 0")
    scales = [_number(s, f"scales[{i}]") for i, s in enumerate(raw)]
    bad = next((i for i, s in enumerate(scales) if s <= 0 or s in scales[:i]), None)
    if bad is not None:
        raise _RecordError(f"scales[{bad}]", f"is {scales[bad]}, expected distinct numbers > 0")
    return scales, _number_list(obj["metric_at_scales"], "metric_at_scales", len(scales), "scale")


def _f1_scale_fields(obj: dict[str, Any], scales: list[float] | None
                     ) -> tuple[float | None, list[float] | None]:
    """``f1_all`` (in [0, 1]) and ``f1_at_scales`` (one F1 per entry of ``scales``; needs ``f1_all``)."""
    f1_all = _f1(obj["f1_all"], "f1_all") if "f1_all" in obj else None
    if "f1_at_scales" not in obj:
        return f1_all, None
    if scales is None:
        raise _RecordError("scales", "is missing; 'f1_at_scales' gives one F1 per entry of 'scales'")
    if f1_all is None:
        raise _RecordError("f1_all", "is missing; 'f1_at_scales' are F1 gains over 'f1_all' (PRAG's sum)")
    at = _number_list(obj["f1_at_scales"], "f1_at_scales", len(scales), "scale")
    return f1_all, [_f1(v, f"f1_at_scales[{i}]") for i, v in enumerate(at)]


def _adapter_stats_field(v: Any, n: int) -> list[dict[str, float]]:
    """``adapter_stats``: one object per passage with (at least) the keys of ``features.ADAPTER_STAT_NAMES``."""
    from .features import ADAPTER_STAT_NAMES

    out = []
    for i, row in enumerate(_list_of_n(v, "adapter_stats", n, "objects")):
        if not isinstance(row, dict):
            raise _RecordError(f"adapter_stats[{i}]", f"is a {_type_name(row)}, expected an object with keys "
                                                      f"{list(ADAPTER_STAT_NAMES)}")
        missing = [k for k in ADAPTER_STAT_NAMES if k not in row]
        if missing:
            raise _RecordError(f"adapter_stats[{i}]", f"lacks key(s) {missing}; expected {list(ADAPTER_STAT_NAMES)} "
                                                      "(fcprag_plugin.features.adapter_stats)")
        for k in ADAPTER_STAT_NAMES:
            _number(row[k], f"adapter_stats[{i}].{k}")
        out.append(dict(row))  # kept as given (other keys too); the trainer reads ADAPTER_STAT_NAMES
    return out


def load_labels(path: str | Path, on_error: str = "fail") -> LabelSet:
    """Read and validate a label file (JSON Lines or a JSON array, gzipped when its name ends in ``.gz``).
    ``on_error="fail"`` raises :class:`LabelFileError` at the first bad record (or repeated id); ``"skip"`` leaves
    them out, listed in ``LabelSet.skipped``."""
    if on_error not in ON_ERROR:
        raise LabelFileError(f"on_error is '{on_error}', expected one of {list(ON_ERROR)}")
    p = Path(path)
    if not p.is_file():
        raise LabelFileError(f"{p}: label file not found")
    raw = read_bytes(p, LabelFileError)
    text, spath = decode_utf8(raw, p, LabelFileError), str(p)
    if not text.lstrip("\ufeff \t\r\n"):
        raise LabelFileError(f"{p}: label file is empty; expected JSON Lines or a JSON array of records")

    records: list[LabelRecord] = []
    skipped: list[SkippedRecord] = []
    seen: dict[str, int] = {}
    for lineno, value, parse_error in iter_records(text, spath, LabelFileError):
        try:
            if parse_error is not None:
                raise _RecordError(None, parse_error)
            rec = validate_record(value)
            if rec.id in seen:
                raise _RecordError("id", f"'{rec.id}' is a duplicate (first seen on line {seen[rec.id]}); "
                                         "expected unique ids")
        except _RecordError as e:
            msg = f"{spath}:{lineno}: " + (f"field '{e.field}': " if e.field else "") + e.message
            if on_error == "fail":
                raise LabelFileError(msg) from None
            skipped.append(SkippedRecord(spath, lineno, e.field, msg))
            continue
        rec.file, rec.line = spath, lineno
        seen[rec.id] = lineno
        records.append(rec)
    ls = LabelSet(spath, records, skipped, hashlib.sha256(raw).hexdigest())
    if skipped:
        logger.warning("%s", ls.summary())
        for s in skipped[:5]:
            logger.warning("  skipped %s", s.message)
    if not records:
        raise LabelFileError(f"{p}: no valid records" + (f" ({len(skipped)} skipped: {ls.skip_counts()})"
                                                         if skipped else ""))
    return ls


def as_label_set(labels: Any, on_error: str, what: str) -> LabelSet:
    """``labels`` (a label file path, a :class:`LabelSet` or a list of :class:`LabelRecord`) as a LabelSet."""
    if isinstance(labels, LabelSet):
        return labels
    if isinstance(labels, (str, Path)):
        return load_labels(labels, on_error)
    if isinstance(labels, (list, tuple)) and all(isinstance(r, LabelRecord) for r in labels):
        return LabelSet(f"<{what} records>", list(labels))
    raise FcpragError(f"{what}: expected a label file path, a LabelSet or a list of LabelRecord, got "
                      f"{type(labels).__name__}")


def drop_held_out(records: list[LabelRecord], what: str) -> list[LabelRecord]:
    """The records to train on: those of no ``split`` or split ``train``."""
    kept = [r for r in records if r.split not in HELD_OUT_SPLITS]
    if len(kept) < len(records):
        splits = sorted({str(r.split) for r in records if r.split in HELD_OUT_SPLITS})
        logger.info("%s: %d records with split %s are left out of training", what, len(records) - len(kept), splits)
    return kept
