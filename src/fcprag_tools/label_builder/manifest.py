"""The label builder's input: a JSON Lines manifest (format: ``docs/labels-builder.md`` section 1), and its
conversion from PRAG's on-disk layout."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from fcprag_plugin.adapter import CONFIG_NAME, LEGACY_BIN_NAME, SAFETENSORS_NAME
from fcprag_plugin.errors import LabelFileError
from fcprag_plugin.fileio import read_records, write_json_lines
from fcprag_plugin.hosts.prag_data import adapter_dir

REQUIRED_FIELDS = ("id", "question", "answer", "passages", "adapters")
PASS_THROUGH_FIELDS = ("group", "split")


@dataclass
class ManifestRecord:
    """One training question: its gold answers and its N passages with their adapter directories (same order)."""

    id: str
    question: str
    answers: list[str]
    passages: list[str]
    adapters: list[Path]
    line: int = 0
    source: str = "<memory>"
    extra: dict[str, Any] = field(default_factory=dict)
    # per passage, for the label record: retrieval_ranks (and retrieval_scores when given), see retrieval_fields
    retrieval: dict[str, list[float]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.passages)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.line else self.source


def _fail(where: str, field_name: str, expected: str, got: Any) -> LabelFileError:
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return LabelFileError(f"{where}: field '{field_name}': expected {expected}, got {shown}")


def _nonempty(obj: dict[str, Any], name: str, where: str) -> str:
    value = obj[name]
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, name, "a non-empty string", value)
    return value


def _str_list(value: Any, where: str, name: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _fail(where, name, "a list of at least 1 non-empty strings", value)
    for i, v in enumerate(value):
        if not isinstance(v, str) or not v.strip():
            raise _fail(where, f"{name}[{i}]", "a non-empty string", v)
    return list(value)


def parse_answers(value: Any, where: str, name: str = "answer") -> list[str]:
    """``answer`` is a string or a non-empty list of aliases; returns the aliases."""
    if isinstance(value, str):
        if not value.strip():
            raise _fail(where, name, "a non-empty string or a list of non-empty strings (aliases)", value)
        return [value]
    return _str_list(value, where, name)


def parse_record(obj: Any, where: str, base_dir: Path | None = None, *, line: int = 0,
                 source: str = "") -> ManifestRecord:
    """Validate one manifest object; errors name ``where`` (``file:line``) and the field."""
    if not isinstance(obj, dict):
        raise LabelFileError(f"{where}: expected a JSON object with fields {list(REQUIRED_FIELDS)}, "
                             f"got {type(obj).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in obj:
            raise LabelFileError(f"{where}: field '{name}' is missing (required: {list(REQUIRED_FIELDS)})")
    rid, question = _nonempty(obj, "id", where), _nonempty(obj, "question", where)
    answers = parse_answers(obj["answer"], where)
    passages = _str_list(obj["passages"], where, "passages")
    adapters = _str_list(obj["adapters"], where, "adapters")
    if len(adapters) != len(passages):
        raise LabelFileError(f"{where}: field 'adapters' has {len(adapters)} entries but 'passages' has "
                             f"{len(passages)}; expected one adapter per passage, same order")
    paths = [Path(a) if Path(a).is_absolute() or base_dir is None else base_dir / a for a in adapters]
    extra = {k: obj[k] for k in PASS_THROUGH_FIELDS if k in obj}
    _check_pass_through(extra, where)
    return ManifestRecord(rid, question, answers, passages, paths, line=line, source=source, extra=extra,
                          retrieval=retrieval_fields(obj, len(passages), where))


def _numbers(obj: dict[str, Any], name: str, n: int, where: str) -> list[float] | None:
    if name not in obj:
        return None
    v = obj[name]
    if not isinstance(v, list) or len(v) != n or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
        raise _fail(where, name, f"a list of {n} finite numbers (one per passage, same order)", v)
    return [float(x) for x in v]


def retrieval_fields(obj: dict[str, Any], n: int, where: str) -> dict[str, list[float]]:
    """The side features a manifest line gives or implies, for its label record: ``retrieval_scores`` as given
    (optional); ``retrieval_ranks`` as given, else from the scores (0 = the highest; ties keep the manifest's
    order), else the manifest's order ``0 .. N-1`` (PRAG lists its passages in retrieval order)."""
    ranks, scores = _numbers(obj, "retrieval_ranks", n, where), _numbers(obj, "retrieval_scores", n, where)
    if ranks is None and scores is not None:
        order = sorted(range(n), key=lambda i: -scores[i])  # stable: ties in manifest order
        ranks = [0.0] * n
        for r, i in enumerate(order):
            ranks[i] = float(r)
    out = {"retrieval_ranks": ranks if ranks is not None else [float(i) for i in range(n)]}
    return {**out, "retrieval_scores": scores} if scores is not None else out


def _check_pass_through(extra: dict[str, Any], where: str) -> None:
    """``group`` / ``split`` end up in the label file: reject what the trainer would, before the expensive run."""
    group = extra.get("group")
    if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
        raise _fail(where, "group", "a string or an integer", group)
    if "split" in extra:
        from fcprag_plugin.training import KNOWN_SPLITS  # the trainer's list

        if extra["split"] not in KNOWN_SPLITS:
            raise _fail(where, "split", f"one of {list(KNOWN_SPLITS)}", extra["split"])


def read_manifest(path: str | Path) -> list[ManifestRecord]:
    """Read and validate a JSON Lines manifest (blank lines allowed; the one record reader, :func:`read_records`, also
    takes a JSON array or a ``.gz`` file). Raises ``LabelFileError`` naming file/line/field.

    Duplicate ids are rejected (both lines are named): labels are keyed by id when resuming and merging.
    """
    path = Path(path)
    if not path.is_file():
        raise LabelFileError(f"{path}: manifest not found")
    records: list[ManifestRecord] = []
    seen: dict[str, int] = {}
    base = path.resolve().parent
    for lineno, obj in read_records(path, LabelFileError):
        where = f"{path}:{lineno}"
        rec = parse_record(obj, where, base, line=lineno, source=str(path))
        if rec.id in seen:
            raise LabelFileError(f"{where}: field 'id': duplicate id '{rec.id}' (first on line {seen[rec.id]})")
        seen[rec.id] = lineno
        records.append(rec)
    if not records:
        raise LabelFileError(f"{path}: the manifest has no records")
    return records


# ----------------------------------------------------------------------------- PRAG layout
def adapter_present(path: Path) -> bool:
    """A usable PEFT adapter dir: a config and a weights file (what PRAG's encode step writes)."""
    return (path / CONFIG_NAME).is_file() and any((path / n).is_file() for n in (SAFETENSORS_NAME, LEGACY_BIN_NAME))


def read_data_aug(path: str | Path) -> list[tuple[int, Any]]:
    """PRAG's augmented data file: a JSON array (PRAG writes these) or JSON Lines. Returns ``(line, record)``."""
    path = Path(path)
    if not path.is_file():
        raise LabelFileError(f"{path}: augmented data file not found")
    return read_records(path, LabelFileError)


@dataclass
class FromPragResult:
    """``records`` have every adapter present; ``missing`` lists ``(record id, passage index, adapter dir)``."""

    records: list[dict[str, Any]]
    missing: list[tuple[str, int, Path]]
    incomplete_ids: list[str]
    total: int


def from_prag(data_aug: str | Path, adapters_root: str | Path, *, id_prefix: str | None = None,
              limit: int | None = None) -> FromPragResult:
    """Build manifest records from PRAG's layout: record ``i`` (its index = PRAG's ``test_id``) of ``data_aug``
    has adapters ``{adapters_root}/data_{i}/passage_{pid}`` for ``pid < len(passages)``.

    ``limit`` keeps the first records only (PRAG's ``--sample``). Records with a missing adapter are returned in
    ``incomplete_ids`` and every missing directory in ``missing``; the caller decides to fail or to drop them.
    Ids are ``{id_prefix}{test_id}`` (default prefix: the data file's stem and a dash), so files of several
    question types (PRAG keeps one per type) do not collide.
    """
    data_aug, root = Path(data_aug), Path(adapters_root).resolve()
    if not root.is_dir():
        raise LabelFileError(f"{root}: adapters root is not a directory (expected "
                             "{root}/data_{test_id}/passage_{pid})")
    prefix = f"{data_aug.stem}-" if id_prefix is None else id_prefix
    items = read_data_aug(data_aug)[:limit]
    records, missing, incomplete = [], [], []
    for test_id, (lineno, obj) in enumerate(items):
        where = f"{data_aug}:{lineno}"
        if not isinstance(obj, dict):
            raise LabelFileError(f"{where}: expected a JSON object with 'question', 'answer', 'passages', "
                                 f"got {type(obj).__name__}")
        for name in ("question", "answer", "passages"):
            if name not in obj:
                raise LabelFileError(f"{where}: field '{name}' is missing")
        question = _nonempty(obj, "question", where)
        parse_answers(obj["answer"], where)  # validated here; the builder reads the answers again
        passages = _str_list(obj["passages"], where, "passages")
        augment = obj.get("augment")
        if isinstance(augment, list) and len(augment) != len(passages):
            raise LabelFileError(f"{where}: field 'augment' has {len(augment)} entries but 'passages' has "
                                 f"{len(passages)}; PRAG trains one adapter per augmented passage")
        rid = f"{prefix}{test_id}"
        dirs = [adapter_dir(root, test_id, pid) for pid in range(len(passages))]
        absent = [(rid, pid, d) for pid, d in enumerate(dirs) if not adapter_present(d)]
        if absent:
            missing.extend(absent)
            incomplete.append(rid)
            continue
        rec: dict[str, Any] = {"id": rid, "question": question, "answer": obj["answer"], "passages": passages,
                               "adapters": [str(d) for d in dirs], "test_id": test_id}
        source_id = next((obj[k] for k in ("id", "_id", "qid") if isinstance(obj.get(k), (str, int))), None)
        if source_id is not None:
            rec["source_id"] = str(source_id)
        if "type" in obj and isinstance(obj["type"], str):
            rec["type"] = obj["type"]
        records.append(rec)
    return FromPragResult(records, missing, incomplete, len(items))


def write_manifest(records: Iterable[dict[str, Any]], out: str | Path) -> int:
    """Write manifest records as JSON Lines (atomically: a crash leaves no half file)."""
    return write_json_lines(out, records)
