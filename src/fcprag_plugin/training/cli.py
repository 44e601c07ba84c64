"""``fcprag train LABELS --out DIR ...`` and ``fcprag eval CONTROLLER LABELS ...``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .labels import ON_ERROR
from .targets import DEFAULT_FLAT_EPS, DEFAULT_FLAT_WEIGHT, DEFAULT_T_LABEL
from .trainer import PRECISIONS, TrainArgs, add_objective_arguments, objective_kwargs


def _print_skipped(label_sets) -> None:
    for ls in label_sets:
        if ls is not None and ls.skipped:
            print(f"skipped {len(ls.skipped)} record(s) of {ls.path}: "
                  + ", ".join(f"{k}: {v}" for k, v in sorted(ls.skip_counts().items())))
            for s in ls.skipped[:10]:
                print(f"  {s.message}")
            if len(ls.skipped) > 10:
                print(f"  ... and {len(ls.skipped) - 10} more (all listed in metrics.json)")


def _cmd_train(args: argparse.Namespace) -> int:
    from .labels import load_labels
    from .trainer import train_controller

    train_set = load_labels(args.labels, args.on_error)
    val_set = load_labels(args.val, args.on_error) if args.val else None
    _print_skipped([train_set, val_set])
    controller = {}
    if args.score_hidden:
        controller["score_hidden"] = [int(x) for x in args.score_hidden.split(",")]
    if args.calib_hidden:
        controller["calib_hidden"] = args.calib_hidden
    res = train_controller(train_set, args.out, val=val_set, encoder=args.encoder, resume=args.resume,
                           overwrite=args.overwrite, progress=not args.no_progress, epochs=args.epochs,
                           batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                           t_label=args.t_label, flat_eps=args.flat_eps, flat_weight=args.flat_weight,
                           val_fraction=args.val_fraction, on_error=args.on_error, precision=args.precision,
                           cache_dir=args.cache_dir, threads=args.threads, plots=args.plots, controller=controller,
                           **objective_kwargs(args))
    print(res.table)
    t = res.metrics["timing_s"]
    print(f"\n{res.n_train} training / {res.n_val} validation records, {res.metrics['epochs']} epochs, "
          f"fit {t['fit']:.1f} s; wrote {res.out} (controller, training_args.json, metrics.json, train_log.jsonl"
          + (", plots/" if args.plots else "") + ")")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from .metrics import format_table
    from .trainer import evaluate_controller

    res = evaluate_controller(
        args.controller, args.labels, encoder=args.encoder, cache_dir=args.cache_dir, on_error=args.on_error,
        t_label=args.t_label, flat_eps=args.flat_eps, flat_weight=args.flat_weight, seed=args.seed,
        progress=not args.no_progress)
    _print_skipped([res.label_set])
    print(format_table(res.metrics, f"{args.controller} on {args.labels}"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"controller": str(args.controller), "labels": str(args.labels),
                                               "metrics": res.metrics, "skipped": len(res.label_set.skipped)},
                                              indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plots:
        from .plots import write_eval_plots

        for p in write_eval_plots(args.plots, res.outputs, res.data):
            print(f"wrote {p}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    d = TrainArgs()
    t = sub.add_parser("train", help="train a fusion controller from a leave-one-out label file",
                       description="Train a FusionController on LABELS (JSON Lines or a JSON array; see "
                                   "docs/label-format.md) and write it to --out.")
    t.add_argument("labels", help="label file (JSON Lines or JSON array)")
    t.add_argument("--out", required=True, help="output directory (controller + training_args/metrics/log)")
    t.add_argument("--encoder", help="embedding model name or path (default: BAAI/bge-base-en-v1.5 when cached, "
                                     "else the packaged all-MiniLM-L6-v2)")
    t.add_argument("--val", help="explicit validation label file (default: a group/id-based split of LABELS)")
    t.add_argument("--epochs", type=int, default=d.epochs)
    t.add_argument("--batch-size", dest="batch_size", type=int, default=d.batch_size)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--weight-decay", dest="weight_decay", type=float, default=d.weight_decay)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--t-label", dest="t_label", type=float, default=DEFAULT_T_LABEL,
                   help="temperature of the targets y = softmax(delta / T)")
    t.add_argument("--flat-eps", dest="flat_eps", type=float, default=DEFAULT_FLAT_EPS,
                   help="a sample is flat when max(delta) - min(delta) <= this")
    t.add_argument("--flat-weight", dest="flat_weight", type=float, default=DEFAULT_FLAT_WEIGHT,
                   help="sample weight of flat samples (informative samples weigh 1)")
    t.add_argument("--val-fraction", dest="val_fraction", type=float, default=d.val_fraction,
                   help="fraction of groups (else ids) held out for validation when --val is not given")
    t.add_argument("--on-error", dest="on_error", choices=ON_ERROR, default="fail",
                   help="fail at the first bad record (default) or skip bad records and report them")
    t.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="auto (default): bf16 on CPUs with native bfloat16 (AVX512-BF16/AMX), else fp32; bf16: the "
                        "controller's MLPs in bfloat16 with fp32 master weights")
    t.add_argument("--score-hidden", dest="score_hidden", help="score net hidden sizes, e.g. 2048,1024 (default)")
    t.add_argument("--calib-hidden", dest="calib_hidden", type=int, help="calibration net hidden size (256)")
    add_objective_arguments(t)
    t.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint (the last finished epoch)")
    t.add_argument("--overwrite", action="store_true", help="start over in a directory that holds a run")
    t.add_argument("--cache-dir", dest="cache_dir",
                   help="embedding cache directory (default: $FCPRAG_CACHE_DIR or ~/.cache/fcprag/embeddings)")
    t.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is faster for small "
                                               "nets on a busy machine)")
    t.add_argument("--plots", action="store_true", help="write DIR/plots/*.png (needs matplotlib)")
    t.add_argument("--no-progress", dest="no_progress", action="store_true", help="no progress bars")
    t.set_defaults(func=_cmd_train)

    e = sub.add_parser("eval", help="metrics of a controller on a label file, next to uniform and random baselines")
    e.add_argument("controller", help="controller directory")
    e.add_argument("labels", help="label file (JSON Lines or JSON array)")
    e.add_argument("--encoder", help="embedding model (default: the controller's embedding_model)")
    e.add_argument("--cache-dir", dest="cache_dir", help="embedding cache directory")
    e.add_argument("--on-error", dest="on_error", choices=ON_ERROR, default="fail")
    e.add_argument("--t-label", dest="t_label", type=float, help="default: the controller's training_args.json")
    e.add_argument("--flat-eps", dest="flat_eps", type=float)
    e.add_argument("--flat-weight", dest="flat_weight", type=float)
    e.add_argument("--seed", type=int, default=0, help="seed of the random-controller baseline")
    e.add_argument("--plots", help="write g_tau.png and entropy.png into this directory")
    e.add_argument("--json", help="write the metrics to this JSON file")
    e.add_argument("--no-progress", dest="no_progress", action="store_true")
    e.set_defaults(func=_cmd_eval)
