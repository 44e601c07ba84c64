"""``fcprag train LABELS --out DIR ...`` and ``fcprag eval CONTROLLER LABELS ...``."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
from dataclasses import fields
from pathlib import Path

from .options import (ENCODER, Runtime, add_flag, add_flags, check_out_file, finite_float, int_at_least,
                      keywords_to_flags, positive_int, refuse_inputs)
from fcprag_plugin.errors import BARE, FcpragError, LabelFileError
from fcprag_plugin.features import SIDE_FEATURES
from fcprag_plugin.fileio import write_json
from fcprag_plugin.training import (ARGS_NAME, CHOICES, DEFAULT_T_LABEL, MAX_EPOCHS, MAX_HIDDEN, ON_ERROR, RECIPES,
                                    REMOVED, SkippedRecord, TrainArgs, load_labels)
from .lm.model_io import set_threads
from .plots import _pyplot, write_eval_plots, write_training_plots
from .train_report import closing_lines, format_table, train_table


# A label record is one line of a JSON Lines file: a longer line is refused before it is parsed (parsing a huge
# line costs minutes and gigabytes). Real records (a query, N passages, N numbers) are KBs.
MAX_LINE_BYTES = 16 * 2**20
# |delta| / t_label above this overflows float32 in softmax(delta / T) or in max - min of a record.
MAX_SCALED_DELTA = 1e37
# fcprag train has one flag per TrainArgs field (--name-with-dashes; a bool one a switch to the other value) but these,
# which only Python sets (controller: --score-hidden and --calib-hidden); the fields a --recipe sets are None when not
# given (the recipe decides)
_NOT_FLAGS = ("grad_clip", "eval_batch_size", "controller")
_TRAIN_ARGS = tuple(f.name for f in fields(TrainArgs) if f.name not in _NOT_FLAGS)
_RECIPE_SET = frozenset().union(*RECIPES.values())
# --resume of earlier versions (per-epoch checkpoints), refused in one line
RESUME_GONE = ("--resume is gone: training restarts from the start (it takes seconds to minutes); pass --overwrite to "
               "train again into a folder that holds a run")


def _switch(name: str) -> tuple[str, str]:
    """``(keyword, flag)`` of a TrainArgs field: ``name`` / ``--name``; a bool: ``name=True`` / ``--name`` when it
    is False by default, else ``name=False`` / ``--no-name``."""
    default, flag = getattr(TrainArgs(), name), name.replace("_", "-")
    if isinstance(default, bool):
        return f"{name}={not default}", f"--{'no-' if default else ''}{flag}"
    return name, f"--{flag}"


# train_controller()'s / evaluate_controller()'s keyword arguments -> the commands' flags, for the library's
# messages (options.keywords_to_flags): "pass overwrite=True" reads "pass --overwrite" on the command line
TRAIN_FLAGS = {"overwrite=True": "--overwrite", "progress=False": "--no-progress",
               "out": "--out", "encoder": "--encoder", "score_hidden": "--score-hidden",
               "calib_hidden": "--calib-hidden", **dict(map(_switch, _TRAIN_ARGS)),
               **{name: f"--{name.replace('_', '-')}" for name in REMOVED}}
EVAL_FLAGS = {
    "encoder": "--encoder",
    "cache_dir": "--cache-dir",
    "on_error": "--on-error",
    "t_label": "--t-label",
    "flat_eps": "--flat-eps",
    "flat_weight": "--flat-weight",
    "seed": "--seed",
    "progress=False": "--no-progress",
}


def hidden_sizes(text: str) -> list[int]:
    """argparse type for ``--score-hidden``: comma-separated integers from 1 to ``MAX_HIDDEN``, e.g. ``2048,1024``."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected comma-separated integers >= 1, e.g. 2048,1024") from None
    if not sizes or min(sizes) < 1 or max(sizes) > MAX_HIDDEN:
        raise argparse.ArgumentTypeError(f"'{text}': every hidden size must be an integer from 1 to {MAX_HIDDEN}, "
                                         "e.g. 2048,1024")
    return sizes


def kappa_value(text: str) -> float | str:
    """argparse type for ``--kappa``: a finite number > 0, or ``auto``."""
    if text == "auto":
        return text
    try:
        v = finite_float(text)
    except argparse.ArgumentTypeError:
        v = 0.0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"'{text}': expected a number > 0 or 'auto'")
    return v


def check_line_lengths(path: str, limit: int = MAX_LINE_BYTES) -> None:
    """Raise :class:`LabelFileError` naming the file and the line when a line is longer than ``limit`` bytes,
    reading at most ``limit + 1`` bytes of a line (never a huge line whole). A missing file is left to the reader."""
    p = Path(path)
    if not p.is_file():
        return
    with p.open("rb") as f:
        for line, text in enumerate(iter(lambda: f.readline(limit + 1), b""), 1):
            if len(text.removesuffix(b"\n")) > limit:
                raise LabelFileError(f"{p}:{line}: line is longer than {limit // 2**20} MiB; expected one record "
                                     "per line (JSON Lines) of at most that size")


def check_delta_range(label_set, t_label: float, on_error: str) -> None:
    """Refuse (or with ``on_error='skip'``, skip) records whose deltas overflow float32 once divided by
    ``t_label``: they would pass the finiteness check and turn every loss into NaN."""
    bound = MAX_SCALED_DELTA * t_label
    keep = []
    for rec in label_set.records:
        bad = next((i for i, d in enumerate(rec.deltas) if not abs(d) <= bound), None)
        if bad is None:
            keep.append(rec)
            continue
        msg = (f"{rec.file}:{rec.line}: field 'deltas[{bad}]': is {rec.deltas[bad]:g}, expected |delta| <= "
               f"{bound:.3g} (float32 range at --t-label {t_label:g})")
        if on_error == "fail":
            raise LabelFileError(msg)
        label_set.skipped.append(SkippedRecord(rec.file, rec.line, f"deltas[{bad}]", msg))
    if len(keep) != len(label_set.records):
        label_set.records[:] = keep
        label_set.skipped.sort(key=lambda k: k.line)
        if not keep:
            raise LabelFileError(f"{label_set.path}: no valid records ({len(label_set.skipped)} skipped)")


def read_label_file(path: str, on_error: str, t_label: float):
    """The CLI's label reader: bounded line length, the library's validation, deltas in float32 range."""
    check_line_lengths(path)
    log = logging.getLogger("fcprag_plugin.labels")
    level = log.level
    log.setLevel(logging.ERROR)  # the reader logs skipped records; _print_skipped prints them (once)
    try:
        ls = load_labels(path, on_error)
    finally:
        log.setLevel(level)
    check_delta_range(ls, t_label, on_error)
    return ls


def _print_skipped(ls) -> None:
    if ls.skipped:
        print(f"skipped {len(ls.skipped)} record(s) of {ls.path}: "
              + ", ".join(f"{k}: {v}" for k, v in sorted(ls.skip_counts().items())))
        for s in ls.skipped[:10]:
            print(f"  {s.message}")
        if len(ls.skipped) > 10:
            print(f"  ... and {len(ls.skipped) - 10} more (all listed in metrics.json)")


def check_train_out(out: Path, overwrite: bool) -> None:
    """Refuse, before any work: a run directory that is a file; a non-empty directory unless ``overwrite`` (a
    controller or anything else the user has would be overwritten; a run there trains again from its start)."""
    if out.exists() and not out.is_dir():
        raise FcpragError(f"--out {out} is an existing file; expected a directory for the run")
    if not out.is_dir() or not any(out.iterdir()) or overwrite:
        return
    if not (out / ARGS_NAME).exists():
        raise FcpragError(f"--out {out} is a non-empty directory and it holds no training run ({ARGS_NAME}); "
                          "choose a new directory or pass --overwrite to write the run into it")
    raise FcpragError(f"--out {out} already holds a training run ({ARGS_NAME}); pass --overwrite to train again from "
                      "the start")


def _tree(path: Path) -> set[str] | None:
    """Relative paths of everything under ``path``; None when it does not exist."""
    if not path.is_dir():
        return None
    found: set[str] = set()
    for root, dirs, files in os.walk(path):
        rel = Path(root).relative_to(path)
        found.update(str(rel / n) for n in dirs + files)
    return found


def _remove_new(path: Path, before: set[str] | None) -> None:
    """Remove what is under ``path`` and not in ``before`` (:func:`_tree` of an earlier moment): exactly what was
    created since, whatever the trainer names its files. ``before`` None: ``path`` itself was created since."""
    if before is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    for root, dirs, files in os.walk(path):
        rel = Path(root).relative_to(path)
        for n in files:
            if str(rel / n) not in before:
                (Path(root) / n).unlink(missing_ok=True)
        for n in list(dirs):
            if str(rel / n) not in before:
                dirs.remove(n)  # not walked into: removed whole
                p = Path(root) / n
                if p.is_symlink():
                    p.unlink()
                else:
                    shutil.rmtree(p, ignore_errors=True)


def _after_interrupt(args: argparse.Namespace, out: Path, before: set[str] | None) -> str:
    """What an interrupted ``fcprag train`` leaves, said honestly: everything this run created under ``--out`` is
    removed (a run restarts from its start), so that the same command runs again unrefused."""
    _remove_new(out, before)
    kept = ("nothing was kept" if not before else
            f"what this run had written into {out} was removed (the rest was there before)")
    return f"interrupted (training restarts from the start); {kept}: run the same command again: " + shlex.join(
        ["fcprag", *args.argv])


def _cmd_train(args: argparse.Namespace) -> int:
    from fcprag_plugin.training.trainer import train_controller  # looked up per call (tests replace it)

    refuse_inputs("--out", args.out, [("labels", args.labels)])
    out = Path(args.out)
    check_train_out(out, args.overwrite)
    if args.plots:
        _pyplot()  # a missing matplotlib stops the run before training, not after
    before = _tree(out)
    args.interrupt_hint = lambda: _after_interrupt(args, out, before)
    train_set = read_label_file(args.labels, args.on_error, args.t_label)
    _print_skipped(train_set)
    controller = {k: getattr(args, k) for k in ("score_hidden", "calib_hidden") if getattr(args, k)}
    set_threads(args.threads)  # --threads (the trainer sets it again for its run), else the free cores
    res = train_controller(train_set, args.out, encoder=args.encoder, overwrite=args.overwrite, progress=args.progress, controller=controller,
                           **{k: getattr(args, k) for k in _TRAIN_ARGS
                              if not (k in _RECIPE_SET and getattr(args, k) is None)})
    if args.plots:
        write_training_plots(res.out / "plots", res.history, res.outputs, res.report_data)
    print(train_table(res.metrics))
    t = res.metrics["timing_s"]
    print(f"\n{res.n_train} training records, {res.metrics['epochs']} epochs, fit {t['fit']:.1f} s")
    print("\n".join(closing_lines(res, args, train_set)))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import evaluate_controller  # looked up per call (tests replace it)

    inputs = [("controller", args.controller), ("labels", args.labels)]
    if args.json:
        check_out_file("--json", args.json, inputs)
    if args.plots:
        _pyplot()  # a missing matplotlib stops here, not after the evaluation
        refuse_inputs("--plots", args.plots, [("labels", args.labels)])
        if Path(args.plots).exists() and not Path(args.plots).is_dir():
            raise FcpragError(f"--plots {args.plots} is an existing file; expected a directory for the PNGs")
    if args.encoder:
        _check_eval_encoder(args.controller, args.encoder)
    labels = read_label_file(args.labels, args.on_error, args.t_label or DEFAULT_T_LABEL)
    res = evaluate_controller(
        args.controller, labels, encoder=args.encoder, cache_dir=args.cache_dir, on_error=args.on_error,
        t_label=args.t_label, flat_eps=args.flat_eps, flat_weight=args.flat_weight, seed=args.seed,
        progress=args.progress)
    _print_skipped(res.label_set)
    print(format_table(res.metrics, f"{args.controller} on {args.labels}"))
    if args.json:
        write_json(args.json, {"controller": str(args.controller), "labels": str(args.labels),
                               "metrics": res.metrics, "skipped": len(res.label_set.skipped)})
        print(f"wrote {args.json}")
    if args.plots:
        for p in write_eval_plots(args.plots, res.outputs, res.data):
            print(f"wrote {p}")
    return 0


def _check_eval_encoder(controller: str, encoder: str) -> None:
    """``--encoder`` of ``fcprag eval`` is the controller's own embedding model (or the same folder under another
    name), as everywhere a controller is used; checked before any text is embedded."""
    from types import SimpleNamespace

    from fcprag_plugin.controller import FusionController
    from fcprag_plugin.encoding import check_recorded_model, resolve_model

    recorded = FusionController.from_pretrained(controller).config.embedding_model
    name, path = resolve_model(encoder)
    if not check_recorded_model(recorded, SimpleNamespace(name=name, source=path if os.path.exists(path) else None)):
        raise FcpragError(f"--encoder {encoder} is not the embedding model the controller was trained with "
                          f"('{recorded}'); leave --encoder out to use it")


class _Removed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.dest == "resume":
            parser.error(RESUME_GONE)
        parser.error(keywords_to_flags(FcpragError(REMOVED[self.dest], params=[(self.dest, BARE), ("cv_folds", BARE)]),
                                       TRAIN_FLAGS))


def _label_options(p: argparse.ArgumentParser) -> None:
    """The options ``fcprag train`` and ``fcprag eval`` share."""
    p.add_argument("labels", help="label file (JSON Lines or JSON array)")
    add_flag(p, "encoder", ENCODER)
    p.add_argument("--cache-dir", help="embedding cache directory (default: $FCPRAG_CACHE_DIR or "
                                       "~/.cache/fcprag/embeddings)")
    p.add_argument("--on-error", choices=ON_ERROR, default="fail",
                   help="fail at the first bad record (default) or skip bad records and report them")
    add_flags(p, Runtime, names=("progress",))


def _train_options(d: TrainArgs) -> dict[str, dict]:
    """The exceptions to the flags ``register`` derives from TrainArgs' fields (type from the default, finite for a
    float): each field's help text, and the types, choices and metavars that differ."""
    return {
        "epochs": dict(type=int_at_least(1, MAX_EPOCHS), help=f"total epochs (default {d.epochs}, at most "
                       f"{MAX_EPOCHS})"),
        "batch_size": dict(type=positive_int, help=f"records per optimizer step (default {d.batch_size})"),
        "lr": dict(help=f"AdamW learning rate (default {d.lr:g})"),
        "weight_decay": dict(help=f"AdamW weight decay (default {d.weight_decay:g})"),
        "seed": dict(help=f"seed of the folds, init and shuffling ({d.seed})"),
        "t_label": dict(help="temperature of the targets y = softmax(delta / T)"),
        "flat_eps": dict(help="a sample is flat when max(delta) - min(delta) <= this"),
        "flat_weight": dict(help="sample weight of flat samples (informative samples weigh 1)"),
        "precision": dict(help="auto (default): bf16 on CPUs with native bfloat16 "
                          "(AVX512-BF16/AMX), else fp32; bf16: the controller's MLPs in bfloat16 with fp32 master "
                          "weights"),
        "objective": dict(help="kl (default, the paper's): KL to softmax(delta / T_label); "
                          "risk: maximise sum_i (w~_i - 1) delta_i - lambda sum_i (w~_i - 1)^2 per record "
                          "(docs/label-format.md)"),
        "risk_lambda": dict(type=finite_float, metavar="X", help="lambda of the risk objective (default: the "
                            "pooled within-record std of the deltas)"),
        "cv_folds": dict(type=int_at_least(0), metavar="K", help="nested grouped k-fold cross-validation: chooses "
                         "the epoch count (up to --epochs; 0 = stay uniform) and kappa without seeing the questions "
                         "it scores, and states the gain over PRAG's sum split into a scale part and a reweighting "
                         f"part, each with a 95%% CI (default {d.cv_folds}; 0: off, train exactly --epochs)"),
        "kappa": dict(type=kappa_value, metavar="X|auto", help="global scale of the merge weights, w~ * kappa "
                      "(default: auto; --recipe paper: 1); 'auto': chosen on the labels' measured scales ('fcprag "
                      "labels build --scales') by the rule of --scale-max-loss-share / --scale-loss-margin / "
                      "--scale-bound; labels without scale measurements keep 1 (PRAG's sum)"),
        "side_features": dict(nargs="+", metavar="NAME", choices=SIDE_FEATURES, type=str, help="opt-in "
                              "per-passage inputs read from the label records: " + ", ".join(SIDE_FEATURES)
                              + " (retrieval_score only with --allow-retrieval-score: PRAG and DyPRAG keep none)"),
        "scale_max_loss_share": dict(metavar="X", help="--kappa auto: the largest mean gain among the scales whose "
                                     "share of questions losing more than --scale-loss-margin stays at most this "
                                     f"(default {d.scale_max_loss_share})"),
        "scale_loss_margin": dict(metavar="M", help="the loss that counts against a scale, in the label metric's "
                                  f"units (default {d.scale_loss_margin})"),
        "scale_bound": dict(help="upper (default): the loss share's 95%% Wilson upper bound must "
                            "stay under the allowed share, so the rule holds on new questions; observed: the share "
                            "on the training questions itself"),
        "keep_network": dict(help="save the learned network (default: not; its reweighting part is a first-order "
                             "estimate from leave-one-out deltas at PRAG's sum, not a measurement: measure it with "
                             "'fcprag study ... --controller DIR'); --recipe paper sets it"),
        "recipe": dict(help="measured (default): what the measurements support "
                       "(docs/results/efficacy-fresh.md): kappa chosen on the labels' measured scales by the risk "
                       "rule, a scale-only controller, the network only with --keep-network; paper: the paper's setting, the learned network shipped "
                       "at PRAG's total (kappa 1, KL objective). Options given explicitly override the recipe"),
        "allow_retrieval_score": dict(help="allow --side-features retrieval_score (for a host that supplies "
                                      "retrieval scores)"),
    }


def register(sub: argparse._SubParsersAction) -> None:
    d = TrainArgs()
    t = sub.add_parser("train", help="train a fusion controller from a leave-one-out label file",
                       description="Train a FusionController on LABELS (JSON Lines or a JSON array; see "
                                   "docs/label-format.md) and write it to --out.")
    _label_options(t)
    add_flags(t, Runtime, names=("threads",))  # set by the command (model_io.set_threads), then by the trainer
    t.add_argument("--out", required=True, help="output directory (controller + training_args/metrics/log)")
    for name in REMOVED:  # refused in one line saying what replaced them
        t.add_argument(TRAIN_FLAGS[name], help=argparse.SUPPRESS, action=_Removed)
    for name in _TRAIN_ARGS:
        if name in ("on_error", "cache_dir", "threads"):  # _label_options (fcprag eval has them too); Runtime's
            continue
        default = getattr(d, name)
        options = {"help": f"TrainArgs.{name} (default {default!r})", **({"choices": CHOICES[name]} if name in CHOICES
                                                                          else {}), **_train_options(d).get(name, {})}
        if isinstance(default, bool):
            options["action"] = "store_false" if default else "store_true"
        else:
            options.setdefault("type", finite_float if isinstance(default, float) else type(default))
        t.add_argument(_switch(name)[1], dest=name, default=None if name in _RECIPE_SET else default, **options)
    t.add_argument("--score-hidden", type=hidden_sizes, metavar="N[,N...]",
                   help="score net hidden sizes, e.g. 2048,1024 (default)")
    t.add_argument("--calib-hidden", type=int_at_least(1, MAX_HIDDEN), metavar="N",
                   help="calibration net hidden size (default 256)")
    t.add_argument("--resume", nargs=0, help=argparse.SUPPRESS, action=_Removed)
    t.add_argument("--overwrite", action="store_true", help="start over in a directory that holds a run")
    t.add_argument("--plots", action="store_true", help="write DIR/plots/*.png (needs matplotlib)")
    t.set_defaults(func=_cmd_train, flag_names=TRAIN_FLAGS)

    e = sub.add_parser("eval", help="metrics of a controller on a label file, next to uniform and random baselines",
                       description="Metrics of a saved controller on LABELS (KL to the targets, top-1 agreement, "
                                   "Spearman, g/tau, weight entropy), next to the uniform (PRAG's merge) and random "
                                   "baselines on the same records. --plots writes g_tau.png and entropy.png.")
    e.add_argument("controller", help="controller directory")
    _label_options(e)
    e.add_argument("--t-label", type=finite_float,
                   help="target temperature (default: the controller's training_args.json, else the library's)")
    e.add_argument("--flat-eps", type=finite_float,
                   help="flat-sample threshold (default: from training_args.json, else the library's)")
    e.add_argument("--flat-weight", type=finite_float,
                   help="weight of flat samples (default: from training_args.json, else the library's)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random-controller baseline")
    e.add_argument("--plots", help="write g_tau.png and entropy.png into this directory")
    e.add_argument("--json", help="write the metrics to this JSON file")
    e.set_defaults(func=_cmd_eval, flag_names=EVAL_FLAGS)
