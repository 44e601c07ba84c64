"""Per-record leave-one-out evaluation and the resumable run loop (see ``docs/labels-builder.md``).

A record with N adapters is measured with all of them and with each left out (N + 1 subsets, uniform weights),
and with ``scales``, with all of them at each total scale ``s`` (every ``w~_i = s``), one evaluation at a time or,
with ``batch_size > 1``, through :func:`.batched.score_rows`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.controller import FusionController
from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import JsonlAppender
from fcprag_plugin.features import adapter_recipe, adapter_stats
from fcprag_plugin.slot import activate
from fcprag_plugin.fusion import fuse_into
from fcprag_plugin.merge import merge_adapters
from .errors import LabelBuildError
from .manifest import ManifestRecord
from .options import BuildOptions, format_scales
from ..lm.metrics import answer_logprob, greedy_generate, score_generation
from ..lm.prompts import EncodedPrompt, answer_ids, render_prompt
from ..progress import progress_bar
from ..lm.store import done_ids, read_label_lines

logger = logging.getLogger(__name__)

def check_scale_grid(path: str | Path, scales: Sequence[float]) -> None:
    """Refuse to resume a label file whose records were built with another ``--scales`` (none counts as a grid):
    the ``*_at_scales`` lists of one file must mean the same scales. A missing file is fine."""
    path = Path(path)
    if not path.exists():
        return
    want = [float(s) for s in scales]
    for sl in read_label_lines(path, partial="ignore"):
        have = sl.record.get("scales", [])  # a record without the field was built without --scales
        if have == want:
            continue
        try:
            built = f"--scales {format_scales(have)}" if have else "no --scales"
        except (TypeError, ValueError):
            built = f"'scales' {have!r}"
        asked = f"--scales {format_scales(want)}" if want else "--scales not given"
        raise FcpragError(f"{asked}: {path}:{sl.line} was built with {built}; a label file does not mix scale "
                          "grids: resume with the same --scales, or write to a new --out")


@dataclass
class SubsetResult:
    """The measurements for one subset of adapters (indices into the record's adapter list), merged with every
    weight ``w~_i = scale``."""

    subset: list[int]
    values: dict[str, float]
    generation: str | None = None
    prediction: str | None = None
    empty: bool = False
    scale: float = 1.0


def leave_one_out_subsets(n: int) -> list[list[int]]:
    """``[all] + [all but i for i in range(n)]``; for ``n == 1`` the second is the empty set (base model)."""
    full = list(range(n))
    return [full] + [[j for j in full if j != i] for i in range(n)]


def describe_subset(subset: Sequence[int], n: int, scale: float = 1.0) -> str:
    if len(subset) == n:
        return f"all {n} adapters" + (f" at scale {format_scales([scale])}" if scale != 1.0 else "")
    left = sorted(set(range(n)) - set(subset))
    return f"adapter {left[0]} left out" + (" (base model)" if not subset else "")


class LabelBuilder:
    """Labels manifest records with a live model (in eval mode, under ``torch.no_grad``): ``label(record)``
    returns the label record (a dict)."""

    def __init__(self, model: Any, tokenizer: Any, options: BuildOptions | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.options = options or BuildOptions()
        self.options.validate()
        self.device = next(model.parameters()).device
        self._slot: Any = None
        self._reserve = 1
        self._adapter_fields: dict[str, dict[str, Any]] = {}  # record id -> adapter_stats, adapter_recipe

    def reserve(self, max_adapters: int) -> None:
        """Size the fused slot for records of up to ``max_adapters`` adapters (avoids resizes mid-run)."""
        self._reserve = max(self._reserve, int(max_adapters))

    def close(self) -> None:
        """Remove the fused slot (if any) from the model: it is left bit for bit unchanged."""
        if self._slot is not None:
            self._slot.remove()
            self._slot = None

    def _slot_for(self, adapters: Sequence[Any]) -> Any:
        from fcprag_plugin.slot import FusedSlot, PackedAdapter

        k = max(self._reserve, len(adapters))
        r = max(a.max_rank if isinstance(a, PackedAdapter) else max(a.ranks.values()) for a in adapters)
        self._slot = FusedSlot.for_model(self.model, adapters[0], max_adapters=k, max_rank=r)
        return self._slot

    # ----------------------------------------------------------------- pieces
    def evaluations(self, n: int) -> list[tuple[list[int], float]]:
        """``(subset, scale)`` per evaluation of a record with ``n`` adapters: the N + 1 leave-one-out subsets at
        scale 1, then the full set at each scale of ``options.extra_scales``."""
        return [(s, 1.0) for s in leave_one_out_subsets(n)] + [(list(range(n)), s) for s in self.options.extra_scales]

    def prompts(self, rec: ManifestRecord) -> tuple[EncodedPrompt, EncodedPrompt, list[list[int]]]:
        """(scoring prompt, generation prompt, answer ids per alias). Scoring never uses chain-of-thought."""
        o = self.options  # the passages only reach the prompt in "combine" mode
        score = render_prompt(self.tokenizer, o.template, rec.question, rec.passages, o.prompt_mode, cot=False,
                              use_chat_template=o.use_chat_template)
        gen = score if not o.cot else render_prompt(self.tokenizer, o.template, rec.question, rec.passages,
                                                    o.prompt_mode, cot=True, use_chat_template=o.use_chat_template)
        return score, gen, [answer_ids(self.tokenizer, score, a) for a in rec.answers]

    def load_adapters(self, rec: ManifestRecord) -> list[LoraAdapter]:
        out = []
        for i, path in enumerate(rec.adapters):
            try:
                out.append(LoraAdapter.from_pretrained(path, device=self.device))
            except Exception as e:
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}): adapter {i} at {path} failed to load: "
                                      f"{e}") from e
        return out

    def _result(self, rec: ManifestRecord, subset: Sequence[int], lp: float, generation: str | None,
                scale: float = 1.0) -> SubsetResult:
        """One evaluation's measurements from its answer log-probability and greedy text (both paths end here)."""
        o = self.options
        values: dict[str, float] = {"answer_logprob": lp}
        prediction, empty = None, False
        if o.generate:
            prediction, values["f1"], values["em"] = score_generation(generation, rec.answers, cot=o.cot,
                                                                      scoring=o.scoring)
            empty = not prediction.strip()
            if empty and o.empty_generation == "fail":
                raise LabelBuildError(
                    f"record '{rec.id}' ({rec.where}): empty generation with {describe_subset(subset, rec.n, scale)} "
                    f"(raw output {generation!r}); fix the prompt/max_new_tokens or pass --empty-generation zero "
                    "to score it 0")
        for k, v in values.items():
            if not math.isfinite(v):
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}): {k} is {v} with "
                                      f"{describe_subset(subset, rec.n, scale)}; refusing to write a non-finite label")
        return SubsetResult(list(subset), values, generation, prediction, empty, scale)

    # ----------------------------------------------------------------- one record
    def _prepare(self, rec: ManifestRecord) -> tuple[EncodedPrompt, EncodedPrompt, list[list[int]],
                                                     list[LoraAdapter]]:
        try:
            score_prompt, gen_prompt, answers_ids = self.prompts(rec)
        except FcpragError as e:
            raise LabelBuildError(f"record '{rec.id}' ({rec.where}): {e}") from e
        adapters = self.load_adapters(rec)
        # the side features and recipe fcprag train reads (--side-features adapter_stats; config.trained_for)
        self._adapter_fields[rec.id] = {"adapter_stats": [adapter_stats(a) for a in adapters],
                                        "adapter_recipe": adapter_recipe(adapters[0])}
        return score_prompt, gen_prompt, answers_ids, adapters

    def label(self, rec: ManifestRecord) -> dict[str, Any]:
        """Evaluate one record (N + 1 subsets, and the scales) and return its label record (batched when
        ``batch_size > 1``)."""
        if self.options.batched:
            (out,) = self.label_many([rec])
            if isinstance(out, BaseException):
                raise out
            return out
        return self.label_sequential(rec)

    def label_sequential(self, rec: ManifestRecord) -> dict[str, Any]:
        """One evaluation after the other (merge + hooks, or the fused slot with ``use_slot``)."""
        o = self.options
        score_prompt, gen_prompt, answers_ids, adapters = self._prepare(rec)
        slot = None
        if o.use_slot:
            from fcprag_plugin.slot import pack_adapter

            try:
                slot = self._slot_for(adapters)
                adapters = [pack_adapter(a) for a in adapters]  # packed once, reused by every evaluation
            except FcpragError as e:
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}): fused slot: {e}") from e
        results = []
        for subset, scale in self.evaluations(rec.n):
            chosen = [adapters[i] for i in subset]
            try:
                if not chosen:
                    ctx: Any = contextlib.nullcontext()  # the base model
                elif slot is not None:  # PRAG's sum times the scale, in the model's fused slot
                    ctx = fuse_into(self.model, chosen, rec.question, [rec.passages[i] for i in subset],
                                    controller=FusionController.scale_only(scale), mode=o.merge_mode)
                else:
                    ctx = activate(self.model, merge_adapters(chosen, [scale] * len(chosen), o.merge_mode).adapter)
                with ctx, torch.no_grad():
                    lp = max(answer_logprob(self.model, score_prompt.ids, a) for a in answers_ids)
                    generation = greedy_generate(self.model, self.tokenizer, gen_prompt.ids, o.max_new_tokens) \
                        if o.generate else None
            except FcpragError as e:  # an incompatible adapter: name the record and the subset
                raise LabelBuildError(f"record '{rec.id}' ({rec.where}), {describe_subset(subset, rec.n, scale)}: "
                                      f"{e}") from e
            results.append(self._result(rec, subset, lp, generation, scale))
        return self._label_record(rec, results)

    # ----------------------------------------------------------------- several records, batched
    def group(self, records: Sequence[ManifestRecord]) -> list[list[ManifestRecord]]:
        """Consecutive records grouped while their evaluations (N + 1 each, plus the extra scales) fit
        ``batch_size`` (at least one record per group)."""
        groups: list[list[ManifestRecord]] = []
        rows = 0  # the rows of the last group
        for rec in records:
            size = rec.n + 1 + len(self.options.extra_scales)
            if groups and rows + size <= self.options.batch_size:
                groups[-1].append(rec)
                rows += size
            else:
                groups.append([rec])
                rows = size
        return groups

    def label_many(self, records: Sequence[ManifestRecord]) -> list[dict[str, Any] | LabelBuildError]:
        """Label records together: every evaluation of every record in batched forwards, each row its own mixture.

        Returns per record its label record or the :class:`LabelBuildError` that stopped it (a record's error never
        costs the others their labels). When the adapters cannot share one fused slot, the records are labelled one
        by one instead, so that an error names its record and subset as on the sequential path.
        """
        from fcprag_plugin.slot import pack_adapter
        from ..lm.batched import ScoreRow, score_rows

        o = self.options
        outs: list[dict[str, Any] | LabelBuildError | None] = [None] * len(records)
        ready = []  # (index, record, its first row): one row per evaluation, the empty subset is the base model
        rows: list[ScoreRow] = []
        packed_all = []
        for j, rec in enumerate(records):
            try:
                score_prompt, gen_prompt, answers_ids, adapters = self._prepare(rec)
                packed = [pack_adapter(a) for a in adapters]
            except LabelBuildError as e:
                outs[j] = e
            except FcpragError as e:
                outs[j] = LabelBuildError(f"record '{rec.id}' ({rec.where}): {e}")
            else:
                ready.append((j, rec, len(rows)))
                packed_all += packed
                # scale-1 rows keep the default weights (None: ones), so a run without scales is unchanged
                rows += [ScoreRow(score_prompt.ids, answers_ids, [packed[i] for i in s],
                                  weights=None if scale == 1.0 else [scale] * len(s),
                                  gen_prompt_ids=gen_prompt.ids if o.generate else None)
                         for s, scale in self.evaluations(rec.n)]
        try:
            scores = score_rows(self.model, self.tokenizer, self._slot_for(packed_all), rows, mode=o.merge_mode,
                                batch_size=o.batch_size, max_new_tokens=o.max_new_tokens) if ready else []
        except FcpragError as e:
            logger.info("batched evaluation not possible (%s); labelling these %d records one by one", e, len(ready))
            for j, rec, _ in ready:
                try:
                    outs[j] = self.label_sequential(rec)
                except LabelBuildError as err:
                    outs[j] = err
            return outs  # type: ignore[return-value]
        for j, rec, start in ready:
            evals = self.evaluations(rec.n)
            try:
                results = [self._result(rec, s, sc.logprob, sc.generation, scale)
                           for (s, scale), sc in zip(evals, scores[start:start + len(evals)])]
                outs[j] = self._label_record(rec, results)
            except LabelBuildError as e:
                outs[j] = e
        return outs  # type: ignore[return-value]

    def _label_record(self, rec: ManifestRecord, results: Sequence[SubsetResult]) -> dict[str, Any]:
        o = self.options
        full, loo, scaled = results[0], results[1:rec.n + 1], results[rec.n + 1:]
        # per scale as given; scale 1 is the full set's own measurement (so m(1) == metric_all exactly)
        at = [full if s == 1.0 else next(r for r in scaled if r.scale == s) for s in o.scales]
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
        if o.scales:
            out["scales"] = list(o.scales)
            out["metric_at_scales"] = [r.values[o.metric] for r in at]
        for name in o.metric_names:
            out[f"{name}_all"] = full.values[name]
            out[f"{name}_without"] = [r.values[name] for r in loo]
            if o.scales:
                out[f"{name}_at_scales"] = [r.values[name] for r in at]
        if o.generate:
            for key in ("prediction", "generation"):
                out[f"{key}_all"] = getattr(full, key)
                out[f"{key}_without"] = [getattr(r, key) for r in loo]
                if o.scales:
                    out[f"{key}_at_scales"] = [getattr(r, key) for r in at]
            n_empty = sum(r.empty for r in results)
            if n_empty:
                out["empty_generations"] = n_empty
        out["prompt_mode"] = o.prompt_mode + ("+cot" if o.cot else "")
        if o.model_name:
            out["model"] = o.model_name
        out.update(rec.retrieval)
        out.update(self._adapter_fields.pop(rec.id, {}))
        out.update(rec.extra)
        return out


# ----------------------------------------------------------------------------- run loop
def _one(builder: LabelBuilder, rec: ManifestRecord) -> dict[str, Any] | Exception:
    try:
        return builder.label(rec)
    except Exception as e:  # not KeyboardInterrupt / SystemExit
        return e


def _outcomes(builder: LabelBuilder, group: Sequence[ManifestRecord], batched: bool
              ) -> Iterable[dict[str, Any] | Exception]:
    """Per record of ``group``: its label record or its error. Sequential records are labelled lazily (one at a
    time, so an interrupt loses nothing already labelled); a batched group that fails as a whole (e.g. out of
    memory) is retried record by record so each error is its own record's."""
    if not batched:
        return (_one(builder, rec) for rec in group)
    try:
        return builder.label_many(group)
    except Exception as e:  # not KeyboardInterrupt / SystemExit
        logger.warning("batched evaluation of %d records failed (%s: %s); retrying them one by one",
                       len(group), type(e).__name__, e)
        return [_one(builder, rec) if len(group) > 1 else e for rec in group]


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
    check_scale_grid(out, builder.options.scales)  # before the repair below: a refused run changes nothing
    present = set(done_ids(out, repair=True)) | set(skip_ids)
    batched = builder.options.batched
    # Batched: the groups are planned over all records, done or not, and a group with any record left is
    # evaluated whole. A record's float rounding depends on its batch neighbours (padding, matrix shapes), so
    # this keeps a resumed run byte-identical to an uninterrupted one; only the missing records are written.
    plan = builder.group(records) if batched else [[r] for r in records]
    groups = [g for g in plan if any(r.id not in present for r in g)]
    if records:  # the slot's adapter capacity, once: the largest group's union of adapters (a record's N)
        builder.reserve(max(sum(r.n for r in g) for g in plan))
    done_before = sum(r.id in present for r in records)
    if done_before:
        logger.info("%s: resuming, %d of %d records already labelled", out, done_before, len(records))
    failed: list[tuple[str, str]] = []
    written = 0
    t0 = time.perf_counter()
    with JsonlAppender(out) as app, progress_bar(desc, len(records), unit="rec", initial=done_before,
                                                 enabled=progress, position=position) as bar:
        for group in groups:
            for rec, label in zip(group, _outcomes(builder, group, batched)):
                if rec.id in present:  # evaluated again only for its group's sake (batched resume)
                    continue
                if isinstance(label, BaseException):
                    err = label if isinstance(label, LabelBuildError) else LabelBuildError(
                        f"record '{rec.id}' ({rec.where}): {type(label).__name__}: {label}")
                    if on_error == "fail":
                        if err is label:
                            raise err
                        raise err from label
                    logger.warning("skipping: %s", err)
                    logger.debug("traceback", exc_info=label)
                    failed.append((rec.id, str(err)))
                else:
                    app.append(label)
                    written += 1
                bar.update(1)
    return BuildSummary(out, len(records), done_before, written, failed, time.perf_counter() - t0)
