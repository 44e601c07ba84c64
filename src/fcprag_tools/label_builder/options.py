"""What a label build measures and how: :class:`BuildOptions` (the prompt, the metric, generation, the merge, the
batch and the scales), checked before any model is loaded."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence

from fcprag_plugin.errors import FcpragError
from ..lm.metrics import SCORINGS
from ..lm.prompts import PROMPT_MODES, PromptTemplate

METRICS = ("answer_logprob", "f1", "em")


@dataclass
class BuildOptions:
    """What to measure and how. ``metric`` is the label metric (``metric_all`` / ``metric_without``)."""

    prompt_mode: str = "param"
    template: PromptTemplate = field(default_factory=PromptTemplate)
    use_chat_template: bool | None = None  # None: when the tokenizer has one
    cot: bool = False
    scoring: str = "default"  # how the short answer is cut from a generation (labels.metrics.SCORINGS)
    metric: str = "answer_logprob"
    generate: bool = True  # f1 / em need the greedy generation
    max_new_tokens: int = 32
    empty_generation: str = "fail"  # "fail": a record error; "zero": f1 = em = 0 and counted in the record
    merge_mode: str = "cat"
    use_slot: bool = False  # fcprag_plugin.slot.FusedSlot instead of merge + activate per subset
    model_name: str | None = None
    batch_size: int = 1  # rows per batched forward; 1: one subset at a time (the CLI defaults to 16)
    scales: Sequence[float] = ()  # also measure the full set with every w~_i = s, for each s (scale 1: metric_all)

    def validate(self) -> None:
        if self.prompt_mode not in PROMPT_MODES:
            raise FcpragError(f"prompt mode '{self.prompt_mode}': expected one of {list(PROMPT_MODES)}")
        if self.metric not in METRICS:
            raise FcpragError(f"metric '{self.metric}': expected one of {list(METRICS)}")
        if self.metric != "answer_logprob" and not self.generate:
            raise FcpragError(f"metric '{self.metric}' needs the greedy generation; drop --no-generation")
        if self.scoring not in SCORINGS:
            raise FcpragError(f"scoring '{self.scoring}': expected one of {list(SCORINGS)}")
        if self.empty_generation not in ("fail", "zero"):
            raise FcpragError(f"empty_generation '{self.empty_generation}': expected 'fail' or 'zero'")
        if self.max_new_tokens < 1:
            raise FcpragError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise FcpragError(f"batch size (--batch-size) must be an integer >= 1, got {self.batch_size!r}")
        check_scales(self.scales)
        self.scales = tuple(float(s) for s in self.scales)
        self.template.validate()

    @property
    def batched(self) -> bool:
        """Whether records are labelled through the batched scorer (``batch_size > 1``; the ``cat`` merge only)."""
        return self.batch_size > 1 and self.merge_mode == "cat"

    @property
    def metric_names(self) -> tuple[str, ...]:
        return METRICS if self.generate else ("answer_logprob",)

    @property
    def extra_scales(self) -> tuple[float, ...]:
        """The scales measured on their own: scale 1 is the full set, already measured as ``metric_all``."""
        return tuple(s for s in self.scales if s != 1.0)


def check_scales(scales: Sequence[float]) -> None:
    """Merge scales: finite numbers > 0, each once (``FcpragError`` naming ``--scales`` otherwise)."""
    seen = set()
    for s in scales:
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) or s <= 0:
            raise FcpragError(f"--scales: {s!r} is not a finite number > 0; expected e.g. 0.5,1,2")
        if float(s) in seen:
            raise FcpragError(f"--scales: {s!r} is given twice; expected distinct scales")
        seen.add(float(s))


def format_scales(scales: Sequence[float]) -> str:
    """``[0.5, 1.0, 2.0]`` -> ``"0.5,1,2"`` (how ``--scales`` is written; every digit kept)."""
    return ",".join(repr(float(s)).removesuffix(".0") for s in scales)
