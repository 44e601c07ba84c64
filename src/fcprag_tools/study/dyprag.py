"""What the DyPRAG part of a study folder holds, and the report's ``dyprag`` record read from it (no model).

- ``OUT/translator/translator.json`` (:data:`RECORD`): the translator the DyPRAG rows used: ``source`` (``trained``
  here, or ``given`` with ``--dyprag-translator``), the ``file`` it came from, the ``sha256`` of its export (a DyPRAG
  row is valid only for that translator: its ``translator`` field), the ``export`` (relative to ``OUT``), the
  ``dyprag_flags`` of DyPRAG's ``inference_dyprag.py`` that load it, its ``shape``, and for a trained one its
  ``options`` and ``training`` (seconds, passages, steps, losses);
- ``OUT/translator/train/``: :func:`fcprag_tools.translator.train_translator`'s folder (resumable);
- the export, in DyPRAG's layout: ``OUT/translator/projector/<projector_path>/epoch_<E-1>.pt`` (:func:`export_path`);
  copy ``OUT/translator/projector/<projector_path>`` into DyPRAG's ``projector/`` and run ``inference_dyprag.py
  --projector_path <projector_path> --inference_epoch <E> --projector_p <width>``;
- ``OUT/dyprag_generated.jsonl`` (:data:`GENERATED`): per passage (``id``) the seconds of its generated update
  (embedding forward and translator, its share of the batch), its tokens and the ``sha256`` of the translator that
  generated it, appended once per translator; the report reads only the lines of the study's current translator
  (another translator's timings never mix in; a line without ``sha256`` is not read);
- ``OUT/dyprag_cosine.jsonl`` (:data:`COSINE`): per held-out question (``id``) the mean pairwise cosine of the
  passages' generated updates (``dyprag``) and of their PRAG adapters (``prag``), with the translator's ``sha256``.
"""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_json_if_present
from .ceiling import ROW as GOLD

TRANSLATOR_DIR, RECORD, TRAIN_DIR = "translator", "translator.json", "train"
GENERATED, COSINE = "dyprag_generated", "dyprag_cosine"
# the rows of both prompts: DyPRAG's rule (u = 1/N) and the fusion with what ships in each setting (u = w~/N)
OWN = ("dyprag", "dyprag_combine")
FUSION = ("dyprag_recommended", "dyprag_recommended_combine")
CANDIDATES = OWN + FUSION  # scored on the training questions too, as candidates of "what to run"


def is_dyprag(name: str) -> bool:
    """Row ``name`` is scored through the translator's generated updates (its record names the translator)."""
    return name == "dyprag" or name.startswith("dyprag_")


def gold_name(name: str) -> str:
    """The DyPRAG twin of a gold-passage ceiling row (``gold_passages`` -> ``dyprag_gold_passages``)."""
    return f"dyprag_{name}"


def projector_path(width: int) -> str:
    """The export's folder name, DyPRAG's ``--projector_path``."""
    return f"fcprag_hidden{width}"


def export_path(out: Path, width: int, epochs: int) -> Path:
    """Where the translator the study uses is exported, as DyPRAG's ``inference_dyprag.py`` looks for it
    (``projector/<projector_path>/epoch_<inference_epoch - 1>.pt``)."""
    return Path(out) / TRANSLATOR_DIR / "projector" / projector_path(width) / f"epoch_{epochs - 1}.pt"


def dyprag_flags(width: int, epochs: int, rank: int, alpha: float) -> dict[str, Any]:
    """The flags of DyPRAG's ``inference_dyprag.py`` that load the export (``--lora_alpha``: PRAG's recipe's; DyPRAG
    reads it for its output folder's name and the LoRA config it wraps the model in)."""
    return {"projector_path": projector_path(width), "inference_epoch": epochs, "projector_p": width,
            "lora_rank": rank, "lora_alpha": alpha}


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def recorded(out: Path) -> dict[str, Any] | None:
    """``OUT/translator/translator.json``, or None."""
    return read_json_if_present(Path(out) / TRANSLATOR_DIR / RECORD, FcpragError)


def training_options(options: Any) -> dict[str, Any]:
    """What a trained translator's record compares: its epochs, learning rate and width."""
    return {"epochs": options.epochs, "learning_rate": options.learning_rate, "width": options.width}


def expected_identity(out: Path, part: Any, given_controller: bool) -> str | None:
    """The ``sha256`` every DyPRAG row of the study in ``out`` must carry under the options ``part``
    (:class:`.options.TranslatorPart`): a given file's own; a trained translator's as recorded (``""`` while none is
    recorded for these options: every DyPRAG row is missing). None: no DyPRAG rows (``--no-dyprag``, or
    ``--controller`` without ``--dyprag-translator``: no training questions to train one on)."""
    if not part.dyprag or (given_controller and part.dyprag_translator is None):
        return None
    if part.dyprag_translator is not None:
        return sha256_of(part.dyprag_translator)
    rec = recorded(out)
    same = rec is not None and rec.get("source") == "trained" and \
        rec.get("options") == training_options(part.training())
    return rec["sha256"] if same else ""


def wanted_rows(q: dict[str, Any], settings: Sequence[str]) -> list[str]:
    """The DyPRAG rows a question of the study has in the end (held out: also the gold-passage ceiling's twins when
    it has supporting titles)."""
    if q.get("split") != "test":
        return list(CANDIDATES)
    gold = [gold_name(GOLD + ("" if s == "param" else f"_{s}")) for s in settings] if q.get("supporting_titles") \
        else []
    return [*CANDIDATES, *gold]


# ----------------------------------------------------------------------------- the report's record
def _lines(path: Path) -> list[dict[str, Any]]:
    """Every line of the study's store ``path`` (``name.jsonl``; an interrupted last line ignored), or of its
    gzipped copy ``name.jsonl.gz`` (a committed study's), in file order; empty when neither is there."""
    from fcprag_plugin.fileio import read_records

    from ..lm.store import read_label_lines

    if path.is_file():
        return [sl.record for sl in read_label_lines(path, partial="ignore")]
    gz = path.with_name(path.name + ".gz")
    rows = read_records(gz, FcpragError) if gz.is_file() else []
    return [r for _, r in rows if isinstance(r, dict) and isinstance(r.get("id"), str)]


def _rows(path: Path, sha256: str | None = None) -> dict[str, dict[str, Any]]:
    """``{id: row}`` of :func:`_lines` (the last line of an id wins); given ``sha256``, only the lines that carry
    that translator's ``sha256``."""
    return {r["id"]: r for r in _lines(path) if sha256 is None or r.get("sha256") == sha256}


def spread(xs: Sequence[float]) -> dict[str, Any]:
    """``n``, ``mean``, ``median`` and the quartiles ``q1`` / ``q3`` of ``xs`` (None when empty)."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        return {"n": 0, "mean": None, "median": None, "q1": None, "q3": None}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"n": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs), "q1": q1, "q3": q3}


def _augment_seconds(out: Path) -> float | None:
    """PRAG's augmentation seconds per passage from ``timings.jsonl`` (the stage's seconds over the passages it
    augmented, summed over the invocations; rank 0's count under a launcher)."""
    lines = [r for r in _timings(out) if r.get("stage") == "augment" and r.get("passages")]
    n = sum(int(r["passages"]) for r in lines)
    return sum(float(r["seconds"]) for r in lines) / n if n else None


def _timings(out: Path) -> list[dict[str, Any]]:
    from fcprag_plugin.fileio import read_records

    path = Path(out) / "timings.jsonl"
    return [r for _, r in read_records(path, FcpragError)] if path.is_file() else []


def dyprag_record(out: str | Path) -> dict[str, Any] | None:
    """The report's ``dyprag`` record of the study in ``out``, from its files alone (None: no translator there).

    ``translator``: :data:`RECORD`'s content (source, file, sha256, export, DyPRAG's flags, options, training
    seconds, passages trained on, first / last loss). ``cost``: :func:`fcprag_tools.translator.cost_summary` over
    the held-out questions' passages: the translator's training seconds (0 for a given one), the median seconds a
    passage's generated update took (embedding forward + translator; the :data:`GENERATED` lines of this
    translator's ``sha256`` only) against the median seconds of its PRAG adapter (``adapters.jsonl``: the adapter's
    training alone, its share of the stacked group; PRAG's augmentation of the passage, which DyPRAG skips at
    inference too, is ``augment_seconds_per_passage`` beside it, from ``timings.jsonl``). ``diversity``: per
    held-out question the mean pairwise cosine of the passages' updates, DyPRAG's generated ones (``dyprag``) and
    PRAG's adapters (``prag``), as :func:`spread` over the questions scored with this translator."""
    from ..translator import cost_summary, prag_adapter_seconds

    out = Path(out)
    rec = recorded(out)
    if rec is None:
        return None
    qs = _rows(out / "questions.jsonl")
    test = [q for q, r in qs.items() if r.get("split") == "test"]
    held = {p["pid"] for q in test for p in qs[q]["passages"]}
    gen = {p: float(r["seconds"]) for p, r in _rows(out / f"{GENERATED}.jsonl", rec["sha256"]).items()
           if p in held}
    prag = {p: s for p, s in prag_adapter_seconds(_rows(out / "adapters.jsonl").values()).items() if p in held}
    train = rec.get("training") or {}
    cost = {**cost_summary(float(train.get("seconds") or 0.0), gen, prag),
            "prag_seconds_include": "the adapter's training (its share of the stacked group), not the augmentation",
            "augment_seconds_per_passage": _augment_seconds(out)}
    cos = [r for q, r in _rows(out / f"{COSINE}.jsonl").items() if q in set(test) and r.get("sha256") == rec["sha256"]]
    diversity = {k: spread([r[k] for r in cos if r.get(k) is not None]) for k in ("dyprag", "prag")}
    return {"translator": rec, "cost": cost, "diversity": diversity, "questions": len(cos)}
