"""``fcprag study``'s options (:class:`StudyOptions`, the command's flags by the same names) and their checks that
need nothing but the options themselves; the bottom of the study: it imports nothing of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import FcpragError


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
            looks = f"; {t:g} looks like F1 points: give {t / 100:g} for {t:g} points" if t >= 1 else ""
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


@dataclass
class StudyOptions:
    """``fcprag study``'s options (the CLI's flags, same names)."""

    questions: Sequence[str]  # question files (one path: a file)
    model: str | None  # a name or folder; "smollm2" or None: the packaged offline SmolLM2 (model_io.resolve_model)
    out: str
    gguf_file: str | None = None
    device: str = "auto"
    dtype: str = "auto"  # "auto": model_io.auto_dtype's rule (float32 on a CPU, bfloat16 on CUDA)
    test_fraction: float = 0.33
    seed: int = 0
    controller: str | None = None
    train_ids: str | None = None  # a file of the training questions' ids; the rest are held out (no seeded split)
    retrieval: str | None = None
    top_k: int = 3
    limit: int | None = None
    scales: Sequence[float] = (0.5, 2.0, 3.0, 4.0, 6.0)
    generate: bool = True
    max_new_tokens: int = 16
    aug_max_new_tokens: int = 128
    aug_batch: int | None = None  # None: from the device (8 on a CPU; lm.sizing)
    group: int | None = None  # None: from the device (16 on a CPU; lm.sizing)
    max_tokens: int = 128
    batch_size: int | None = None  # None: from the device (16 on a CPU; lm.sizing)
    chunk: int = 8
    cv_folds: int = 5
    encoder: Any = None  # None: the controller's / the library's default sentence encoder
    arrow: bool = True
    progress: bool = True
    threads: int | None = None  # torch's CPU threads; None: model_io.choose_threads (the cores other jobs leave)
    model_name: str | None = None  # the model as the user named it ("smollm2" when defaulted); set by preflight
    train_args: dict[str, Any] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)  # the verdict's margins and target effect

    def __post_init__(self) -> None:
        if isinstance(self.questions, (str, Path)):
            self.questions = [str(self.questions)]
        self.questions = [str(q) for q in self.questions]

    def validate(self) -> None:
        """Each option's value on its own (numbers in range, the named files exist); a one-line
        :class:`FcpragError` naming the flag at the first mistake."""
        if not self.questions:
            raise FcpragError("QUESTIONS: no question file given")
        if not 0 < self.test_fraction < 1:
            raise FcpragError(f"--test-fraction {self.test_fraction}: expected a fraction between 0 and 1")
        for name in ("top_k", "group", "batch_size", "chunk", "max_new_tokens", "aug_batch", "max_tokens", "threads"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise FcpragError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected an integer >= 1")
        if self.limit is not None and self.limit < 2:
            raise FcpragError(f"--limit {self.limit}: expected at least 2 questions")
        for s in self.scales:
            if not (math.isfinite(s) and s > 0) or s == 1.0:
                raise FcpragError(f"--scales: {s} must be a finite number > 0 and not 1 (scale 1 is prag_sum)")
        if self.train_ids is not None and self.controller is not None:
            raise FcpragError("--train-ids with --controller: a given controller trains nothing and is evaluated on "
                              "every question; drop one of them")
        for what, path in (*(("QUESTIONS", q) for q in self.questions), ("--retrieval", self.retrieval),
                           ("--train-ids", self.train_ids)):
            if path is not None and not Path(path).is_file():
                expected = {"QUESTIONS": "JSON Lines (the data/README.md schema)",
                            "--retrieval": "JSON Lines {\"id\", \"passages\": [...]}",
                            "--train-ids": "JSON {\"ids\": [...]}, a JSON list, or one id per line"}[what]
                raise FcpragError(f"{what} {path}: file not found; expected {expected}")
        if self.controller is not None and not (Path(self.controller) / "config.json").is_file():
            raise FcpragError(f"--controller {self.controller}: no config.json there; expected a saved controller")
