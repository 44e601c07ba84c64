"""Train a :class:`FusionController` on leave-one-out label files: :func:`train_controller` runs a :class:`Run`
(read and embed the labels, cross-validate, fit, save and evaluate), whose network a :class:`Trainer` fits (math in
``targets``, ``evaluation``). The output directory is described in ``docs/label-format.md``."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from ..controller import ControllerConfig, FusionController
from ..errors import BARE, FcpragError, LabelFileError, kw
from ..features import center_side
from ..fileio import append_json_lines, finite_or_none, write_json, write_json_lines
from ..progress import progress_bar
from .args import REMOVED, TrainArgs
from .data import LabelTensors, build_tensors, side_rows
from .embed_cache import open_cache, resolve_encoder
from ..labels import LabelRecord, LabelSet, as_label_set, drop_held_out
from .evaluation import evaluate
from .precision import autocast, resolve_precision
from .selection import CV_NAME, fold_kappa, select
from .targets import risk_loss, weighted_kl

logger = logging.getLogger(__name__)

LOG_NAME = "train_log.jsonl"
ARGS_NAME = "training_args.json"
METRICS_NAME = "metrics.json"


@dataclass
class TrainResult:
    """The shipped ``controller`` (saved in ``out``), ``metrics.json``'s content, the per-epoch ``history``, and the
    final evaluation's ``outputs[name]`` (``w, g, tau``, the shipped one first) on ``report_data``, the training
    records."""

    controller: FusionController
    out: Path
    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    n_train: int
    outputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    report_data: LabelTensors | None = None


def trained_for(records: Sequence[LabelRecord]) -> dict[str, Any] | None:
    """``config.trained_for``: the training records' distinct ``model`` / ``adapter_recipe`` values, or None."""
    recipes: list[Any] = []
    models: list[Any] = []
    for r in records:
        for seen, v in ((recipes, r.extra.get("adapter_recipe")), (models, r.extra.get("model"))):
            if v is not None and v not in seen:
                seen.append(v)
    return {"base_model": models, "adapter_recipes": recipes} if recipes else None


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("fcprag-plugin", "torch", "transformers", "peft", "sentence-transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def side_scales(data: LabelTensors) -> list[float] | None:
    """The config's ``side_scale``: per column, the std of the within-set centered values (1.0 if constant), or None."""
    if data.side is None:
        return None
    x = center_side(data.side, data.mask)[data.mask]  # [P, k]
    sd = x.to(torch.float64).pow(2).mean(0).sqrt()
    return [float(v) if v > 1e-12 else 1.0 for v in sd]


def make_optimizer(controller: FusionController, args: TrainArgs) -> torch.optim.Optimizer:
    """AdamW; the fused kernel (one pass over memory per step) when this torch has it."""
    try:
        return torch.optim.AdamW(controller.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(controller.parameters(), lr=args.lr, weight_decay=args.weight_decay)


class Trainer:
    """The network, its optimizer and its data: what a cross-validation fold and the final fit train, one
    :meth:`train_epoch` at a time."""

    def __init__(self, train: LabelTensors, args: TrainArgs, embedding_model: str) -> None:
        self.train_data, self.args = train, args.validate()
        torch.manual_seed(args.seed)
        cfg = ControllerConfig(embed_dim=train.dim, embedding_model=embedding_model, seed=args.seed,
                               side_features=list(args.side_features), side_scale=side_scales(train),
                               init="uniform", **args.controller).validate()
        self.controller = FusionController(cfg)  # w~ = [1]*N exactly before the first step
        self.optimizer = make_optimizer(self.controller, args)
        self.shuffle_gen = torch.Generator().manual_seed(args.seed)
        self.precision = resolve_precision(args.precision)
        self.risk_lambda = args.risk_lambda_for(train)

    def loss(self, b: Any) -> torch.Tensor:
        """The training objective on batch ``b`` (a scalar to minimise)."""
        with autocast(self.precision):
            out = self.controller(b.e_q, b.E_p, b.mask, b.side)
        if self.args.objective == "risk":
            return risk_loss(out.merge_weights, b.deltas, b.mask, self.risk_lambda)
        return weighted_kl(b.y, out.probabilities, b.mask, b.omega)

    def train_epoch(self, progress: Any = None) -> float:
        """One pass over the training data; returns the mean loss (omega-weighted for the KL objective)."""
        self.controller.train()
        total, weight = 0.0, 0.0
        for b in self.train_data.batches(self.args.batch_size, shuffle=True, generator=self.shuffle_gen):
            loss = self.loss(b)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.args.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.controller.parameters(), self.args.grad_clip)
            self.optimizer.step()
            w = float(b.omega.sum()) if self.args.objective == "kl" else float(len(b.index))
            value = float(loss.detach())
            total += value * w
            weight += w
            if progress is not None:
                progress.update(len(b.index))
                progress.set_postfix(loss=f"{value:.3g}", refresh=False)  # small risk losses stay readable
        return total / weight if weight > 0 else 0.0


def train_controller(labels: Any, out: str | Path, *, encoder: Any = None, overwrite: bool = False,
                     progress: bool = True, **kwargs: Any) -> TrainResult:
    """Train a controller from ``labels`` (a label file, a :class:`LabelSet` or records) into ``out`` (plus args,
    metrics, log; the verdict in ``metrics["cv"]`` and the config's ``cv``). ``encoder``: a ``TextEncoder``, a model
    name/path or None (the default, loaded on a cache miss only); ``overwrite``: replace a run there (a run always
    trains from its start: it takes seconds to minutes); ``kwargs``: :class:`TrainArgs`."""
    removed = sorted(set(kwargs) & set(REMOVED))
    if removed:
        raise FcpragError(f"train_controller: {REMOVED[removed[0]]}", params=[(removed[0], BARE), ("cv_folds", BARE)])
    names = [f.name for f in fields(TrainArgs)]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise FcpragError(f"train_controller: unknown argument(s) {unknown}; expected TrainArgs fields {names}")
    if kwargs.get("cache_dir") is not None:
        kwargs["cache_dir"] = str(kwargs["cache_dir"])
    args = TrainArgs.for_recipe(**kwargs).validate()
    prev_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        run = Run.prepare(labels, Path(out), encoder, overwrite, progress, args)
        cv = run.cross_validate()
        return run.finalise(cv, *run.fit(cv))
    finally:
        torch.set_num_threads(prev_threads)


@dataclass
class Run:
    """One training run into ``out``, step by step (:func:`train_controller`): :meth:`prepare` the labels, then
    :meth:`cross_validate`, :meth:`fit` and :meth:`finalise`."""

    args: TrainArgs
    out: Path
    progress: bool
    train_set: LabelSet
    train: LabelTensors
    embedding_model: str
    info: dict[str, Any]
    t_start: float
    t_data: float

    @classmethod
    def prepare(cls, labels: Any, out: Path, encoder: Any, overwrite: bool, progress: bool, args: TrainArgs
                ) -> "Run":
        """Read and embed the labels, record provenance, ready ``out`` (a run there, marked by its
        ``training_args.json``: only with ``overwrite``)."""
        if not overwrite and (out / ARGS_NAME).exists():
            raise FcpragError(f"{out}: already holds a training run; pass {kw('overwrite', True)} to start over",
                              params=[("overwrite", True)])
        t_start = time.perf_counter()
        train_set = as_label_set(labels, args.on_error, "labels")
        train_recs = drop_held_out(train_set.records, train_set.path)
        if not train_recs:
            raise LabelFileError(f"{train_set.path}: no record to train on (records of a split other than 'train' "
                                 "are left out)")
        logger.info("%d training records", len(train_recs))
        for r in train_recs:  # every field the side features need, before any text is embedded
            side_rows(r, args.side_features)
        name, enc = resolve_encoder(encoder)
        cache = open_cache(args.cache_dir, name, getattr(enc, "dim", None))
        train_t = build_tensors(train_recs, enc, cache, t_label=args.t_label, flat_eps=args.flat_eps,
                                flat_weight=args.flat_weight, progress=progress, side_features=args.side_features)
        info = {"labels": train_set.path, "train_labels_sha256": train_set.sha256, "n_train": len(train_recs),
                "n_train_flat": int(train_t.flat.sum()), "embedding_model": name, "embed_dim": train_t.dim,
                "cache_dir": str(cache.path) if cache is not None else None,
                "skipped": {"labels": len(train_set.skipped)}, "versions": _versions(),
                "trained_for": trained_for(train_recs)}
        run = cls(args, out, progress, train_set, train_t, name, info, t_start, time.perf_counter() - t_start)
        out.mkdir(parents=True, exist_ok=True)
        if (out / ARGS_NAME).exists():
            logger.warning("%s: overwriting the previous run", out)
        (out / CV_NAME).unlink(missing_ok=True)  # a run with cv_folds=0 leaves no verdict of the one before
        write_json(out / ARGS_NAME, {**asdict(args), "precision_used": resolve_precision(args.precision),
                                     "risk_lambda_used": args.risk_lambda_for(train_t), **info})
        return run

    def cross_validate(self) -> dict[str, Any] | None:
        """The nested cross-validation of :mod:`.selection` (None with ``cv_folds=0``), written to ``cv.json``."""
        args = self.args
        if not args.cv_folds:
            return None
        cv = select(self.train, args, self.embedding_model, Trainer, args.scale_rule, self.progress)
        write_json(self.out / CV_NAME, cv)
        return cv

    def fit(self, cv: dict[str, Any] | None) -> tuple[FusionController, list[dict[str, Any]]]:
        """``(controller, history)``: the network trained for the selected epochs (each logged in
        ``train_log.jsonl`` as it ends), or the scale-only controller the verdict ships."""
        shipped = "network" if cv is None else cv["shipped"]
        epochs = (self.args.epochs if cv is None else cv["selected_epochs"]) if shipped == "network" else 0
        # seeded afresh: the cross-validation drew from the global RNG
        tr, history = Trainer(self.train, self.args, self.embedding_model), []
        log_path = self.out / LOG_NAME
        write_json_lines(log_path, [])  # an overwritten run's log goes
        with progress_bar("training", len(self.train) * epochs, unit="rec", enabled=self.progress and epochs > 0
                          ) as bar:
            for epoch in range(1, epochs + 1):
                t0 = time.perf_counter()
                bar.set_description(f"epoch {epoch}/{epochs}")
                train_loss = tr.train_epoch(bar)
                train_s = time.perf_counter() - t0
                row = {"epoch": epoch, "train_loss": train_loss, "seconds": round(train_s, 3),
                       "records_per_s": round(len(self.train) / max(train_s, 1e-9), 1), "lr": self.args.lr}
                history.append(finite_or_none(row))
                append_json_lines(log_path, history[-1:])
                logger.info("epoch %d: %s", epoch, {k: v for k, v in row.items() if k != "epoch"})
        if shipped == "network":
            return tr.controller.eval(), history
        return FusionController.scale_only(cv["kappa"], embed_dim=self.train.dim,
                                           embedding_model=self.embedding_model), history

    def finalise(self, cv: dict[str, Any] | None, controller: FusionController,
                 history: list[dict[str, Any]]) -> TrainResult:
        """Put kappa and the verdict in the config, save, evaluate on the training records, write ``metrics.json``."""
        args, out = self.args, self.out
        kappa = cv["kappa"] if cv is not None else fold_kappa(self.train, args, args.scale_rule)[0]
        updates: dict[str, Any] = {"kappa": kappa, "trained_for": self.info.get("trained_for")}
        if cv is not None:
            part = ("gain", "ci95", "shown", "n_records")
            updates["cv"] = {k: cv[k] for k in ("gain", "ci95", "ci_method", "verdict", "folds", "selected_epochs",
                                                "objective", "n_groups", "metric", "shipped")} | {
                "scale": {k: cv["scale"][k] for k in (*part, "kappa", "chosen_by", "measured", "at_grid_edge")},
                "reweighting": {k: cv["reweighting"][k] for k in part} | {"first_order": True, "measured": False},
                "source": str(out)}
        else:  # no cross-validation, no verdict: the controller says it is unproven wherever it is used
            updates["cv"] = {"gain": None, "ci95": None, "verdict": "unproven", "folds": 0,
                             "objective": args.objective, "shipped": "network", "source": str(out)}
        controller.config = replace(controller.config, **updates)
        controller.save_pretrained(out)
        report, outputs = evaluate(controller, self.train, seed=args.seed, batch_size=args.eval_batch_size)
        metrics: dict[str, Any] = finite_or_none({
            "train": report, "epochs": len(history), "n_train": len(self.train), "objective": args.objective,
            "risk_lambda": args.risk_lambda_for(self.train),
            "kappa": kappa, **({"cv": cv} if cv is not None else {}),
            "skipped": {s.path: {"count": len(s.skipped), "by_field": s.skip_counts(),
                                 "records": [{"line": k.line, "field": k.field, "message": k.message}
                                             for k in s.skipped]}
                        for s in (self.train_set,) if s.skipped},
            "timing_s": {"data": round(self.t_data, 3),
                         "fit": round(time.perf_counter() - self.t_start - self.t_data, 3),
                         "total": round(time.perf_counter() - self.t_start, 3)},
        })
        write_json(out / METRICS_NAME, metrics)
        logger.info("wrote %s", out)
        return TrainResult(controller, out, metrics, history, metrics["n_train"], outputs, self.train)
