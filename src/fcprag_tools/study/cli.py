"""``fcprag study QUESTIONS --model M --out OUT``: the whole study, resumable (see :mod:`.pipeline`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from typing import Iterator

from fcprag_plugin.training import TrainArgs
from ..options import add_flags, add_model_flags, flag_values
from ..progress import write_line
from .options import PARTS, TRAINING_FLAGS, StudyOptions
from .report_cli import add_policy_flags, policy_of


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


def options_of(args: argparse.Namespace) -> StudyOptions:
    """The study's options from its parsed flags (:func:`register`)."""
    values = {k: v for part in PARTS.values() for k, v in flag_values(part, args).items()}
    return StudyOptions.of(out=args.out, policy=policy_of(args), **values,
                           **flag_values(TrainArgs, args, TRAINING_FLAGS))


def _cmd_study(args: argparse.Namespace) -> int:
    from .pipeline import study

    opts = options_of(args)
    # fcprag_tools.cli prints "fcprag study: interrupted; " before it
    args.interrupt_hint = "everything finished is kept under --out: run the same command to resume"
    with _study_logging():
        if not opts.generation.generate:
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
        none = action.default is None or isinstance(action.default, bool) or action.default == argparse.SUPPRESS
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
    for name, part in PARTS.items():  # each part's flags, made from its fields
        add_model_flags(s) if name == "model" else add_flags(s, part)
    add_flags(s, StudyOptions)  # --out
    add_flags(s, TrainArgs, TRAINING_FLAGS)
    add_policy_flags(s)
    s.set_defaults(func=_cmd_study)
