"""``fcprag study``'s options (:class:`StudyOptions`, the command's flags by the same names) and their checks that
need nothing but the options themselves; the bottom of the study: it imports nothing of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import FcpragError


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
                expected = {"QUESTIONS": "JSON Lines (the ../shared/data schema)",
                            "--retrieval": "JSON Lines {\"id\", \"passages\": [...]}",
                            "--train-ids": "JSON {\"ids\": [...]}, a JSON list, or one id per line"}[what]
                raise FcpragError(f"{what} {path}: file not found; expected {expected}")
        if self.controller is not None and not (Path(self.controller) / "config.json").is_file():
            raise FcpragError(f"--controller {self.controller}: no config.json there; expected a saved controller")
