"""The stages of ``fcprag study``, each cached under ``OUT`` and resumable (a finished unit is never redone; every
file is appended a whole line at a time with fsync, or written through a temp file and renamed):

==========  =========================================================  ==========================================
stage       what                                                        cache (unit)
==========  =========================================================  ==========================================
retrieval   split (seeded, or ``train_ids``), BM25 top-k / a file      ``questions.jsonl`` (question)
augment     PRAG's augmentation by the model (:mod:`.augment`)          ``augment.jsonl`` (passage)
adapters    PRAG-recipe passage adapters, stacked (:mod:`.adapters`)    ``adapters/<pid>/``, ``adapters.jsonl``
labels      leave-one-out + scale labels, training questions            ``labels.jsonl`` (question; label builder)
controller  ``fcprag_plugin.training.train_controller`` (nested CV)     ``train/learned/`` (the run)
evaluate    held-out rows by real forwards, mixed batches               ``eval.jsonl`` (question x method)
summary     ``summary.json``, ``report.md``, ``controller/``            (seconds)
==========  =========================================================  ==========================================

With ``controller`` (``--controller DIR``) the labels and controller stages are skipped and every question is
evaluated. Under ``torchrun`` rank ``r`` of ``W`` takes every ``W``-th unit of the augment, adapters, labels and
evaluate stages (part files, merged by rank 0 after a barrier); training and the summary run on rank 0.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import write_json
from ..lm.shard import ShardInfo, init_process_group, shard_from_env
from . import adapters as ad
from . import data, preflight, scoring, summary
from .augment import augment_batch, forward_steps
from ..lm.units import UnitStore, log_timing

logger = logging.getLogger(__name__)
W_TOL = 1e-5
ORACLE_T = 0.1  # the trainer's default label temperature: the oracle's w~ = N softmax(delta / 0.1)


@dataclass
class StudyOptions:
    """``fcprag study``'s options (the CLI's flags, same names)."""

    questions: Sequence[str]  # question files (one path: a file)
    model: str | None  # a name or folder; "smollm2" or None: the packaged offline SmolLM2 (model_io.resolve_model)
    out: str
    gguf_file: str | None = None
    device: str = "auto"
    dtype: str = "auto"
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
    aug_batch: int | None = None  # None: 8 on a CPU, 64 on a GPU (measured: docs/results/gpu.md)
    group: int = 16
    max_tokens: int = 128
    batch_size: int | None = None  # None: 16 on a CPU, 64 on a GPU
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


class Study:
    """One study folder: the stages as methods, run in order by :meth:`run`."""

    def __init__(self, opts: StudyOptions, shard: ShardInfo | None = None) -> None:
        opts.validate()
        self.o, self.out = opts, Path(opts.out)
        self.shard = shard or shard_from_env()
        self.model: Any = None
        self.tok: Any = None
        self._adapters: dict[str, Any] = {}
        self.times: dict[str, float] = {}
        self.selection: preflight.Selection | None = None  # the questions, once preflight has read them
        self.complete = False  # run() found the study finished and rebuilt nothing

    # ------------------------------------------------------------------ helpers
    def store(self, name: str) -> UnitStore:
        return UnitStore(self.out / f"{name}.jsonl", self.shard)

    def barrier(self, *merge: str) -> None:
        """Wait for every rank, then rank 0 folds the part files of ``merge`` stores into their main files."""
        if self.shard.distributed and init_process_group(self.shard):
            import torch.distributed as dist

            dist.barrier()
            if self.shard.rank == 0:
                for name in merge:
                    self.store(name).merge()
            dist.barrier()

    def mine(self, units: list[Any]) -> list[Any]:
        """This rank's share of ``units`` (every ``world``-th, round robin)."""
        return units[self.shard.rank::self.shard.world]

    def bar(self, stage: str, total: int, done: int, unit: str, mine: int | None = None,
            fraction: bool = False) -> Any:
        """A progress bar with units done, rate and an estimate: ``done`` of ``total`` units in one process; this
        rank's ``mine`` under a launcher. ``fraction``: it also moves inside a batch (:meth:`inside`)."""
        if self.shard.distributed and mine is not None:
            total, done = mine, 0
        n = "{n:.1f}" if fraction else "{n_fmt}"
        return tqdm(total=total, initial=done, desc=stage, unit=unit, dynamic_ncols=True, disable=not self.o.progress,
                    position=self.shard.rank, bar_format="{l_bar}{bar}| " + n + "/{total_fmt} [{elapsed}<{remaining}, "
                                                         "{rate_fmt}{postfix}]")

    @staticmethod
    def inside(bar: Any, units: int, steps: int) -> tuple[Any, Any]:
        """``(step, finish)``: ``step()`` moves ``bar`` by ``units / steps`` (one of about ``steps`` model forwards
        of a batch of ``units``), never to the batch's end; ``finish()`` at the batch's end moves it the rest."""
        per, moved = units / max(steps, 1), [0.0]

        def step() -> None:
            if moved[0] + per < units:
                bar.update(per)
                moved[0] += per

        def finish() -> None:
            bar.update(units - moved[0])
            bar.n = round(bar.n, 6)

        return step, finish

    def kept(self, stage: str, total: int, done: int, unit: str) -> None:
        """On a resumed stage, one line: how many units it keeps and how many are left."""
        if done and self.shard.rank == 0:
            left = f"{total - done} to do" if total > done else "nothing to do"
            logger.info("%s: %d of %d %s kept, %s", stage, done, total, unit, left)

    def timed(self, stage: str, t0: float, **info: Any) -> None:
        secs = time.perf_counter() - t0
        self.times[stage] = self.times.get(stage, 0.0) + secs
        if self.shard.rank == 0:
            log_timing(self.out, stage, secs, **info)

    def check_settings(self) -> dict[str, Any]:
        """Write ``OUT/settings.json`` on a fresh folder; on a resumed one, refuse another value of
        :data:`.preflight.FIXED`."""
        now = preflight.settings_of(self.o)
        path = self.out / preflight.SETTINGS
        if path.is_file():
            preflight.compare_settings(self.out, json.loads(path.read_text(encoding="utf-8")), now)
        elif self.shard.rank == 0:
            write_json(path, now)
        return now

    def load_model(self) -> None:
        if self.model is not None:
            return
        from ..lm.model_io import load_model

        self.model, self.tok = load_model(self.o.model, gguf_file=self.o.gguf_file, dtype=self.o.dtype,
                                          device=self.o.device, local_rank=self.shard.local_rank, progress=False)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if not ad.target_linears(self.model, ad.LORA["target_modules"]):
            raise FcpragError(f"--model {self.o.model}: no Linear layer named "
                              f"{'/'.join(ad.LORA['target_modules'])}, the modules PRAG's LoRA recipe targets; choose "
                              "a model with a gated MLP (Llama, Qwen2, Mistral, ...)")

    @property
    def device(self) -> str:
        return str(next(self.model.parameters()).device) if self.model is not None else self.o.device

    def per_device(self, given: int | None, cpu: int, gpu: int) -> int:
        """``given``, else the default for where the model runs: batching pays more on a GPU, whose small batches
        are bound by kernel launches (augmentation: 2 passages/s at 8 per call, 16 at 64 on one H200)."""
        if given is not None:
            return given
        from ..lm.model_io import resolve_device

        return cpu if resolve_device(self.o.device, self.shard.local_rank).type == "cpu" else gpu

    @property
    def batch_size(self) -> int:
        """Sequences per scoring forward (labels and evaluation)."""
        return self.per_device(self.o.batch_size, 16, 64)

    def adapter(self, pid: str) -> Any:
        from fcprag_plugin.adapter import LoraAdapter

        if pid not in self._adapters:
            self._adapters[pid] = LoraAdapter.from_pretrained(self.out / "adapters" / pid,
                                                              device=next(self.model.parameters()).device)
        return self._adapters[pid]

    # ------------------------------------------------------------------ stages
    def retrieval(self) -> dict[str, dict[str, Any]]:
        t0 = time.perf_counter()
        sel = self.selection or preflight.select_questions(self.o)
        qs, given, test = sel.questions, sel.given, sel.test
        st = self.store("questions")
        done = st.done()
        todo = [q for q in qs if q["id"] not in done]
        self.kept("retrieval", len(qs), len(qs) - len(todo), "questions")
        if todo and self.shard.rank == 0:
            with self.bar("retrieval", len(qs), len(qs) - len(todo), "q") as bar:
                for q in todo:
                    st.append([{"id": q["id"], "question": q["question"], "answers": q["answers"],
                                "split": "test" if q["id"] in test else "train", "dataset": q["dataset"],
                                "subtask": q["subtask"],
                                "passages": data.retrieve(q, self.o.top_k, given and given[q["id"]])}])
                    bar.update(1)
        self.barrier("questions")
        rows = st.done()
        self.timed("retrieval", t0, questions=len(todo))
        # rows cached before datasets were recorded take them from the question files
        return {q["id"]: {"dataset": q["dataset"], "subtask": q["subtask"], **rows[q["id"]]} for q in qs}

    def augment(self, qs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        t0 = time.perf_counter()
        st = self.store("augment")
        done = st.done()
        texts = {p["pid"]: p["text"] for q in qs.values() for p in q["passages"]}
        todo = sorted((pid for pid in texts if pid not in done), key=lambda p: (len(texts[p]), p))
        self.kept("augmentation", len(texts), len(texts) - len(todo), "passages")
        per = self.per_device(self.o.aug_batch, 8, 64)
        batches = self.mine([todo[i:i + per] for i in range(0, len(todo), per)])
        self.barrier()
        if batches:
            self.load_model()
            with self.bar("augment", len(texts), len(texts) - len(todo), "passage", sum(map(len, batches)),
                          fraction=True) as bar:
                for b in batches:
                    step, finish = self.inside(bar, len(b), self.o.aug_max_new_tokens)  # a step per token
                    st.append(augment_batch(self.model, self.tok, [(p, texts[p]) for p in b],
                                            self.o.aug_max_new_tokens, on_step=step))
                    finish()
        self.barrier("augment")
        self.timed("augment", t0, passages=sum(map(len, batches)), device=self.device)
        return self.store("augment").done()

    def adapters(self, qs: dict[str, dict[str, Any]], augs: dict[str, dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        st = self.store("adapters")
        folder = self.out / "adapters"
        done = {pid for pid in st.done() if (folder / pid / "adapter_model.safetensors").is_file()}
        pids = list(dict.fromkeys(p["pid"] for q in qs.values() for p in q["passages"]))
        todo = [p for p in pids if p not in done]
        self.kept("adapters", len(pids), len(pids) - len(todo), "adapters")
        if todo:
            self.load_model()
        samples = {p: ad.samples_for(self.tok, augs[p], self.o.max_tokens) for p in todo}
        todo.sort(key=lambda p: (max(len(s[0]) for s in samples[p].values()), p))  # similar lengths per step
        groups = self.mine([todo[i:i + self.o.group] for i in range(0, len(todo), self.o.group)])
        self.barrier()
        config = dict(ad.LORA, task_type="CAUSAL_LM", base_model_name_or_path=self.o.model)
        with self.bar("adapters", len(pids), len(pids) - len(todo), "adapter", sum(map(len, groups)),
                      fraction=True) as bar:
            for g in groups:
                tg = time.perf_counter()
                seeds = [ad.seed_of(p) for p in g]
                step, finish = self.inside(bar, len(g), len({k for p in g for k in samples[p]}))  # a step per kind
                with forward_steps(self.model.get_decoder(), step):
                    ml, stats = ad.train_stacked(self.model, self.tok, [samples[p] for p in g], seeds)
                secs = round(time.perf_counter() - tg, 3)
                for b, p in enumerate(g):
                    ad.save_adapter(ml.adapter(b, config), folder / p)
                st.append([{"id": p, "seed": seeds[b], **stats[b], "group": len(g), "group_seconds": secs}
                           for b, p in enumerate(g)])
                finish()
        self.barrier("adapters")
        self.timed("adapters", t0, adapters=sum(map(len, groups)), group=self.o.group, device=self.device)

    def labels(self, qs: dict[str, dict[str, Any]]) -> Path:
        from ..label_builder.builder import BuildOptions, LabelBuilder, build_labels
        from ..label_builder.manifest import ManifestRecord

        t0 = time.perf_counter()
        path = self.out / "labels.jsonl"
        st = self.store("labels")
        done = st.done()
        recs = [ManifestRecord(qid, q["question"], q["answers"], [p["text"] for p in q["passages"]],
                               [self.out / "adapters" / p["pid"] for p in q["passages"]], source=str(path),
                               extra={"group": qid, "retrieval_ranks": [p["rank"] for p in q["passages"]]})
                for qid, q in qs.items() if q["split"] == "train"]
        self.kept("labels", len(recs), sum(r.id in done for r in recs), "training questions")
        mine = self.mine([r for r in recs if r.id not in done])
        self.barrier()
        if mine:
            self.load_model()
            opts = BuildOptions(generate=self.o.generate, max_new_tokens=self.o.max_new_tokens, scoring="prag",
                                empty_generation="zero", batch_size=self.batch_size, metric="answer_logprob",
                                scales=(1.0, *sorted(self.o.scales)), model_name=self.o.model)
            builder = LabelBuilder(self.model, self.tok, opts)
            try:
                build_labels(mine, builder, st.target, progress=self.o.progress, desc="labels",
                             position=self.shard.rank)
            finally:
                builder.close()
        self.barrier("labels")
        self.timed("labels", t0, records=len(mine), device=self.device)
        return path

    def trainer_kwargs(self, n_labels: int) -> dict[str, Any]:
        """What the study passes to ``train_controller`` for ``n_labels`` label records (the user's train args win)."""
        return {"kappa": "auto", "objective": "risk", "keep_network": True, "seed": self.o.seed,
                "cv_folds": min(self.o.cv_folds, n_labels) if n_labels >= 4 else 0, **self.o.train_args}

    def warn_if_too_few(self, qs: dict[str, dict[str, Any]]) -> None:
        """Before any work: say so when too few training questions leave the risk rule no scale to allow."""
        from fcprag_plugin.training import TrainArgs

        if self.o.controller or self.shard.rank:
            return
        n_train = sum(q["split"] == "train" for q in qs.values())
        args = {**vars(TrainArgs()), **self.trainer_kwargs(n_train)}
        need = summary.rule_starved(args, n_train)
        if need:
            share, tf = args["scale_max_loss_share"], self.o.test_fraction
            more = f"at least {need} ids in --train-ids" if self.o.train_ids else \
                f"about {math.ceil(need / (1 - tf))} questions at --test-fraction {tf:g}, or a smaller fraction"
            logger.warning("%d training questions: too few for the risk rule to allow any scale (the 95%% upper bound "
                           "of a %g loss share stays above it even at zero losses below about %d), so this study "
                           "will keep PRAG's sum whatever its held-out rows show; for a scale, give it more (%s)",
                           n_train, share, need, more)

    def train(self, labels: Path) -> Path:
        """The learned controller (``train/learned/``): nested CV choosing epochs and kappa (on measured scales),
        the network always kept so that the evaluation can measure its reweighting."""
        from fcprag_plugin.training import train_controller

        t0 = time.perf_counter()
        where = self.out / "train" / "learned"
        marker = self.out / "train" / "done.json"
        self.kept("controller", 1, int(marker.is_file()), "trained controller")
        if self.shard.rank == 0 and not marker.is_file():
            n = len(self.store("labels").done())
            kwargs = self.trainer_kwargs(n)
            train_controller(labels, where, encoder=self.o.encoder, overwrite=True, progress=self.o.progress,
                             **kwargs)
            write_json(marker, {"labels": n, "args": kwargs})
        self.barrier()
        self.timed("controller", t0)
        return where

    # ------------------------------------------------------------------ evaluation
    def methods(self, q: dict[str, Any], ctrl: Any, kappa: float) -> dict[str, list[float]]:
        """``{row name: w~ per passage}`` for one question (all but the oracle and arrow)."""
        from fcprag_plugin.controller import query_weights
        from fcprag_plugin.weights import is_uniform, side_inputs

        n = len(q["passages"])
        rows = {"prag_sum": [1.0] * n, "average": [1.0 / n] * n}
        for s in sorted({*self.o.scales, kappa} - {1.0}):
            rows[f"scale:{s:g}"] = [float(s)] * n
        for i in range(n):
            rows[f"loo:{i}"] = [0.0 if j == i else 1.0 for j in range(n)]
        if ctrl is not None and not is_uniform(ctrl):
            ps = q["passages"]
            side = side_inputs(ctrl, adapters=lambda: [self.adapter(p["pid"]) for p in ps],
                               retrieval_ranks=[float(p["rank"]) for p in ps],
                               retrieval_scores=[float(p["score"]) for p in ps])
            with torch.no_grad():
                w = [float(x) for x in query_weights(ctrl, q["question"], [p["text"] for p in ps],
                                                     self.query_encoder(), side).merge_weights]
            rows["learned"], rows["learned_same_total"] = w, [sum(w) / n] * n
        return rows

    def query_encoder(self) -> Any:
        """``--encoder`` as an encoder object (a name or path is loaded once); None: the controller's own model."""
        if isinstance(self.o.encoder, (str, Path)):
            from fcprag_plugin.encoding import get_encoder

            return get_encoder(self.o.encoder)  # cached by the library: loaded once per process
        return self.o.encoder

    def evaluate(self, qs: dict[str, dict[str, Any]], ctrl: Any, kappa: float) -> dict[str, dict[str, Any]]:
        from fcprag_plugin.slot import FusedSlot

        t0 = time.perf_counter()
        st = self.store("eval")
        test = [qid for qid, q in qs.items() if q["split"] == "test"]
        want = {qid: self.methods(qs[qid], ctrl, kappa) for qid in test}

        def valid(done: dict[str, dict[str, Any]], qid: str, name: str, w: list[float] | None) -> bool:
            r = done.get(f"{qid}|{name}")
            if r is None or r.get("pids") != [p["pid"] for p in qs[qid]["passages"]]:
                return False
            return w is None or (r.get("w") is not None and len(r["w"]) == len(w)
                                 and all(abs(a - b) <= W_TOL for a, b in zip(r["w"], w)))

        done = st.done()
        todo = [qid for qid in test if not all(valid(done, qid, n, w) for n, w in want[qid].items())
                or f"{qid}|oracle" not in done]
        self.kept("evaluation", len(test), len(test) - len(todo), "held-out questions")
        chunks = self.mine([todo[i:i + self.o.chunk] for i in range(0, len(todo), self.o.chunk)])
        use_arrow, why = scoring.arrow_status()
        use_arrow = use_arrow and self.o.arrow
        arrow_todo = self.mine([q for q in test if use_arrow and not valid(done, q, "arrow", None)])
        self.barrier()  # every rank has read the same state before any writes
        if chunks or arrow_todo:
            self.load_model()
        with self.bar("evaluate", len(test), len(test) - len(todo), "q", sum(map(len, chunks))) as bar:
            for chunk in chunks:
                pids = [p["pid"] for qid in chunk for p in qs[qid]["passages"]]
                slot = FusedSlot.for_model(self.model, self.adapter(pids[0]), max_adapters=len(pids),
                                           max_rank=ad.LORA["r"])
                try:
                    rows = [scoring.Row(qid, n, [p["pid"] for p in qs[qid]["passages"]], w)
                            for qid in chunk for n, w in want[qid].items() if not valid(done, qid, n, w)]
                    res = scoring.score(self.model, self.tok, slot, rows, qs, self.adapter,
                                        generate=self.o.generate, max_new_tokens=self.o.max_new_tokens,
                                        batch_size=self.batch_size) if rows else []
                    st.append(res)
                    done.update({r["id"]: r for r in res})
                    orows = [scoring.Row(qid, "oracle", [p["pid"] for p in qs[qid]["passages"]],
                                         self.oracle(done, qid, len(qs[qid]["passages"]))) for qid in chunk]
                    res = scoring.score(self.model, self.tok, slot, orows, qs, self.adapter,
                                        generate=self.o.generate, max_new_tokens=self.o.max_new_tokens,
                                        batch_size=self.batch_size)
                    st.append(res)
                finally:
                    slot.remove()
                bar.update(len(chunk))
        if arrow_todo:
            with self.bar("arrow", len(arrow_todo), 0, "q") as bar:
                for qid in arrow_todo:
                    st.append([scoring.score_arrow(self.model, self.tok, qid, qs[qid],
                                                   [p["pid"] for p in qs[qid]["passages"]],
                                                   lambda p: self.out / "adapters" / p, generate=self.o.generate,
                                                   max_new_tokens=self.o.max_new_tokens)])
                    bar.update(1)
        self.barrier("eval")
        self.timed("evaluate", t0, questions=sum(map(len, chunks)), arrow=use_arrow, device=self.device)
        self.arrow_why = why if not use_arrow else None
        return self.store("eval").done()

    @staticmethod
    def oracle(done: dict[str, dict[str, Any]], qid: str, n: int) -> list[float]:
        """``w~ = N softmax(delta / 0.1)`` from this question's own ``prag_sum`` and ``loo:i`` log-liks. (it reads
        the answer: a reference, not a method)."""
        full = done[f"{qid}|prag_sum"]["logprob"]
        deltas = torch.tensor([full - done[f"{qid}|loo:{i}"]["logprob"] for i in range(n)])
        return [round(float(x), 6) for x in n * torch.softmax(deltas / ORACLE_T, 0)]

    # ------------------------------------------------------------------ the whole run
    def run(self) -> dict[str, Any] | None:
        from fcprag_plugin import FusionController

        t_all = time.perf_counter()
        # every check before the folder exists: a mistake is one line and leaves nothing behind
        checked = preflight.check(self.o, rank=self.shard.rank, local_rank=self.shard.local_rank,
                                  distributed=self.shard.distributed)
        if checked.summary is not None:  # finished, and nothing it was built from has changed: no model, no rebuild
            self.complete = True
            logger.info("%s: the study is complete (summary.json is newer than every cache and the settings match); "
                        "its verdict, as recorded:", self.out)
            return checked.summary if self.shard.rank == 0 else None
        self.selection = checked.selection
        preflight.set_threads(self.o, self.shard)
        self.out.mkdir(parents=True, exist_ok=True)
        settings = self.check_settings()
        qs = self.retrieval()
        self.warn_if_too_few(qs)
        augs = self.augment(qs)
        self.adapters(qs, augs)
        if self.o.controller is None:
            learned_dir = self.train(self.labels(qs))
        else:
            learned_dir = Path(self.o.controller)
        ctrl = FusionController.from_pretrained(learned_dir).eval()
        kappa = float(ctrl.config.kappa)
        results = self.evaluate(qs, ctrl, kappa)
        if self.shard.rank != 0:
            return None
        t0 = time.perf_counter()
        out = summary.finish(self, qs, results, ctrl, learned_dir, kappa, settings)
        self.timed("summary", t0)
        log_timing(self.out, "total (this invocation)", time.perf_counter() - t_all)
        return out


def run_study(opts: StudyOptions) -> dict[str, Any] | None:
    """Run (or resume) a study; returns ``summary.json``'s content (None on ranks other than 0)."""
    return Study(opts).run()
