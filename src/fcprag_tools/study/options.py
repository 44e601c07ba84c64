"""``fcprag study``'s options: small frozen parts, each read by the stages that use it (:class:`Plan`, the model's
:class:`~fcprag_tools.options.ModelPart`, :class:`Generation`, :class:`Batching`, :class:`Split`, the trainer's
``TrainArgs``, :class:`Policy`, :class:`~fcprag_tools.options.Runtime`, DyPRAG's :class:`TranslatorPart`), held
together by :class:`StudyOptions`.
Each flag is made from its field (name, default and help: :func:`fcprag_tools.options.add_flags`), so it is written
once. Their checks that need nothing but the options themselves are here too; the bottom of the study: it imports
nothing of it."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.training import MAX_EPOCHS, TrainArgs
from ..options import (ENCODER, ModelPart, Runtime, check_ranges, finite_float, int_at_least, option,
                       positive_int)
from ..translator.train import TranslatorOptions

_DYPRAG = TranslatorOptions()  # DyPRAG's defaults, written once there


@dataclass(frozen=True)
class Policy:
    """The smallest gains worth shipping and the effect the power figures are sized for.

    ``min_gain``: a network ships only when the lower bound of its reweighting gain (the trainer's out-of-fold 95% CI
    on the training questions) lies above it, in gold log-lik. per question (nats, the trainer's scale).
    ``min_scale_gain`` (None: ``min_gain``): likewise for a scale over PRAG's sum. 0.02 is a twelfth of the scale
    gain seen at 135M (PRAG's sum x2: +0.26) and two hundred times the reweighting gain the first table study
    shipped on (+0.0001): a gain below it moves no answer a user can see (that network answered as PRAG's sum on 100
    of 100 questions). ``target_f1``: the F1 difference the power figures are sized for, and the half-width inside
    which a held-out F1 interval reads "equivalent": a fraction of 1 (0.03 = 3 F1 points), the unit of F1 in
    ``summary.json`` and of ``--target-f1`` (:data:`TARGET_F1_MAX`: above it a value reads as points and is refused).
    ``power``: for ``mde_f1`` and ``n_needed``."""

    min_gain: float = 0.02
    min_scale_gain: float | None = None
    target_f1: float = 0.03
    power: float = 0.8

    @classmethod
    def checked(cls, **kw: Any) -> "Policy":
        """A policy from the flags' values, each checked: a negative margin, or a target F1 outside
        ``(0, TARGET_F1_MAX]``, is one :class:`FcpragError` line naming its flag."""
        for name in ("min_gain", "min_scale_gain"):
            if kw.get(name) is not None and kw[name] < 0:
                raise FcpragError(f"--{name.replace('_', '-')} {kw[name]:g}: expected a number >= 0 (gold log-lik. "
                                  "per question)")
        t = kw.get("target_f1", cls.target_f1)
        if not 0 < t <= TARGET_F1_MAX:
            unit = "point" if t == 1 else "points"
            looks = f"; {t:g} looks like F1 points: give {t / 100:g} for {t:g} {unit}" if t >= 1 else ""
            raise FcpragError(f"--target-f1 {t:g}: expected a fraction of 1 above 0 and at most {TARGET_F1_MAX:g}, "
                              f"the unit of F1 in summary.json (0.03 = 3 points){looks}")
        return cls(**kw)

    @property
    def scale_margin(self) -> float:
        return self.min_gain if self.min_scale_gain is None else self.min_scale_gain

    def margins(self) -> dict[str, float]:
        return {"reweighting": self.min_gain, "scale": self.scale_margin}

    def record(self) -> dict[str, float]:
        """What ``summary.json`` records as its ``policy``."""
        return {"min_gain": self.min_gain, "min_scale_gain": self.scale_margin, "target_f1": self.target_f1,
                "power": self.power}


TARGET_F1_MAX = 0.5  # a larger --target-f1 (50 F1 points) sizes no study: it was meant in points


def scale_list(text: str) -> tuple[float, ...]:
    """argparse type for ``--scales``: comma-separated numbers, none twice (their range: :meth:`StudyOptions.validate`)."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected comma-separated numbers > 0, e.g. 0.5,2,3,4,6") from None
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"'{text}': a scale is listed twice")
    return tuple(out)


@dataclass(frozen=True)
class Plan:
    """What the study measures: the question files, their passages, the controller (given, or trained here) and
    the rows beside it (PRAG's sum times each of ``scales``, PEFT's Arrow router); ``encoder``: the embedding model
    (a name, a folder or an encoder object; None: the controller's, else the library's default)."""

    questions: tuple[str, ...] = field(metadata=option(
        "question files (one dataset each, named by the file, unless a record has a 'dataset' field): JSON Lines in "
        "the data/README.md schema, or PRAG's HotpotQA / 2Wiki / PopQA / ComplexWebQuestions JSON (the last two need "
        "--retrieval)", positional=True, metavar="QUESTIONS", nargs="+"))
    retrieval: str | None = field(default=None, metadata=option(
        "JSON Lines {\"id\", \"passages\": [...]} in rank order instead of BM25", metavar="FILE"))
    top_k: int = field(default=3, metadata=option("passages (adapters) per question", type=positive_int))
    controller: str | None = field(default=None, metadata=option(
        "train nothing: evaluate this saved controller on all the questions (row 'recommended'), but those listed in "
        "its train_question_ids.json", metavar="DIR"))
    scales: tuple[float, ...] = field(default=(0.5, 2.0, 3.0, 4.0, 6.0), metadata=option(
        "PRAG's sum times each scale, in labels and evaluation", type=scale_list))
    arrow: bool = field(default=True, metadata=option("skip PEFT's Arrow router row"))
    encoder: Any = field(default=None, metadata=ENCODER)

    def __post_init__(self) -> None:
        qs = [self.questions] if isinstance(self.questions, (str, Path)) else self.questions
        object.__setattr__(self, "questions", tuple(str(q) for q in qs))
        object.__setattr__(self, "scales", tuple(float(s) for s in self.scales))


@dataclass(frozen=True)
class Generation:
    """The greedy answers (``generate``: F1 / EM beside the gold log-lik.) and the lengths the model generates."""

    generate: bool = field(default=True, metadata=option("gold log-lik. only (no greedy answers, no F1/EM)"))
    max_new_tokens: int = field(default=16, metadata=option(
        "greedy answer length (PRAG's short answer ends at its first '.', ',' or newline, where an answer stops; "
        "fcprag labels build's longer default leaves room for --cot)", type=positive_int))
    aug_max_new_tokens: int = 128  # PRAG's augmentation (a rewrite, three question-answer pairs per passage)


@dataclass(frozen=True)
class Batching:
    """How much goes through the model at once (None: from the device and its free memory, :mod:`..lm.sizing`), and
    ``max_tokens``, the length of an adapter's training samples."""

    aug_batch: int | None = field(default=None, metadata=option(
        "passages augmented per generate call (default from the device: 8 on a CPU, up to 64 on a GPU by its free "
        "memory)", type=positive_int))
    group: int | None = field(default=None, metadata=option(
        "adapters trained together per step (default from the device: 16 on a CPU, up to 64 on a GPU by its free "
        "memory)", type=positive_int))
    batch_size: int | None = field(default=None, metadata=option(
        "sequences per scoring forward (default from the device: 16 on a CPU, up to 64 on a GPU by its free memory)",
        type=positive_int))
    chunk: int = field(default=8, metadata=option("questions per evaluation call", type=positive_int))
    max_tokens: int = 128


@dataclass(frozen=True)
class Split:
    """Which questions the study takes and which it holds out: a seeded stratified split, or ``train_ids``."""

    test_fraction: float = field(default=0.33, metadata=option("held-out share of the questions", type=finite_float))
    seed: int = field(default=0, metadata=option("split and training seed", type=int))
    train_ids: str | None = field(default=None, metadata=option(
        "train on the questions with these ids and hold out the rest, instead of a seeded split (JSON {\"ids\": "
        "[...]} such as a controller's train_question_ids.json, a list, or a line each)", metavar="FILE"))
    limit: int | None = field(default=None, metadata=option("only the first N questions of the file",
                                                            type=positive_int))


@dataclass(frozen=True)
class TranslatorPart:
    """DyPRAG's stage and rows: a translator (DyPRAG's ``ParameterTranslator``) trained here on the training
    questions' passages with DyPRAG's recipe (``translator_*``: its epochs, learning rate and hypernet width), or
    ``dyprag_translator``, a checkpoint in DyPRAG's format (nothing trained; its shapes are the file's).
    ``dyprag=False``: no DyPRAG stage and no DyPRAG rows."""

    dyprag: bool = field(default=True, metadata=option("no DyPRAG stage (translator) and no DyPRAG rows"))
    dyprag_translator: str | None = field(default=None, metadata=option(
        "a translator checkpoint in DyPRAG's format (torch.save({'model_state_dict': ...}), e.g. DyPRAG's released "
        "1B / 1.5B translators) for the DyPRAG rows instead of one trained here; checked against --model before any "
        "work", metavar="FILE"))
    translator_epochs: int = field(default=_DYPRAG.epochs, metadata=option(
        "epochs of the translator trained here (DyPRAG's recipe)", type=positive_int))
    translator_lr: float = field(default=_DYPRAG.learning_rate, metadata=option(
        "AdamW learning rate of the translator trained here", type=finite_float))
    translator_width: int = field(default=_DYPRAG.width, metadata=option(
        "hidden width of the translator's hypernets (DyPRAG's --projector_p)", type=positive_int))

    def training(self) -> TranslatorOptions:
        """The options :func:`fcprag_tools.translator.train_translator` is given."""
        return TranslatorOptions(epochs=self.translator_epochs, learning_rate=self.translator_lr,
                                 width=self.translator_width)

    def check(self) -> None:
        """The values on their own; a one-line :class:`FcpragError` naming the flag."""
        if not (math.isfinite(self.translator_lr) and self.translator_lr > 0):
            raise FcpragError(f"--translator-lr {self.translator_lr}: expected a finite number > 0")
        if self.dyprag_translator is None:
            return
        if not self.dyprag:
            raise FcpragError(f"--dyprag-translator with --no-dyprag: a translator for DyPRAG rows that are off; drop "
                              "one of them")
        if not Path(self.dyprag_translator).is_file():
            raise FcpragError(f"--dyprag-translator {self.dyprag_translator}: file not found; expected a translator "
                              "checkpoint in DyPRAG's format (torch.save({'model_state_dict': ...}))")


# the trainer's arguments fcprag study has flags for (the rest: study_training's); --seed is the split's
TRAINING_FLAGS = {
    "epochs": option("the trainer's most epochs", type=int_at_least(1, MAX_EPOCHS)),
    "cv_folds": option("the trainer's nested CV folds (0: off; at most the training questions, none below 4)",
                       type=int_at_least(0)),
}


def study_training(**changes: Any) -> TrainArgs:
    """The trainer's arguments of a study: the risk objective, kappa chosen on the measured scales, and the network
    kept so that the evaluation measures its reweighting (what ships is decided by the verdict)."""
    return TrainArgs(**{"kappa": "auto", "objective": "risk", "keep_network": True, **changes})


# the parts StudyOptions holds, by the name it holds each under
PARTS = {"plan": Plan, "model": ModelPart, "generation": Generation, "batching": Batching, "split": Split,
         "runtime": Runtime, "dyprag": TranslatorPart}


@dataclass(frozen=True)
class StudyOptions:
    """``fcprag study``'s options, a part each (:data:`PARTS`, ``train``, ``policy``); :meth:`of` builds them from
    the flags' names."""

    out: str = field(metadata=option(
        "the study's own folder: new or empty (created), or an earlier study's to resume it; never a folder of other "
        "files", required=True, metavar="DIR"))
    plan: Plan
    model: ModelPart = ModelPart()
    generation: Generation = Generation()
    batching: Batching = Batching()
    split: Split = Split()
    train: TrainArgs = field(default_factory=study_training)
    policy: Policy = Policy()  # the verdict's margins and target effect
    runtime: Runtime = Runtime()
    dyprag: TranslatorPart = TranslatorPart()

    @classmethod
    def of(cls, *, out: str, train: TrainArgs | None = None, policy: Policy | None = None,
           **values: Any) -> StudyOptions:
        """The options from the flags' names (``questions=..., top_k=2, max_new_tokens=3, epochs=2``), each value to
        the part whose field it names; ``seed`` seeds the split and the training (one ``--seed``); ``epochs`` and
        ``cv_folds`` go to the trainer, whose other arguments are ``train``'s (default :func:`study_training`)."""
        parts = {}
        for key, part in PARTS.items():
            names = {f.name for f in fields(part)}
            parts[key] = part(**{k: values.pop(k) for k in list(values) if k in names})
        trainer = {k: values.pop(k) for k in list(values) if k in TRAINING_FLAGS}
        if values:
            raise TypeError(f"StudyOptions.of: unknown option(s) {sorted(values)}")
        train = replace(train or study_training(), seed=parts["split"].seed, **trainer)
        return cls(out=str(out), train=train, policy=policy or Policy(), **parts)

    def validate(self) -> None:
        """Each option's value on its own (numbers in range, the named files exist); a one-line
        :class:`FcpragError` naming the flag at the first mistake."""
        plan, split = self.plan, self.split
        if not plan.questions:
            raise FcpragError("QUESTIONS: no question file given")
        if not 0 < split.test_fraction < 1:
            raise FcpragError(f"--test-fraction {split.test_fraction}: expected a fraction between 0 and 1")
        for key in PARTS:
            check_ranges(getattr(self, key))
        if split.limit is not None and split.limit < 2:
            raise FcpragError(f"--limit {split.limit}: expected at least 2 questions")
        check_ranges(self.train, TRAINING_FLAGS)
        if self.train.cv_folds == 1:
            raise FcpragError(f"--cv-folds {self.train.cv_folds}: expected 0 (off) or at least 2")
        for s in plan.scales:
            if not (math.isfinite(s) and s > 0) or s == 1.0:
                raise FcpragError(f"--scales: {s} must be a finite number > 0 and not 1 (scale 1 is prag_sum)")
        if split.train_ids is not None and plan.controller is not None:
            raise FcpragError("--train-ids with --controller: a given controller trains nothing and is evaluated on "
                              "every question; drop one of them")
        for what, path in (*(("QUESTIONS", q) for q in plan.questions), ("--retrieval", plan.retrieval),
                           ("--train-ids", split.train_ids)):
            if path is not None and not Path(path).is_file():
                expected = {"QUESTIONS": "JSON Lines (the data/README.md schema)",
                            "--retrieval": "JSON Lines {\"id\", \"passages\": [...]}",
                            "--train-ids": "JSON {\"ids\": [...]}, a JSON list, or one id per line"}[what]
                raise FcpragError(f"{what} {path}: file not found; expected {expected}")
        if plan.controller is not None and not (Path(plan.controller) / "config.json").is_file():
            raise FcpragError(f"--controller {plan.controller}: no config.json there; expected a saved controller")
        self.dyprag.check()
