"""The verdict and summary stages: each setting's verdict from the held-out rows, the rows that depend on what
ships, and at the end ``summary.json``, ``report.md`` and ``controller{,_combine}/`` (rank 0)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fcprag_plugin.fileio import write_json
from .. import summary
from ..options import Policy, StudyOptions
from ..run import StudyRun
from ..verdict.records import SETTINGS, ControllerRecord, ScoredRows, SettingVerdict, suffix
from .controllers import trainer_args
from .evaluation import Scored, evaluate
from .retrieval import Questions
from .rows import Rows, candidate_rows, dyprag_later_rows, random_rows


def records_of(ctrls: dict[str, Any], dirs: dict[str, Path], given: bool, out: Path | None = None
               ) -> dict[str, ControllerRecord]:
    """What the verdict reads of each setting's controller: its kappa, cross-validation and trainer arguments, and
    (with the study folder ``out``) the scale labels it was trained on."""
    return {s: ControllerRecord(float(c.config.kappa), getattr(c.config, "cv", None) or {},
                                trainer_args(dirs[s], given),
                                None if given or out is None else summary.scale_labels(out, s))
            for s, c in ctrls.items()}


def verdicts_of(results: Scored, qs: Questions, ctrls: dict[str, Any], dirs: dict[str, Path], given: bool,
                policy: Policy) -> dict[str, SettingVerdict]:
    """Each setting's verdict (``given``: ``--controller``): what ships decided on the training questions under
    ``policy``'s margins, measured on the held-out rows of ``results``."""
    return summary.verdicts(ScoredRows.from_dicts(qs, results), records_of(ctrls, dirs, given), given=given,
                            policy=policy)


def after_the_verdict(run: StudyRun, opts: StudyOptions, qs: Questions, recommended: dict[str, Any],
                      verdicts: dict[str, SettingVerdict], dyprag: Any = None) -> Scored:
    """Score the rows that depend on what ships: the random controller at the recommended kappa (held out), and
    the candidates of "what to run" on the training questions (where the choice is made); with ``dyprag`` (the
    translator stage's source) DyPRAG's fusions with what ships, and its candidates on the training questions."""
    extra: dict[str, Rows] = {}
    named = {s: {"recommended_row": v.recommended_row} for s, v in verdicts.items()}  # what candidate_rows reads
    for qid, q in qs.items():
        if q["split"] == "test":
            extra[qid] = random_rows(q, recommended, opts.plan.encoder, run.adapter)
    for qid, q in qs.items():
        if q["split"] == "train":
            extra[qid] = candidate_rows(q, recommended, named, opts.plan.encoder, run.adapter)
    for qid, q in qs.items() if dyprag is not None else ():
        extra[qid].update(dyprag_later_rows(q, recommended, opts.plan.encoder, dyprag.adapter))
    return evaluate(run, qs, extra, opts.generation, opts.batching, desc="evaluate (after the verdict)",
                    dyprag=dyprag)


def save_controller(out: Path, setting: str, shipped: Any, qs: Questions) -> None:
    """``controller/`` (``controller_combine/``): what ships in ``setting``, with the training question ids."""
    from fcprag_tools.options import write_dir_atomically

    train_ids = sorted(q for q, r in qs.items() if r["split"] == "train")

    def save(tmp: Path) -> None:
        shipped.save_pretrained(tmp)
        if train_ids:  # `fcprag study --controller` leaves these out of what it evaluates
            write_json(tmp / "train_question_ids.json", {"ids": train_ids})

    write_dir_atomically(out / ("controller" + suffix(setting)), save)


def shared_rows(results: Scored) -> dict[str, dict[str, int]]:
    """Each row scored once for another on some questions: ``{row: {the row it shares: questions}}``."""
    out: dict[str, dict[str, int]] = {}
    for rid, r in sorted(results.items()):
        if "shared_with" in r:
            by = out.setdefault(rid.split("|", 1)[1], {})
            by[r["shared_with"]] = by.get(r["shared_with"], 0) + 1
    return out


def write_summary(run: StudyRun, opts: StudyOptions, qs: Questions, results: Scored,
                  verdicts: dict[str, SettingVerdict], shipped: dict[str, Any], ctrls: dict[str, Any],
                  dirs: dict[str, Path], settings: dict[str, Any]) -> dict[str, Any]:
    """Save what ships in each setting and write ``summary.json`` and the report (:func:`.summary.finish`, which
    measures each setting's verdict again on the held-out questions with every row); returns the summary."""
    t0 = time.perf_counter()
    for s in SETTINGS:
        save_controller(run.out, s, shipped[s], qs)
    test = [qid for qid, q in qs.items() if q["split"] == "test"]
    arrow = "scored" if all(f"{q}|arrow" in results for q in test) else "--no-arrow" if not opts.plan.arrow else "off"
    given = opts.plan.controller is not None
    out = summary.finish(ScoredRows.from_dicts(qs, results), records_of(ctrls, dirs, given, run.out), given=given,
                         settings={**settings, "out": str(run.out), "device": run.device(),
                                   "controller_trained": not given, "arrow": arrow,
                                   "learned_dir": {s: str(d) for s, d in dirs.items()}},
                         stage_seconds={k: round(v, 1) for k, v in run.times.items()}, out=run.out,
                         shared=shared_rows(results), policy=opts.policy)
    run.timed("summary", t0)
    return out
