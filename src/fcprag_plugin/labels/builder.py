"""Per-record leave-one-out evaluation and the resumable run loop.

For a record with N adapters the builder evaluates N + 1 subsets: all adapters, then each one left out (for
N == 1 the empty set, i.e. the base model). Each subset is merged through the library with uniform weights
(``merge_adapters(subset, [1]*k, "cat")``, PRAG's sum of the passage updates) and applied with
``merge.activate`` (forward hooks; the base weights are never written), or, with ``use_slot``, written into
one pre-allocated :class:`fcprag_plugin.fast.FusedSlot` (no per-subset modules or hook churn). Per subset it measures
``answer_logprob`` (teacher forcing) and, with generation on, ``f1`` / ``em`` of the greedy answer.

Label record (the trainer's format, see issue 3): ``id``, ``query``, ``passages``, ``adapters``, ``answer``,
``metric`` (the name), ``metric_all``, ``metric_without`` (N floats), plus ``{name}_all`` / ``{name}_without``
for every computed metric, the raw generations and predictions, ``prompt_mode`` and ``model``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from ..adapter import LoraAdapter
from ..errors import FcpragError
from ..merge import activate, merge_adapters
from .errors import LabelBuildError
from .manifest import ManifestRecord
from .metrics import SCORINGS, answer_logprob, exact_match, extract_answer, f1_score, greedy_generate
from .prompts import PROMPT_MODES, EncodedPrompt, PromptTemplate, answer_ids, render_prompt
from .store import JsonlAppender, done_ids

logger = logging.getLogger(__name__)

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
    use_slot: bool = False  # fcprag_plugin.fast.FusedSlot instead of merge + activate per subset
    model_name: str | None = None

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
        self.template.validate()

    @property
    def metric_names(self) -> tuple[str, ...]:
        return METRICS if self.generate else ("answer_logprob",)


@dataclass
class SubsetResult:
    """The measurements for one subset of adapters (indices into the record's adapter list)."""

    subset: list[int]
    values: dict[str, float]
    generation: str | None = None
    prediction: str | None = None
    empty: bool = False


def leave_one_out_subsets(n: int) -> list[list[int]]:
    """``[all] + [all but i for i in range(n)]``; for ``n == 1`` the second is the empty set (base model)."""
    full = list(range(n))
    return [full] + [[j for j in full if j != i] for i in range(n)]


def describe_subset(subset: Sequence[int], n: int) -> str:
    if len(subset) == n:
        return f"all {n} adapters"
    left = sorted(set(range(n)) - set(subset))
    return f"adapter {left[0]} left out" + (" (base model)" if not subset else "")


class LabelBuilder:
    """Labels manifest records with a live model. ``label(record)`` returns the label record (a dict).

    The model is evaluated under ``torch.no_grad`` in eval mode; adapters are loaded onto the model's device.
    """

    def __init__(self, model: Any, tokenizer: Any, options: BuildOptions | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.options = options or BuildOptions()
        self.options.validate()
        self.device = next(model.parameters()).device
        self._slot: Any = None
        self._reserve = 1

    def reserve(self, max_adapters: int) -> None:
        """Size the fused slot for records of up to ``max_adapters`` adapters (avoids resizes mid-run)."""
        self._reserve = max(self._reserve, int(max_adapters))

    def close(self) -> None:
        """Remove the fused slot (if any) from the model: it is exactly as before."""
        if self._slot is not None:
            self._slot.remove()
            self._slot = None

    def _slot_for(self, adapters: Sequence[LoraAdapter]) -> Any:
        from ..fast import FusedSlot

        k = max(self._reserve, len(adapters))
        r = max(max(a.ranks.values()) for a in adapters)
        self._slot = FusedSlot.for_model(self.model, adapters[0], max_adapters=k, max_rank=r)
        return self._slot

    # ----------------------------------------------------------------- pieces
    def prompts(self, rec: ManifestRecord) -> tuple[EncodedPrompt, EncodedPrompt, list[list[int]]]:
        """(scoring prompt, generation prompt, answer ids per alias). Scoring never uses chain-of-thought."""
        o = self.options
        ctx = rec.passages if o.prompt_mode == "combine" else None
        score = render_prompt(self.tokenizer, o.template, rec.question, ctx, o.prompt_mode, cot=False,
                              use_chat_template=o.use_chat_template)
        gen = score if not o.cot else render_prompt(self.tokenizer, o.template, rec.question, ctx, o.prompt_mode,
                                                    cot=True, use_chat_template=o.use_chat_template)
        return score, gen, [answer_ids(self.tokenizer, score, a) for a in rec.answers]

    def load_adapters(self, rec: ManifestRecord) -> list[LoraAdapter]:
        out = []
        for i, path in enumerate(rec.adapters):
            try:
                out.append(LoraAdapter.from_pretrained(path, device=self.device))
            except Exception as e:
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}): adapter {i} at {path} failed to load: {e}") from e
        return out

    def evaluate(self, rec: ManifestRecord, adapters: Sequence[Any], subset: Sequence[int],
                 score_prompt: EncodedPrompt, gen_prompt: EncodedPrompt, answers_ids: Sequence[Sequence[int]],
                 slot: Any = None) -> SubsetResult:
        """Measure one subset. ``adapters`` are ``LoraAdapter`` s, or ``PackedAdapter`` s when ``slot`` is given."""
        o = self.options
        chosen = [adapters[i] for i in subset]
        if not chosen:
            ctx: Any = contextlib.nullcontext()  # the base model
        elif slot is not None:
            ctx = slot.fused(chosen, [1.0] * len(chosen), o.merge_mode)
        else:
            merged = merge_adapters(chosen, [1.0] * len(chosen), o.merge_mode).adapter
            ctx = activate(self.model, merged)
        values: dict[str, float] = {}
        generation = prediction = None
        empty = False
        with ctx, torch.no_grad():
            values["answer_logprob"] = max(answer_logprob(self.model, score_prompt.ids, a) for a in answers_ids)
            if o.generate:
                generation = greedy_generate(self.model, self.tokenizer, gen_prompt.ids, o.max_new_tokens)
        if o.generate:
            prediction = extract_answer(generation, o.cot, o.scoring)
            if not prediction.strip():
                empty = True
                if o.empty_generation == "fail":
                    raise LabelBuildError(
                        f"record '{rec.id}' ({rec.where}): empty generation with {describe_subset(subset, rec.n)} "
                        f"(raw output {generation!r}); fix the prompt/max_new_tokens or pass --empty-generation zero "
                        "to score it 0")
            values["f1"] = f1_score(prediction, rec.answers)
            values["em"] = exact_match(prediction, rec.answers)
        for k, v in values.items():
            if not math.isfinite(v):
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}): {k} is {v} with "
                                      f"{describe_subset(subset, rec.n)}; refusing to write a non-finite label")
        return SubsetResult(list(subset), values, generation, prediction, empty)

    # ----------------------------------------------------------------- one record
    def label(self, rec: ManifestRecord) -> dict[str, Any]:
        """Evaluate the N + 1 subsets of one record and return its label record."""
        o = self.options
        try:
            score_prompt, gen_prompt, answers_ids = self.prompts(rec)
        except FcpragError as e:
            raise LabelBuildError(f"record '{rec.id}' ({rec.where}): {e}") from e
        adapters: list[Any] = self.load_adapters(rec)
        slot = None
        if o.use_slot:
            from ..fast import pack_adapter

            try:
                slot = self._slot_for(adapters)
                adapters = [pack_adapter(a) for a in adapters]  # packed once, reused by the N + 1 subsets
            except FcpragError as e:
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}): fused slot: {e}") from e
        results = []
        for subset in leave_one_out_subsets(rec.n):
            try:
                results.append(self.evaluate(rec, adapters, subset, score_prompt, gen_prompt, answers_ids, slot))
            except LabelBuildError:
                raise
            except FcpragError as e:  # an incompatible adapter: name the record and the subset
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}), {describe_subset(subset, rec.n)}: {e}") from e
        full, loo = results[0], results[1:]
        out: dict[str, Any] = {
            "id": rec.id,
            "query": rec.question,
            "passages": list(rec.passages),
            "adapters": [str(a) for a in rec.adapters],
            "answer": rec.answers[0] if len(rec.answers) == 1 else list(rec.answers),
            "metric": o.metric,
            "metric_all": full.values[o.metric],
            "metric_without": [r.values[o.metric] for r in loo],
        }
        for name in o.metric_names:
            out[f"{name}_all"] = full.values[name]
            out[f"{name}_without"] = [r.values[name] for r in loo]
        if o.generate:
            out["prediction_all"] = full.prediction
            out["prediction_without"] = [r.prediction for r in loo]
            out["generation_all"] = full.generation
            out["generation_without"] = [r.generation for r in loo]
            n_empty = sum(r.empty for r in results)
            if n_empty:
                out["empty_generations"] = n_empty
        out["prompt_mode"] = o.prompt_mode + ("+cot" if o.cot else "")
        if o.model_name:
            out["model"] = o.model_name
        out.update(rec.extra)
        return out


# ----------------------------------------------------------------------------- run loop
@dataclass
class BuildSummary:
    output: Path
    assigned: int  # records of this shard
    already_done: int  # skipped because present in the output (resume)
    written: int
    failed: list[tuple[str, str]]  # (record id, message) under on_error="skip"
    seconds: float

    @property
    def records_per_s(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0


def build_labels(records: Iterable[ManifestRecord], builder: LabelBuilder, out: str | Path, *,
                 on_error: str = "fail", progress: bool = True, skip_ids: Iterable[str] = (),
                 desc: str = "labels", position: int = 0) -> BuildSummary:
    """Label ``records`` into ``out`` (JSON Lines), resuming: ids already in ``out`` (or in ``skip_ids``) are
    skipped, and a partial last line left by a crash is dropped first. Each record is appended atomically.

    ``on_error``: ``"fail"`` re-raises the first record error (naming the record id); ``"skip"`` logs it,
    leaves the record out (a re-run retries it) and lists it in the summary. Labels are never invented.
    """
    if on_error not in ("fail", "skip"):
        raise FcpragError(f"on_error '{on_error}': expected 'fail' or 'skip'")
    out = Path(out)
    records = list(records)
    if records:
        builder.reserve(max(r.n for r in records))
    present = set(done_ids(out, repair=True)) | set(skip_ids)
    todo = [r for r in records if r.id not in present]
    done_before = len(records) - len(todo)
    if done_before:
        logger.info("%s: resuming, %d of %d records already labelled", out, done_before, len(records))
    failed: list[tuple[str, str]] = []
    written = 0
    t0 = time.perf_counter()
    with JsonlAppender(out) as app, tqdm(total=len(records), initial=done_before, unit="rec", desc=desc,
                                         disable=not progress, dynamic_ncols=True, position=position) as bar:
        for rec in todo:
            try:
                label = builder.label(rec)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:
                err = e if isinstance(e, LabelBuildError) else LabelBuildError(
                    f"record '{rec.id}' ({rec.where}): {type(e).__name__}: {e}")
                if on_error == "fail":
                    if err is e:
                        raise
                    raise err from e
                logger.warning("skipping: %s", err)
                logger.debug("traceback", exc_info=e)
                failed.append((rec.id, str(err)))
                bar.update(1)
                continue
            app.append(label)
            written += 1
            bar.update(1)
    return BuildSummary(out, len(records), done_before, written, failed, time.perf_counter() - t0)
