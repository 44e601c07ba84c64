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
from fcprag_plugin.weights import is_uniform
from fcprag_plugin.fileio import write_json
from ..lm.shard import ShardInfo, init_process_group, shard_from_env
from . import adapters as ad
from . import data, preflight, scoring, summary
from .summary import SETTINGS, suffix
from .augment import augment_batch, forward_steps
from .ceiling import gold_rows
from ..lm.units import UnitStore, log_timing

logger = logging.getLogger(__name__)
W_TOL = 1e-5


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
    policy: Any = None  # summary.Policy: the margins and target effect of the verdict (None: its defaults)

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
        self._sizes: Any = None
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
    def inside(bar: Any, units: int, steps: float) -> tuple[Any, Any]:
        """``(step, finish)``: ``step(k=1)`` moves ``bar`` by ``k * units / steps`` (``k`` of about ``steps`` model
        forwards, or rows, of a batch of ``units``), never to the batch's end; ``finish()`` at the batch's end moves
        it the rest."""
        per, moved = units / max(steps, 1), [0.0]

        def step(k: float = 1.0) -> None:
            if moved[0] + per * k < units:
                bar.update(per * k)
                moved[0] += per * k

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

    @property
    def sizes(self) -> Any:
        """The batch sizes the user did not give, from the device and its free memory after the model is loaded
        (:func:`fcprag_tools.lm.sizing.default_batches`; asked for only by a stage that has work)."""
        if self._sizes is None:
            from ..lm.model_io import resolve_device
            from ..lm.sizing import default_batches

            dev = resolve_device(self.o.device, self.shard.local_rank)
            if dev.type == "cuda":
                self.load_model()
            self._sizes = default_batches(dev, self.model if dev.type == "cuda" else None)
            logger.info("batch sizes: %s", self._sizes.why)
        return self._sizes

    @property
    def batch_size(self) -> int:
        """Sequences per scoring forward (labels and evaluation)."""
        return self.o.batch_size or self.sizes.batch_size

    def adapter(self, pid: str) -> Any:
        from fcprag_plugin.adapter import LoraAdapter

        if self.model is None:  # read before any scoring (a controller's recipe check): on the CPU, not kept
            return LoraAdapter.from_pretrained(self.out / "adapters" / pid)
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
                                "subtask": q["subtask"], "supporting_titles": q["supporting"],
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
        mine = self.mine(todo)  # shard units first: each rank sizes its batches for its own device
        per = (self.o.aug_batch or self.sizes.aug_batch) if mine else 1
        batches = [mine[i:i + per] for i in range(0, len(mine), per)]
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
        mine = self.mine(todo)
        group = (self.o.group or self.sizes.group) if mine else 1
        groups = [mine[i:i + group] for i in range(0, len(mine), group)]
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
        self.timed("adapters", t0, adapters=sum(map(len, groups)), group=group, device=self.device)

    def labels(self, qs: dict[str, dict[str, Any]], setting: str = "param") -> Path:
        """Leave-one-out and scale labels of the training questions in ``setting``'s prompt (``labels.jsonl``,
        ``labels_combine.jsonl``). The Combine labels skip the greedy answers: the trainer learns from the gold
        log-lik., and answers under the long Combine prompt would cost as much as the labels themselves."""
        from ..label_builder.builder import BuildOptions, LabelBuilder, build_labels
        from ..label_builder.manifest import ManifestRecord

        t0 = time.perf_counter()
        name = "labels" + suffix(setting)
        path = self.out / f"{name}.jsonl"
        st = self.store(name)
        done = st.done()
        recs = [ManifestRecord(qid, q["question"], q["answers"], [p["text"] for p in q["passages"]],
                               [self.out / "adapters" / p["pid"] for p in q["passages"]], source=str(path),
                               extra={"group": qid, "retrieval_ranks": [p["rank"] for p in q["passages"]]})
                for qid, q in qs.items() if q["split"] == "train"]
        self.kept(name, len(recs), sum(r.id in done for r in recs), "training questions")
        mine = self.mine([r for r in recs if r.id not in done])
        self.barrier()
        if mine:
            self.load_model()
            opts = BuildOptions(prompt_mode=setting, generate=self.o.generate and setting == "param",
                                max_new_tokens=self.o.max_new_tokens, scoring="prag", empty_generation="zero",
                                batch_size=self.batch_size, metric="answer_logprob",
                                scales=(1.0, *sorted(self.o.scales)), model_name=self.o.model)
            builder = LabelBuilder(self.model, self.tok, opts)
            try:
                build_labels(mine, builder, st.target, progress=self.o.progress, desc=name,
                             position=self.shard.rank)
            finally:
                builder.close()
        self.barrier(name)
        self.timed(name, t0, records=len(mine), device=self.device)
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

    def train(self, labels: Path, setting: str = "param") -> Path:
        """The learned controller of ``setting`` (``train/learned{,_combine}/``): nested CV choosing epochs and kappa
        (on measured scales), the network always kept so that the evaluation can measure its reweighting."""
        from fcprag_plugin.training import train_controller

        t0 = time.perf_counter()
        where = self.out / "train" / ("learned" + suffix(setting))
        marker = self.out / "train" / f"done{suffix(setting)}.json"
        self.kept("controller" + suffix(setting), 1, int(marker.is_file()), "trained controller")
        if self.shard.rank == 0 and not marker.is_file():
            n = len(self.store(labels.stem).done())
            kwargs = self.trainer_kwargs(n)
            train_controller(labels, where, encoder=self.o.encoder, overwrite=True, progress=self.o.progress,
                             **kwargs)
            write_json(marker, {"labels": n, "args": kwargs})
        self.barrier()
        self.timed("controller" + suffix(setting), t0)
        return where

    # ------------------------------------------------------------------ evaluation
    def weights(self, q: dict[str, Any], ctrl: Any) -> list[float]:
        """``ctrl``'s ``w~`` for question ``q`` (its retrieval ranks and scores, its adapters when it reads them)."""
        from fcprag_plugin.weights import weigh

        ps = q["passages"]
        with torch.no_grad():
            return [float(x) for x in weigh(ctrl, q["question"], [p["text"] for p in ps], encoder=self.query_encoder(),
                                            adapters=lambda: [self.adapter(p["pid"]) for p in ps],
                                            retrieval_ranks=[float(p["rank"]) for p in ps],
                                            retrieval_scores=[float(p["score"]) for p in ps]).merge_weights]

    def methods(self, q: dict[str, Any], ctrls: dict[str, Any]) -> dict[str, tuple[str, list[float]]]:
        """``{row name: (prompt, w~ per passage)}`` of one held-out question before any verdict (all but the oracle,
        Arrow and the rows that depend on what ships). ``ctrls``: each setting's controller."""
        n = len(q["passages"])
        rows: dict[str, tuple[str, list[float]]] = {"vanilla": ("param", [0.0] * n),
                                                    "standard_rag": ("combine", [0.0] * n)}
        for setting, ctrl in ctrls.items():
            sfx, kappa = suffix(setting), float(ctrl.config.kappa)
            rows["prag_sum" + sfx] = (setting, [1.0] * n)
            if setting == "param":  # the parametric setting's descriptive rows
                rows["average"] = (setting, [1.0 / n] * n)
                for s in sorted({*self.o.scales, kappa} - {1.0}):
                    rows[f"scale:{s:g}"] = (setting, [float(s)] * n)
                for i in range(n):
                    rows[f"loo:{i}"] = (setting, [0.0 if j == i else 1.0 for j in range(n)])
            elif kappa != 1.0:  # the Combine setting's scale part
                rows[f"scale:{kappa:g}{sfx}"] = (setting, [kappa] * n)
            if not is_uniform(ctrl):
                w = self.weights(q, ctrl)
                rows["learned" + sfx], rows["learned_same_total" + sfx] = (setting, w), (setting, [sum(w) / n] * n)
        rows.update(gold_rows(q, list(ctrls)))  # the gold-passage ceiling (absent without supporting titles)
        return rows

    def query_encoder(self) -> Any:
        """``--encoder`` as an encoder object (a name or path is loaded once); None: the controller's own model."""
        if isinstance(self.o.encoder, (str, Path)):
            from fcprag_plugin.encoding import get_encoder

            return get_encoder(self.o.encoder)  # cached by the library: loaded once per process
        return self.o.encoder

    def evaluate(self, qs: dict[str, dict[str, Any]], want: dict[str, dict[str, tuple[str, list[float]]]], *,
                 oracle: bool = False, arrow: bool = False, desc: str = "evaluate") -> dict[str, dict[str, Any]]:
        """Score the rows ``want`` (``{qid: {name: (prompt, w~)}}``) that ``eval.jsonl`` does not hold yet, by
        real forwards in mixed batches; with ``oracle``, each question's oracle row after its leave-one-out rows;
        with ``arrow``, PEFT's Arrow router row. Returns every scored row of the store."""
        from fcprag_plugin.slot import FusedSlot

        t0 = time.perf_counter()
        st = self.store("eval")

        def valid(done: dict[str, dict[str, Any]], qid: str, name: str, spec: tuple[str, list[float]] | None) -> bool:
            r = done.get(f"{qid}|{name}")
            if r is None or r.get("pids") != [p["pid"] for p in qs[qid]["passages"]]:
                return False
            if spec is None:
                return True
            prompt, w = spec
            return (r.get("prompt", "param") == prompt and r.get("w") is not None and len(r["w"]) == len(w)
                    and all(abs(a - b) <= W_TOL for a, b in zip(r["w"], w)))

        done = st.done()
        qids = list(want)
        todo = [qid for qid in qids if not all(valid(done, qid, n, s) for n, s in want[qid].items())
                or (oracle and f"{qid}|oracle" not in done)]
        self.kept(desc, len(qids), len(qids) - len(todo), "questions")
        chunks = self.mine([todo[i:i + self.o.chunk] for i in range(0, len(todo), self.o.chunk)])
        use_arrow = self.o.arrow and arrow
        arrow_todo = self.mine([q for q in qids if use_arrow and not valid(done, q, "arrow", None)])
        self.barrier()  # every rank has read the same state before any writes
        if chunks or arrow_todo:
            self.load_model()
        with self.bar(desc, len(qids), len(qids) - len(todo), "q", sum(map(len, chunks)), fraction=True) as bar:
            for chunk in chunks:
                pids = [p["pid"] for qid in chunk for p in qs[qid]["passages"]]
                slot = FusedSlot.for_model(self.model, self.adapter(pids[0]), max_adapters=len(pids),
                                           max_rank=ad.LORA["r"])
                rows = [scoring.Row(qid, n, [p["pid"] for p in qs[qid]["passages"]], w, prompt)
                        for qid in chunk for n, (prompt, w) in want[qid].items()
                        if not valid(done, qid, n, (prompt, w))]
                # the bar moves after every forward: a share of a call is that share of its rows
                step, finish = self.inside(bar, len(chunk), len(rows) + (len(chunk) if oracle else 0))

                def run(part: list[scoring.Row]) -> None:
                    res = scoring.score(self.model, self.tok, slot, part, qs, self.adapter, generate=self.o.generate,
                                        max_new_tokens=self.o.max_new_tokens, batch_size=self.batch_size,
                                        on_progress=lambda share: step(share * len(part))) if part else []
                    st.append(res)
                    done.update({r["id"]: r for r in res})

                try:
                    run(rows)
                    if oracle:
                        run([scoring.Row(qid, "oracle", [p["pid"] for p in qs[qid]["passages"]],
                                         self.oracle(done, qid, len(qs[qid]["passages"]))) for qid in chunk])
                finally:
                    slot.remove()
                finish()
        if arrow_todo:
            per = max(self.o.chunk, self.batch_size)  # many questions per call, batched like the other rows
            with self.bar("arrow", len(arrow_todo), 0, "q") as bar:
                for i in range(0, len(arrow_todo), per):
                    part = arrow_todo[i:i + per]
                    st.append(scoring.score_arrow_rows(
                        self.model, self.tok, [(q, qs[q], [p["pid"] for p in qs[q]["passages"]]) for q in part],
                        self.adapter, generate=self.o.generate, max_new_tokens=self.o.max_new_tokens,
                        batch_size=self.batch_size))
                    bar.update(len(part))
        self.barrier("eval")
        self.timed(desc, t0, questions=sum(map(len, chunks)), arrow=use_arrow, device=self.device)
        if arrow:
            self.arrow_why = None if use_arrow else "--no-arrow"
        return self.store("eval").done()

    @staticmethod
    def oracle(done: dict[str, dict[str, Any]], qid: str, n: int) -> list[float]:
        """``w~ = N softmax(delta / T)`` (``T``: the trainer's label temperature) from this question's own
        ``prag_sum`` and ``loo:i`` log-liks. (it reads the answer: a reference, not a method)."""
        from fcprag_plugin.training import TrainArgs

        full = done[f"{qid}|prag_sum"]["logprob"]
        deltas = torch.tensor([full - done[f"{qid}|loo:{i}"]["logprob"] for i in range(n)])
        return [round(float(x), 6) for x in n * torch.softmax(deltas / TrainArgs().t_label, 0)]

    # ------------------------------------------------------------------ the whole run
    def controllers(self, qs: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Path]]:
        """Each setting's controller and its folder: trained on that setting's labels, or the given one in both."""
        from fcprag_plugin import FusionController

        dirs = {s: Path(self.o.controller) for s in SETTINGS} if self.o.controller else \
            {s: self.train(self.labels(qs, s), s) for s in SETTINGS}
        ctrls = {s: FusionController.from_pretrained(d).eval() for s, d in dirs.items()}
        if not self.o.controller:  # its first-order training verdict is not news: the study measures it held out
            for c in ctrls.values():
                c.warn_if_unproven(quiet=True)
        return ctrls, dirs

    def run(self) -> dict[str, Any] | None:
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
        ctrls, dirs = self.controllers(qs)
        test = [qid for qid, q in qs.items() if q["split"] == "test"]
        results = self.evaluate(qs, {qid: self.methods(qs[qid], ctrls) for qid in test}, oracle=True, arrow=True)
        given = self.o.controller is not None
        verdicts = {s: summary.setting_verdict(results, test, s, ctrls[s], given=given,
                                               trainer_args=self.trainer_args(dirs[s]), n_train=len(qs) - len(test),
                                               policy=self.o.policy)
                    for s in SETTINGS}
        # the rows that depend on what ships: the random controller at the recommended kappa (held out), and the
        # candidates of "what to run" on the training questions (where the choice is made)
        shipped = {s: summary.shipped_controller(verdicts[s], ctrls[s]) for s in SETTINGS}
        recommended = ctrls if given else shipped
        extra = {qid: self.random_rows(qs[qid], recommended) for qid in test}
        for qid in (q for q in qs if qs[q]["split"] == "train"):
            extra[qid] = self.candidate_rows(qs[qid], recommended, verdicts)
        results = self.evaluate(qs, extra, desc="evaluate (after the verdict)")
        if self.shard.rank != 0:
            return None
        t0 = time.perf_counter()
        for s in SETTINGS:
            self.save_controller(s, shipped[s], qs)
        out = summary.finish(qs, results, verdicts, given=given, settings={
            **settings, "out": str(self.out), "device": self.device, "dtype": self.dtype,
            "controller_trained": not given,
            "arrow": "scored" if all(f"{q}|arrow" in results for q in test) else getattr(self, "arrow_why", None)
            or "off", "learned_dir": {s: str(d) for s, d in dirs.items()}}, cv={s: c.config.cv for s, c in
                                                                                 ctrls.items()},
            stage_seconds={k: round(v, 1) for k, v in self.times.items()}, out=self.out, policy=self.o.policy)
        self.timed("summary", t0)
        log_timing(self.out, "total (this invocation)", time.perf_counter() - t_all)
        return out

    def trainer_args(self, learned_dir: Path) -> dict[str, Any] | None:
        """The arguments the trainer recorded for a controller it trained here (the risk rule it applied)."""
        from fcprag_plugin.training import ARGS_NAME

        path = Path(learned_dir) / ARGS_NAME
        return None if self.o.controller or not path.is_file() else json.loads(path.read_text(encoding="utf-8"))

    @property
    def dtype(self) -> str:
        """The model's dtype; read from the settings when nothing was left to score (the model not loaded)."""
        if self.model is not None:
            return str(next(self.model.parameters()).dtype).removeprefix("torch.")
        from ..lm.model_io import resolve_device

        auto = "float32" if resolve_device(self.o.device, self.shard.local_rank).type == "cpu" else "bfloat16"
        return self.o.dtype if self.o.dtype != "auto" else auto

    def random_rows(self, q: dict[str, Any], ships: dict[str, Any]) -> dict[str, tuple[str, list[float]]]:
        """The paper's ablation: an untrained controller (seed 0) at each setting's recommended kappa."""
        from fcprag_plugin import FusionController

        out = {}
        for s, ship in ships.items():
            cfg = ship.config
            rnd = FusionController(embed_dim=cfg.embed_dim, embedding_model=cfg.embedding_model,
                                   controller_mode="random", seed=0, kappa=float(cfg.kappa)).eval()
            out["random_controller" + suffix(s)] = (s, self.weights(q, rnd))
        return out

    def candidate_rows(self, q: dict[str, Any], ships: dict[str, Any], verdicts: dict[str, Any]
                       ) -> dict[str, tuple[str, list[float]]]:
        """The candidates of "what to run" on one training question: no adapter (two prompts), PRAG's sum and what
        ships in each setting (under the name of the held-out row it equals)."""
        n = len(q["passages"])
        rows = {"vanilla": ("param", [0.0] * n), "standard_rag": ("combine", [0.0] * n)}
        for s, ship in ships.items():
            rows["prag_sum" + suffix(s)] = (s, [1.0] * n)
            rows[verdicts[s]["recommended_row"]] = (s, self.weights(q, ship))
        return rows

    def save_controller(self, setting: str, shipped: Any, qs: dict[str, dict[str, Any]]) -> None:
        """``controller/`` (``controller_combine/``): what ships in ``setting``, with the training question ids."""
        from fcprag_tools.options import write_dir_atomically

        train_ids = sorted(q for q, r in qs.items() if r["split"] == "train")

        def save(tmp: Path) -> None:
            shipped.save_pretrained(tmp)
            if train_ids:  # `fcprag study --controller` leaves these out of what it evaluates
                write_json(tmp / "train_question_ids.json", {"ids": train_ids})

        write_dir_atomically(self.out / ("controller" + suffix(setting)), save)


def run_study(opts: StudyOptions) -> dict[str, Any] | None:
    """Run (or resume) a study; returns ``summary.json``'s content (None on ranks other than 0)."""
    return Study(opts).run()
