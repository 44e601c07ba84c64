"""The stages of ``fcprag study``, each cached under ``OUT`` and resumable (a finished unit is never redone; every
file is appended a whole line at a time with fsync, or written through a temp file and renamed):

==========  =========================================================  ==========================================
stage       what                                                        cache (unit)
==========  =========================================================  ==========================================
retrieval   split (seeded, or ``train_ids``), BM25 top-k / a file      ``questions.jsonl`` (question)
augment     PRAG's augmentation by the model (:mod:`.augment`)          ``augment.jsonl`` (passage)
adapters    PRAG-recipe passage adapters, stacked (:mod:`.adapters`)    ``adapters/<pid>/``, ``adapters.jsonl``
translator  DyPRAG's translator, training passages (:mod:`.dyprag`)    ``translator/`` (the run; resumable)
labels      leave-one-out + scale labels, training questions            ``labels.jsonl`` (question; label builder)
controller  ``fcprag_plugin.training.train_controller`` (nested CV)     ``train/learned/`` (the run)
evaluate    held-out rows by real forwards, mixed batches               ``eval.jsonl`` (question x method)
summary     ``summary.json``, ``report.md``, ``controller/``            (seconds)
==========  =========================================================  ==========================================

With ``controller`` (``--controller DIR``) the labels and controller stages are skipped and every question is
evaluated; the translator is then ``--dyprag-translator``'s (or there are no DyPRAG rows), and ``--no-dyprag``
skips it always. Under ``torchrun`` rank ``r`` of ``W`` takes every ``W``-th unit of the augment, adapters, labels and
evaluate stages (part files, merged by rank 0 after a barrier); training (the translator's too) and the summary
run on rank 0.

Each stage is a function of :mod:`.stages` (``retrieval``, ``augmentation``, ``adapter_training``, ``controllers``
for the labels and the controller, ``evaluation`` with the rows of :mod:`.stages.rows`, ``verdict`` for the
summary): it takes the :class:`.run.StudyRun` (the folder, the shard, the model loaded on first need), the parts of
:class:`.options.StudyOptions` it reads and what the stage before returned, and returns what the next one needs.
:func:`run_stages` runs them in order on the options :mod:`.preflight` checked and resolved.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_json_object, write_json
from ..lm.shard import ShardInfo, shard_from_env
from ..lm.units import log_timing
from . import preflight, summary
from .options import StudyOptions
from .run import StudyRun
from .stages.adapter_training import train_adapters
from .stages.augmentation import augment_passages
from .stages.controllers import controllers, warn_if_too_few
from .stages.evaluation import evaluate
from .stages.retrieval import retrieve_questions
from .stages.rows import dyprag_rows, held_out_rows
from .stages.translator import announce, translator_stage
from .stages.verdict import after_the_verdict, verdicts_of, write_summary
from .summary import SETTINGS

__all__ = ["StudyOptions", "StudyRun", "check_settings", "run_stages", "run_study", "study"]

logger = logging.getLogger(__name__)


def check_settings(out: Path, now: dict[str, Any], shard: ShardInfo) -> None:
    """Write ``OUT/settings.json`` (``now``) on a fresh folder; on a resumed one, refuse another value of
    :data:`.preflight.FIXED`."""
    path = out / preflight.SETTINGS
    if path.is_file():
        preflight.compare_settings(out, read_json_object(path, FcpragError, "not found"), now)
    elif shard.rank == 0:
        write_json(path, now)


def run_stages(run: StudyRun, opts: StudyOptions, sel: preflight.Selection, settings: dict[str, Any]
               ) -> dict[str, Any] | None:
    """Every stage in order on the checked options and questions ``sel``, each given the parts it reads;
    ``summary.json``'s content on rank 0."""
    plan, gen, batching = opts.plan, opts.generation, opts.batching
    given = plan.controller is not None
    announce(run, opts.dyprag, given)
    qs = retrieve_questions(run, sel, plan.top_k)
    warn_if_too_few(run, qs, opts.train, opts.split, given)
    augs = augment_passages(run, qs, gen, batching)
    train_adapters(run, qs, augs, batching)
    dyprag = translator_stage(run, qs, augs, opts.dyprag, given)
    ctrls, dirs = controllers(run, qs, plan, gen, batching, opts.train)
    want = {qid: {**held_out_rows(q, ctrls, plan.scales, plan.encoder, run.adapter),
                  **(dyprag_rows(q, list(ctrls)) if dyprag is not None else {})}
            for qid, q in qs.items() if q["split"] == "test"}
    results = evaluate(run, qs, want, gen, batching, oracle=True, arrow=plan.arrow, dyprag=dyprag)
    verdicts = verdicts_of(results, qs, ctrls, dirs, given, opts.policy)
    shipped = {s: summary.shipped_controller(verdicts[s], ctrls[s]) for s in SETTINGS}
    results = after_the_verdict(run, opts, qs, ctrls if given else shipped, verdicts, dyprag)
    if run.shard.rank != 0:
        return None
    return write_summary(run, opts, qs, results, verdicts, shipped, ctrls, dirs, settings)


def study(opts: StudyOptions, shard: ShardInfo | None = None) -> tuple[dict[str, Any] | None, bool]:
    """Run (or resume) a study: ``(summary.json's content, complete)``, the content None on ranks other than 0.
    Every check runs before the study folder exists: a mistake is one line and leaves nothing behind. ``complete``:
    the study was finished, nothing it was built from has changed and it has every row the options ask for
    (:func:`.preflight.missing_rows`); its ``summary.json`` answers (no model, no rebuild). A finished study that
    lacks rows runs its stages again: every cached unit is kept, only the missing rows are scored, and the summary
    and report are rebuilt."""
    t_all = time.perf_counter()
    shard = shard or shard_from_env()
    checked = preflight.check(opts, rank=shard.rank, local_rank=shard.local_rank, distributed=shard.distributed)
    if checked.summary is not None:
        logger.info("%s: the study is complete (summary.json is newer than every cache and the settings match); "
                    "its verdict, as recorded:", opts.out)
        return (checked.summary if shard.rank == 0 else None), True
    resolved = checked.options
    preflight.set_threads(resolved.runtime, resolved.model.device, shard)
    out = Path(resolved.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = preflight.settings_of(resolved, shard.local_rank)
    check_settings(out, settings, shard)
    run = StudyRun(out, shard, resolved.runtime.progress, resolved.model)
    res = run_stages(run, resolved, checked.selection, settings)
    if res is not None:
        log_timing(out, "total (this invocation)", time.perf_counter() - t_all)
    return res, False


def run_study(opts: StudyOptions) -> dict[str, Any] | None:
    """Run (or resume) a study (:func:`study`); returns ``summary.json``'s content (None on ranks other than 0)."""
    return study(opts)[0]
