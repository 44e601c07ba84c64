"""The labels and controller stages: leave-one-out and scale labels of the training questions in each setting's
prompt (``labels{,_combine}.jsonl``, a row a question), and the learned controller trained on them
(``train/learned{,_combine}/``); or, with ``--controller``, the given controller in both settings."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_json_if_present, write_json
from fcprag_plugin.training import TrainArgs
from .. import summary
from ..options import Batching, Generation, Plan, Split
from ..run import StudyRun
from ..summary import SETTINGS, suffix
from .retrieval import Questions

logger = logging.getLogger(__name__)


def build_labels(run: StudyRun, qs: Questions, setting: str, gen: Generation, scales: Sequence[float],
                 batching: Batching) -> Path:
    """Leave-one-out and scale labels of the training questions in ``setting``'s prompt (``labels.jsonl``,
    ``labels_combine.jsonl``), at PRAG's sum times each of ``scales`` too. The Combine labels skip the greedy answers: the trainer learns from the gold
    log-lik., and answers under the long Combine prompt would cost as much as the labels themselves."""
    from ...label_builder.builder import BuildOptions, LabelBuilder, build_labels as build_label_file
    from ...label_builder.manifest import ManifestRecord

    t0 = time.perf_counter()
    name = "labels" + suffix(setting)
    path = run.out / f"{name}.jsonl"
    st = run.store(name)
    done = st.done()
    recs = [ManifestRecord(qid, q["question"], q["answers"], [p["text"] for p in q["passages"]],
                           [run.out / "adapters" / p["pid"] for p in q["passages"]], source=str(path),
                           extra={"group": qid, "retrieval_ranks": [p["rank"] for p in q["passages"]]})
            for qid, q in qs.items() if q["split"] == "train"]
    run.kept(name, len(recs), sum(r.id in done for r in recs), "training questions")
    mine = run.mine([r for r in recs if r.id not in done])
    run.barrier()
    if mine:
        run.load_model()
        build = BuildOptions(prompt_mode=setting, generate=gen.generate and setting == "param",
                             max_new_tokens=gen.max_new_tokens, scoring="prag", empty_generation="zero",
                             batch_size=run.batch_size(batching.batch_size), metric="answer_logprob",
                             scales=(1.0, *sorted(scales)), model_name=run.lm.model)
        builder = LabelBuilder(run.model, run.tok, build)
        try:
            build_label_file(mine, builder, st.target, progress=run.progress, desc=name, position=run.shard.rank)
        finally:
            builder.close()
    run.barrier(name)
    run.timed(name, t0, records=len(mine), device=run.device())
    return path


def for_labels(train: TrainArgs, n_labels: int) -> TrainArgs:
    """The trainer's arguments ``train`` for ``n_labels`` label records: at most a fold per record, and no
    cross-validation below 4."""
    return replace(train, cv_folds=min(train.cv_folds, n_labels) if n_labels >= 4 else 0)


def trainer_kwargs(train: TrainArgs) -> dict[str, Any]:
    """What the study passes to ``train_controller`` (and records in ``train/done.json``): the study's own
    arguments, then every other one that is not the trainer's default."""
    own = ("kappa", "objective", "keep_network", "seed", "cv_folds")
    default = TrainArgs()
    return {**{k: getattr(train, k) for k in own},
            **{f.name: getattr(train, f.name) for f in fields(train)
               if f.name not in own and getattr(train, f.name) != getattr(default, f.name)}}


def warn_if_too_few(run: StudyRun, qs: Questions, train: TrainArgs, split: Split, given: bool) -> None:
    """Before any work: say so when too few training questions leave the risk rule no scale to allow (``given``:
    ``--controller``, nothing is trained)."""
    if given or run.shard.rank:
        return
    n_train = sum(q["split"] == "train" for q in qs.values())
    args = asdict(for_labels(train, n_train))
    need = summary.rule_starved(args, n_train)
    if need:
        share, tf = args["scale_max_loss_share"], split.test_fraction
        more = f"at least {need} ids in --train-ids" if split.train_ids else \
            f"about {math.ceil(need / (1 - tf))} questions at --test-fraction {tf:g}, or a smaller fraction"
        logger.warning("%d training questions: too few for the risk rule to allow any scale (the 95%% upper bound "
                       "of a %g loss share stays above it even at zero losses below about %d), so this study "
                       "will keep PRAG's sum whatever its held-out rows show; for a scale, give it more (%s)",
                       n_train, share, need, more)


def train(run: StudyRun, labels: Path, setting: str, args: TrainArgs, encoder: Any) -> Path:
    """The learned controller of ``setting`` (``train/learned{,_combine}/``): nested CV choosing epochs and kappa
    (on measured scales), the network always kept so that the evaluation can measure its reweighting (``args``:
    :func:`.options.study_training`'s); ``encoder``: ``--encoder``. Trained once, on rank 0;
    ``train/done{,_combine}.json`` marks it done."""
    from fcprag_plugin.training import train_controller

    t0 = time.perf_counter()
    where = run.out / "train" / ("learned" + suffix(setting))
    marker = run.out / "train" / f"done{suffix(setting)}.json"
    run.kept("controller" + suffix(setting), 1, int(marker.is_file()), "trained controller")
    if run.shard.rank == 0 and not marker.is_file():
        n = len(run.store(labels.stem).done())
        kwargs = trainer_kwargs(for_labels(args, n))
        train_controller(labels, where, encoder=encoder, overwrite=True, progress=run.progress, **kwargs)
        write_json(marker, {"labels": n, "args": kwargs})
    run.barrier()
    run.timed("controller" + suffix(setting), t0)
    return where


def controllers(run: StudyRun, qs: Questions, plan: Plan, gen: Generation, batching: Batching, args: TrainArgs
                ) -> tuple[dict[str, Any], dict[str, Path]]:
    """Each setting's controller and its folder: trained (``args``) on that setting's labels, or the given one
    (``plan.controller``) in both."""
    from fcprag_plugin import FusionController

    dirs = {s: Path(plan.controller) for s in SETTINGS} if plan.controller else \
        {s: train(run, build_labels(run, qs, s, gen, plan.scales, batching), s, args, plan.encoder) for s in SETTINGS}
    ctrls = {s: FusionController.from_pretrained(d).eval() for s, d in dirs.items()}
    if not plan.controller:  # its first-order training verdict is not news: the study measures it held out
        for c in ctrls.values():
            c.warn_if_unproven(quiet=True)
    return ctrls, dirs


def trainer_args(learned_dir: Path, given: bool) -> dict[str, Any] | None:
    """The arguments the trainer recorded for a controller it trained here (the risk rule it applied); None for a
    ``given`` controller."""
    from fcprag_plugin.training import ARGS_NAME

    path = Path(learned_dir) / ARGS_NAME
    return None if given else read_json_if_present(path, FcpragError)
