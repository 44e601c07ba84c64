"""``fcprag study QUESTIONS --model M --out OUT``: the whole study, resumable (see :mod:`.pipeline`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from typing import Any, Iterator

from fcprag_plugin.errors import FcpragError
from ..options import add_model_flags, finite_float, positive_int
from ..progress import write_line
from .report_cli import add_policy_flags, policy_of


def _scales(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FcpragError(f"--scales {text}: expected comma-separated numbers > 0, e.g. 0.5,2,3,4,6") from None
    if len(set(out)) != len(out):
        raise FcpragError(f"--scales {text}: a scale is listed twice")
    return out


class _StudyLines(logging.Formatter):
    """The study's own INFO lines (the model it uses, what a resumed stage keeps, ...) as plain sentences; other
    levels as the ``fcprag`` command prints them (``WARNING name: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO:
            return f"fcprag study: {record.getMessage()}"
        return f"{record.levelname} {record.name}: {record.getMessage()}"


class _Say(logging.Handler):
    """Writes above the progress bars (:func:`fcprag_tools.progress.write_line`): a line never tears one."""

    def emit(self, record: logging.LogRecord) -> None:
        write_line(self.format(record))


@contextlib.contextmanager
def _study_logging() -> Iterator[None]:
    """``fcprag_tools.study``'s INFO lines on stderr while the command runs (the root logger stays at WARNING)."""
    log = logging.getLogger("fcprag_tools.study")
    handler = _Say()
    handler.setFormatter(_StudyLines())
    level, propagate = log.level, log.propagate
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    log.addHandler(handler)
    log.propagate = False  # the root handler would print the INFO lines again, and each warning twice
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _cmd_study(args: argparse.Namespace) -> int:
    from .options import StudyOptions
    from .pipeline import study

    policy = policy_of(args)

    train_args: dict[str, Any] = {}
    if args.epochs is not None:
        train_args["epochs"] = args.epochs
    opts = StudyOptions(
        questions=args.questions, model=args.model, out=args.out, gguf_file=args.gguf_file, device=args.device,
        dtype=args.dtype, test_fraction=args.test_fraction, seed=args.seed, controller=args.controller,
        train_ids=args.train_ids, retrieval=args.retrieval, top_k=args.top_k, limit=args.limit,
        scales=_scales(args.scales),
        generate=not args.no_generate, max_new_tokens=args.max_new_tokens, group=args.group,
        batch_size=args.batch_size, chunk=args.chunk, cv_folds=args.cv_folds, encoder=args.encoder,
        arrow=not args.no_arrow, progress=not args.no_progress, aug_batch=args.aug_batch, threads=args.threads,
        train_args=train_args, policy=policy)
    # fcprag_tools.cli prints "fcprag study: interrupted; " before it
    args.interrupt_hint = "everything finished is kept under --out: run the same command to resume"
    with _study_logging():
        if args.no_generate:
            logging.getLogger(__name__).info("--no-generate: no greedy answers, so report.md will have no F1/EM table, "
                                             "no plot and no 'what to run'; the verdict rests on gold log-lik. alone")
        out, complete = study(opts)
    if out is not None and complete and out.get("policy") != opts.policy.record():
        from .report_cli import rebuild  # a finished study, other margins: its rows re-reported, nothing recomputed

        out, complete = rebuild(args.out, opts.policy), False
    if out is not None:
        v = out["verdict"]
        print(json.dumps({"ship": v["ship"], "kappa": v["kappa"], "why": v["why"]}, indent=2))
        if complete:
            print(f"{args.out}: complete; summary.json, report.md and controller/ are as they were (delete "
                  "summary.json to rebuild it)")
        else:
            print(f"wrote {args.out}/summary.json, report.md and controller/")
    return 0


class _WithDefaults(argparse.HelpFormatter):
    """Help that ends each option's text with its default, when it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        none = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not none and "default" not in text:
            text += " (default: %(default)s)"
        return text


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "study", help="what to run on my model and data (no retrieval, standard RAG, PRAG, Combine or a fusion), "
                      "measured: one resumable command",
        formatter_class=_WithDefaults,
        description="From a question file and a model to a measured verdict: BM25 retrieval, PRAG's augmentation "
                    "by the model, passage adapters (PRAG's recipe, trained stacked), leave-one-out and scale "
                    "labels on the training questions, a controller (nested CV), and the held-out evaluation by "
                    "real forwards. Writes OUT/summary.json, OUT/report.md and OUT/controller/ (what it "
                    "recommends). Every stage is cached under OUT: after Ctrl-C or a killed process, run the same "
                    "command again and nothing finished is redone. Under torchrun the heavy stages shard over "
                    "the processes. How many questions: the risk rule that chooses the scale needs about 35 "
                    "training questions (53 in all at the default --test-fraction) before it can allow any "
                    "scale; with fewer the study keeps PRAG's sum and says so at the start. The held-out CIs narrow "
                    "with more (docs/cli.md).")
    s.add_argument("questions", metavar="QUESTIONS", nargs="+",
                   help="question files (one dataset each, named by the file, unless a record has a 'dataset' "
                        "field): JSON Lines in the data/README.md schema, or PRAG's HotpotQA / 2Wiki / PopQA / "
                        "ComplexWebQuestions JSON (the last two need --retrieval)")
    add_model_flags(s)
    s.add_argument("--out", required=True, metavar="DIR",
                   help="the study's own folder: new or empty (created), or an earlier study's to resume it; never a "
                        "folder of other files")
    s.add_argument("--test-fraction", type=finite_float, default=0.33, help="held-out share of the questions")
    s.add_argument("--seed", type=int, default=0, help="split and training seed")
    s.add_argument("--controller", metavar="DIR",
                   help="train nothing: evaluate this saved controller on all the questions (row 'recommended'), "
                        "but those listed in its train_question_ids.json")
    s.add_argument("--train-ids", metavar="FILE",
                   help="train on the questions with these ids and hold out the rest, instead of a seeded split "
                        "(JSON {\"ids\": [...]} such as a controller's train_question_ids.json, a list, or a line "
                        "each)")
    s.add_argument("--retrieval", metavar="FILE",
                   help="JSON Lines {\"id\", \"passages\": [...]} in rank order instead of BM25")
    s.add_argument("--top-k", type=positive_int, default=3, help="passages (adapters) per question")
    s.add_argument("--limit", type=positive_int, help="only the first N questions of the file")
    s.add_argument("--scales", default="0.5,2,3,4,6", help="PRAG's sum times each scale, in labels and evaluation")
    s.add_argument("--no-generate", action="store_true", help="gold log-lik. only (no greedy answers, no F1/EM)")
    s.add_argument("--max-new-tokens", type=positive_int, default=16, help="greedy answer length")
    s.add_argument("--group", type=positive_int, help="adapters trained together per step (default from the device: "
                   "16 on a CPU, up to 64 on a GPU by its free memory)")
    s.add_argument("--aug-batch", type=positive_int, help="passages augmented per generate call (default from the "
                   "device: 8 on a CPU, up to 64 on a GPU by its free memory)")
    s.add_argument("--batch-size", type=positive_int, help="sequences per scoring forward (default from the device: "
                   "16 on a CPU, up to 64 on a GPU by its free memory)")
    s.add_argument("--chunk", type=positive_int, default=8, help="questions per evaluation call")
    s.add_argument("--cv-folds", type=int, default=5, help="the trainer's nested CV folds")
    s.add_argument("--epochs", type=positive_int, help="the trainer's most epochs (its default otherwise)")
    s.add_argument("--encoder", help="sentence encoder name or path (default: the library's)")
    s.add_argument("--no-arrow", action="store_true", help="skip PEFT's Arrow router row")
    add_policy_flags(s)
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("--threads", type=positive_int,
                   help="torch's CPU threads (default: $OMP_NUM_THREADS when set, else the cores other jobs leave "
                        "free by the load average; docs/cli.md)")
    s.set_defaults(func=_cmd_study)
