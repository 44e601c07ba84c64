"""The translator stage: DyPRAG's parameter translator for the DyPRAG rows (:mod:`..dyprag` names the files).

After the adapters, on the training questions' passages only, the translator is trained with DyPRAG's recipe
(:func:`fcprag_tools.translator.train_translator`, resumable, under ``OUT/translator/train/``), on rank 0 under a
launcher; or ``--dyprag-translator FILE`` is taken as it is (checked against the model before any stage). Either is
exported in DyPRAG's layout (:func:`..dyprag.export_path`) and recorded in ``OUT/translator/translator.json``.

The rows then read it through a :class:`DypragSource`: each passage's generated update is made once per process, on
first need, and kept in memory (never written); its seconds go once per translator to ``dyprag_generated.jsonl``
(with the translator's ``sha256``), and for a held-out question the mean pairwise cosine of its passages' generated
updates and of their PRAG adapters to ``dyprag_cosine.jsonl``, while the updates are in memory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.fileio import write_json
from ...translator import (dyprag_adapter, generate_adapters, load_translator, mean_pairwise_cosine, read_state_dict,
                           shape_of, train_translator)
from ...translator.checkpoint import copy_checkpoint, remove_stale_temporaries
from ...translator.embed import passage_ids
from .. import adapters as ad
from .. import dyprag as dy
from ..options import TranslatorPart
from ..run import StudyRun
from .retrieval import Questions

logger = logging.getLogger(__name__)


@dataclass
class DypragSource:
    """The translator the DyPRAG rows use (its export ``path`` and ``sha256``, the rows' ``translator``), loaded
    on first need on the model's device, and the passages' generated updates (``{pid: LoraAdapter}``, float32 on the
    CPU, scaling 1)."""

    run: StudyRun
    qs: Questions
    path: Path
    sha256: str
    translator: Any = None
    generated: dict[str, LoraAdapter] = field(default_factory=dict)
    texts: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.texts = {p["pid"]: p["text"] for q in self.qs.values() for p in q["passages"]}

    @functools.cached_property
    def rank(self) -> int:
        """The rank of the generated updates (the translator's, read from its file: a given checkpoint's may be
        other than PRAG's): what the fused slot that scores a DyPRAG row must hold."""
        return shape_of(read_state_dict(self.path), self.path).rank

    def _generate(self, texts: dict[str, str]) -> None:
        """The updates of ``texts`` (``{pid: text}``) not made yet, in one call; their seconds appended once."""
        todo = {p: t for p, t in texts.items() if p not in self.generated}
        if not todo:
            return
        run = self.run
        run.load_model()
        if self.translator is None:
            device = next(run.model.parameters()).device
            self.translator = load_translator(self.path, run.model.config, model=f"--model {run.lm.model}",
                                              device=device)
        _, seconds = generate_adapters(run.model, run.tok, self.translator, todo, cache=self.generated)
        store = run.store(dy.GENERATED)
        have = store.done()
        tokens = dict(zip(todo, map(len, passage_ids(run.tok, list(todo.values())))))
        # each line names its translator: the report's cost reads the study's current translator's lines only
        store.append([{"id": p, "seconds": round(s, 6), "tokens": tokens[p], "device": run.device(),
                       "sha256": self.sha256}
                      for p, s in seconds.items() if have.get(p, {}).get("sha256") != self.sha256])

    def prepare(self, qids: Sequence[str]) -> None:
        """The updates of the questions' passages (one generation call), and each held-out question's cosines when
        this translator has none recorded."""
        self._generate({p["pid"]: self.texts[p["pid"]] for q in qids for p in self.qs[q]["passages"]})
        store = self.run.store(dy.COSINE)
        have = store.done()
        rows = []
        for q in qids:
            if self.qs[q]["split"] != "test" or have.get(q, {}).get("sha256") == self.sha256:
                continue
            pids = [p["pid"] for p in self.qs[q]["passages"]]
            rows.append({"id": q, "dyprag": mean_pairwise_cosine([self.generated[p] for p in pids]),
                         "prag": mean_pairwise_cosine([self.run.adapter(p) for p in pids]), "sha256": self.sha256})
        store.append(rows)

    def adapter(self, pid: str) -> LoraAdapter:
        """Passage ``pid``'s generated update (what a controller weighing DyPRAG's passages reads, as the shim)."""
        if pid not in self.generated:
            self._generate({pid: self.texts[pid]})
        return self.generated[pid]

    def composite(self, pids: Sequence[str], merge_weights: Sequence[float]) -> LoraAdapter:
        """A DyPRAG row's one update (``u = w~ / N``, :func:`fcprag_tools.translator.dyprag_adapter`) on the model's
        device."""
        out = dyprag_adapter([self.adapter(p) for p in pids], merge_weights)
        return out.to(next(self.run.model.parameters()).device)


def announce(run: StudyRun, part: TranslatorPart, given_controller: bool) -> None:
    """At the start, one line when the options leave no DyPRAG rows that a user might expect, or set training
    options no translator will be trained with."""
    if run.shard.rank:
        return
    if part.dyprag and given_controller and part.dyprag_translator is None:
        logger.info("--controller without --dyprag-translator: no training questions to train DyPRAG's translator on, "
                    "so no DyPRAG rows (give --dyprag-translator FILE to measure DyPRAG on every question)")
    elif (part.dyprag_translator is not None or not part.dyprag) and part.training() != TranslatorPart().training():
        logger.warning("--translator-epochs, --translator-lr and --translator-width apply to a translator the study "
                       "trains; with %s they are not used", "--dyprag-translator" if part.dyprag else "--no-dyprag")


def _record(run: StudyRun, export: Path, epochs: int, **fields: Any) -> dict[str, Any]:
    """Write ``translator.json`` for the export (its sha256, DyPRAG's flags: ``epochs`` names its file) and return
    it."""
    shape = shape_of(read_state_dict(export), export)
    rec = {**fields, "sha256": dy.sha256_of(export), "export": str(export.relative_to(run.out)),
           "dyprag_flags": dy.dyprag_flags(shape.width, epochs, shape.rank, ad.LORA["lora_alpha"]),
           "shape": shape.as_dict()}
    write_json(run.out / dy.TRANSLATOR_DIR / dy.RECORD, rec)
    logger.info("translator: %s; for DyPRAG's inference_dyprag.py copy %s into its projector/ and pass %s", export,
                export.parent, " ".join(f"--{k} {v}" for k, v in rec["dyprag_flags"].items()))
    return rec


def _given(run: StudyRun, part: TranslatorPart) -> dict[str, Any]:
    """``--dyprag-translator``'s file, exported (a byte copy) and recorded unless it already is."""
    path = Path(part.dyprag_translator or "")
    rec = dy.recorded(run.out)
    sha = dy.sha256_of(path)
    if rec is not None and rec.get("source") == "given" and rec.get("sha256") == sha and \
            (run.out / rec["export"]).is_file():
        run.kept("translator", 1, 1, "translator")
        return rec
    width = shape_of(read_state_dict(path), path).width
    export = copy_checkpoint(path, dy.export_path(run.out, width, 1))
    return _record(run, export, 1, source="given", file=str(path.resolve()), options=None, training=None)


def _trained(run: StudyRun, qs: Questions, augs: dict[str, dict[str, Any]], part: TranslatorPart,
             pids: list[str]) -> tuple[dict[str, Any], Any]:
    """The translator trained here on ``pids`` (resumed, or kept when recorded for these options), exported."""
    opts = part.training()
    rec = dy.recorded(run.out)
    if rec is not None and rec.get("source") == "trained" and rec.get("options") == dy.training_options(opts) and \
            (run.out / rec["export"]).is_file():
        run.kept("translator", 1, 1, "translator")
        return rec, None
    run.load_model()
    folder = run.out / dy.TRANSLATOR_DIR / dy.TRAIN_DIR
    with contextlib.ExitStack() as stack:
        bar: list[Any] = []

        def progress(done: int, total: int) -> None:
            if not bar:
                run.kept("translator", total, done, "steps")
                bar.append(stack.enter_context(run.bar("translator", total, done, "step")))
            else:
                bar[0].update(done - bar[0].n)

        translator, stats = train_translator(run.model, run.tok, {p: augs[p] for p in pids}, run.adapter, opts,
                                             folder, progress)
    export = copy_checkpoint(folder / "translator.pt", dy.export_path(run.out, opts.width, opts.epochs))
    hist = stats.get("history") or [{}]
    training = {"seconds": stats["seconds"], "passages": stats["passages"], "steps": stats["steps"],
                "first_loss": hist[0].get("loss"), "last_loss": hist[-1].get("loss"),
                "epoch_losses": stats["epoch_losses"], "folder": str(folder.relative_to(run.out))}
    return _record(run, export, opts.epochs, source="trained", file=str(folder / "translator.pt"),
                   options=dy.training_options(opts), training=training), translator


def translator_stage(run: StudyRun, qs: Questions, augs: dict[str, dict[str, Any]], part: TranslatorPart,
                     given_controller: bool) -> DypragSource | None:
    """The translator of the DyPRAG rows (None: no DyPRAG rows: ``--no-dyprag``, or ``--controller`` without
    ``--dyprag-translator``, or no training passage): ``part.dyprag_translator``, or one trained on the training
    questions' passages (``augs``: their augmentation rows; their adapters under ``OUT/adapters/``). Trained and
    exported on rank 0; the other ranks wait, then read the record."""
    if not part.dyprag or (given_controller and part.dyprag_translator is None):
        return None
    t0 = time.perf_counter()
    pids = list(dict.fromkeys(p["pid"] for q in qs.values() if q["split"] == "train" for p in q["passages"]))
    if part.dyprag_translator is None and not pids:
        logger.info("no training question: no translator is trained, so no DyPRAG rows")
        return None
    translator = None
    if run.shard.rank == 0:
        # a run killed mid-write leaves its temporaries: the export's folder is copied whole into DyPRAG's projector/
        for f in remove_stale_temporaries(run.out / dy.TRANSLATOR_DIR):
            logger.info("translator: removed %s, left by an interrupted run", f)
        if part.dyprag_translator is not None:
            rec = _given(run, part)
        else:
            rec, translator = _trained(run, qs, augs, part, pids)
    run.barrier()
    rec = dy.recorded(run.out) if run.shard.rank else rec
    run.timed("translator", t0, source=rec["source"], passages=len(pids), device=run.device())
    return DypragSource(run, qs, run.out / rec["export"], rec["sha256"], translator=translator)
