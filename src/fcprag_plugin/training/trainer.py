"""Train a :class:`FusionController` on leave-one-out label files (orchestration; math in ``targets``, ``evaluation``).
The output directory of ``train_controller(labels, out)`` is described in ``docs/label-format.md``."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from ..controller import ControllerConfig, FusionController
from ..errors import FcpragError, LabelFileError, kw
from ..features import SIDE_FEATURES, center_side
from ..fileio import append_json_lines, finite_or_none, read_json_if_present, write_json, write_json_lines
from .checkpoint import CHECKPOINT_DIR, load_checkpoint, read_checkpoint_state, save_checkpoint
from .data import LabelTensors, build_tensors, side_rows
from .embed_cache import EmbeddingCache, default_cache_dir
from .labels import IGNORED_SPLITS, VAL_SPLITS, LabelRecord, LabelSet, load_labels
from .evaluation import collect_outputs, evaluate, metrics_from_outputs
from .precision import autocast, resolve_precision
from . import query_scale as qs
from .selection import (BOUNDS, CV_NAME, CV_PARTIAL_NAME, SCALE_METRICS, ScaleRule, fold_kappa, has_measured,
                        read_cv_partial, select)
from .targets import (DEFAULT_FLAT_EPS, DEFAULT_FLAT_WEIGHT, DEFAULT_T_LABEL, check_target_args, estimate_lambda,
                      risk_loss, weighted_kl)

logger = logging.getLogger(__name__)

LOG_NAME = "train_log.jsonl"
ARGS_NAME = "training_args.json"
METRICS_NAME = "metrics.json"
# what a recipe sets unless the caller does: "measured" (the TrainArgs defaults) and "paper" (the network at total 1)
RECIPES: dict[str, dict[str, Any]] = {
    "measured": {}, "paper": {"kappa": 1.0, "keep_network": True, "per_query_scale": False, "objective": "kl"}}
# the fields that take one of a few words: TrainArgs.validate checks them, fcprag train offers them as choices
CHOICES = {"precision": ("auto", "fp32", "bf16"), "objective": ("kl", "risk"), "scale_bound": BOUNDS,
           "scale_metric": SCALE_METRICS, "recipe": tuple(RECIPES)}
# sizes refused before allocation: more epochs than anyone trains for (the CV keeps (epochs + 1) x records), a
# wider layer than any controller needs (16384 x 16384 is 1 GiB)
MAX_EPOCHS, MAX_HIDDEN = 10_000, 16_384
# arguments a resume may change (not what is learned; "auto" precision is compared resolved)
_RESUME_FREE = {"epochs", "cache_dir", "on_error", "eval_batch_size", "threads", "keep_network", "precision"}


@dataclass
class TrainArgs:
    """Training hyper-parameters: the network's follow the paper (AdamW 1e-4, wd 0.01, batch 32, 10 epochs), what
    ships follows :data:`RECIPES` (``docs/label-format.md``, "Recipes")."""

    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.01
    seed: int = 0
    t_label: float = DEFAULT_T_LABEL
    flat_eps: float = DEFAULT_FLAT_EPS
    flat_weight: float = DEFAULT_FLAT_WEIGHT
    val_fraction: float = 0.1
    on_error: str = "fail"
    precision: str = "auto"  # fp32 | bf16 (precision.py; metrics.json is fp32) | auto: bf16 where the CPU has it
    grad_clip: float | None = None
    eval_batch_size: int = 512
    cache_dir: str | None = None  # None: default_cache_dir(); "" : no disk cache
    threads: int | None = None  # torch intra-op threads for this run (None: torch's default)
    controller: dict[str, Any] = field(default_factory=dict)  # ControllerConfig overrides, e.g. score_hidden
    objective: str = "kl"  # "kl": the paper's KL to softmax(delta / t_label); "risk": see targets.py
    risk_lambda: float | None = None  # None: estimated from the training labels (targets.estimate_lambda)
    cv_folds: int = 5  # nested grouped CV: epochs, kappa and the verdict (selection.py); 0: off, train `epochs`
    kappa: float | str = "auto"  # global scale of the merge weights; "auto": chosen on the labels' measured scales
    side_features: list[str] = field(default_factory=list)  # opt-in per-passage inputs (features.SIDE_FEATURES)
    scale_max_loss_share: float = 0.1  # kappa "auto": the risk rule (selection.ScaleRule)
    scale_loss_margin: float = 0.1
    scale_bound: str = "upper"  # the share's 95% Wilson upper bound ("upper") or the observed share ("observed")
    scale_metric: str = "label"  # kappa chosen on the label metric ("label") or on F1 ("f1": f1_at_scales)
    per_query_scale: bool = True  # also try a per-query scale (query_scale.py); ships only when shown
    keep_network: bool = False  # ship the learned network (its reweighting part is first order, never measured)
    recipe: str = "measured"  # the name of the preset these arguments came from (RECIPES)
    allow_retrieval_score: bool = False  # see validate(): PRAG and DyPRAG keep no retrieval scores

    def validate(self) -> "TrainArgs":
        def need(ok: bool, what: str, params: Sequence[tuple[str, Any]] = ()) -> None:
            if not ok:
                raise FcpragError(f"training argument {what}", params=params)

        need(isinstance(self.epochs, int) and 1 <= self.epochs <= MAX_EPOCHS,
             f"'epochs' is {self.epochs!r}, expected an int from 1 to {MAX_EPOCHS}")
        need(isinstance(self.batch_size, int) and self.batch_size >= 1,
             f"'batch_size' is {self.batch_size!r}, expected an int >= 1")
        need(self.lr > 0, f"'lr' is {self.lr}, expected > 0")
        need(self.weight_decay >= 0, f"'weight_decay' is {self.weight_decay}, expected >= 0")
        need(0 <= self.val_fraction < 1, f"'val_fraction' is {self.val_fraction}, expected 0 <= f < 1")
        for name, allowed in CHOICES.items():
            need(getattr(self, name) in allowed, f"'{name}' is {getattr(self, name)!r}, expected one of {[*allowed]}")
        need(self.grad_clip is None or self.grad_clip > 0, f"'grad_clip' is {self.grad_clip}, expected > 0 or None")
        need(self.threads is None or (isinstance(self.threads, int) and self.threads >= 1),
             f"'threads' is {self.threads!r}, expected an int >= 1 or None")
        known = {f.name for f in fields(ControllerConfig)} - {"embed_dim", "embedding_model", "seed", "format_version"}
        bad = sorted(set(self.controller) - known)
        need(not bad, f"'controller' has unknown key(s) {bad}; expected among {sorted(known)}")
        sizes = [*self.controller.get("score_hidden", []), self.controller.get("calib_hidden", 1)]
        need(all(isinstance(h, int) and 1 <= h <= MAX_HIDDEN for h in sizes),
             f"'controller' hidden sizes are {sizes}, expected ints from 1 to {MAX_HIDDEN}")
        need(self.risk_lambda is None or (isinstance(self.risk_lambda, (int, float)) and self.risk_lambda > 0),
             f"'risk_lambda' is {self.risk_lambda!r}, expected a number > 0 or None (estimated from the labels)")
        need(isinstance(self.cv_folds, int) and (self.cv_folds == 0 or self.cv_folds >= 2),
             f"'cv_folds' is {self.cv_folds!r}, expected 0 (off) or an int >= 2")
        need(self.kappa == "auto" or (isinstance(self.kappa, (int, float)) and not isinstance(self.kappa, bool)
                                      and math.isfinite(self.kappa) and self.kappa > 0),
             f"'kappa' is {self.kappa!r}, expected a number > 0 or 'auto'")
        badf = [n for n in self.side_features if n not in SIDE_FEATURES]
        need(not badf and len(set(self.side_features)) == len(self.side_features),
             f"'side_features' is {self.side_features!r}, expected distinct names among {list(SIDE_FEATURES)}")
        need(not (self.controller.get("calib_scale") and self.objective != "risk"),
             "'controller.calib_scale' needs objective 'risk' (the KL objective does not see the total scale)")
        need(not ({"side_features", "side_scale", "kappa", "cv", "init"} & set(self.controller)),
             "'controller' may not set side_features/side_scale/kappa/cv/init; use the TrainArgs fields")
        need(0 <= self.scale_max_loss_share <= 1 and self.scale_loss_margin >= 0,
             f"'scale_max_loss_share' is {self.scale_max_loss_share} and 'scale_loss_margin' is "
             f"{self.scale_loss_margin}, expected a share in [0, 1] and a margin >= 0")
        need("retrieval_score" not in self.side_features or self.allow_retrieval_score,
             f"{kw('side_features', ['retrieval_score'])} is a score PRAG and DyPRAG do not keep: their shims would "
             "run the controller with it taken as equal for every passage, which its verdict did not measure; leave "
             f"it out, or pass {kw('allow_retrieval_score', True)} for a host that supplies scores",
             [("side_features", ["retrieval_score"]), ("allow_retrieval_score", True)])
        check_target_args(self.t_label, self.flat_eps, self.flat_weight)
        return self

    @classmethod
    def for_recipe(cls, recipe: str = "measured", **kwargs: Any) -> "TrainArgs":
        """The arguments of ``recipe`` (:data:`RECIPES`; unknown: refused by :meth:`validate`) and ``kwargs``."""
        return cls(**{**RECIPES.get(recipe, {}), **kwargs, "recipe": recipe})

    @property
    def scale_rule(self) -> ScaleRule:
        return ScaleRule(self.scale_max_loss_share, self.scale_loss_margin, self.scale_bound)

    def risk_lambda_for(self, data: LabelTensors) -> float:
        """The risk objective's lambda on ``data``: ``risk_lambda`` when given, else estimated from its labels."""
        return float(self.risk_lambda) if self.risk_lambda is not None else estimate_lambda(data.deltas, data.mask)


@dataclass
class TrainResult:
    """The shipped ``controller`` (saved in ``out``), ``metrics.json``'s content, the per-epoch ``history``, and the
    final evaluation's ``outputs[name]`` (``w, g, tau``, the shipped one first) on ``report_data``."""

    controller: FusionController
    out: Path
    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    n_train: int
    n_val: int
    outputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    report_data: LabelTensors | None = None


def as_label_set(labels: Any, on_error: str, what: str) -> LabelSet:
    """``labels`` (a label file path, a :class:`LabelSet` or a list of :class:`LabelRecord`) as a LabelSet."""
    if isinstance(labels, LabelSet):
        return labels
    if isinstance(labels, (str, Path)):
        return load_labels(labels, on_error)
    if isinstance(labels, (list, tuple)) and all(isinstance(r, LabelRecord) for r in labels):
        return LabelSet(f"<{what} records>", list(labels))
    raise FcpragError(f"{what}: expected a label file path, a LabelSet or a list of LabelRecord, got "
                      f"{type(labels).__name__}")


def _drop_test(records: list[LabelRecord], what: str) -> list[LabelRecord]:
    kept = [r for r in records if r.split not in IGNORED_SPLITS]
    if len(kept) < len(records):
        logger.info("%s: %d records with split 'test' are left out of training and validation", what,
                    len(records) - len(kept))
    return kept


def check_no_leak(train: Sequence[LabelRecord], val: Sequence[LabelRecord]) -> None:
    """Raise :class:`LabelFileError` if a validation record shares its id or group with a training record."""
    by_id = {r.id: r for r in train}
    by_group = {r.group: r for r in train if r.group is not None}
    for r in val:
        if r.id in by_id:
            raise LabelFileError(f"{r.where}: field 'id': '{r.id}' is also a training record ({by_id[r.id].where}); "
                                 "expected disjoint train and validation queries")
        if r.group in by_group:
            raise LabelFileError(f"{r.where}: field 'group': '{r.group}' also has training records "
                                 f"({by_group[r.group].where}); expected every group entirely in train or in "
                                 "validation")


def split_records(records: Sequence[LabelRecord], val_fraction: float, seed: int
                  ) -> tuple[list[LabelRecord], list[LabelRecord], str]:
    """``(train, val, how)``, each ``group`` (else ``id``) on one side: by the records' ``split`` fields when any
    has one (records without it train), else ``round(val_fraction * groups)`` seeded groups (at least one) validate."""
    records = list(records)
    if any(r.split is not None for r in records):
        val = [r for r in records if r.split in VAL_SPLITS]
        train = [r for r in records if r.split not in VAL_SPLITS]
        check_no_leak(train, val)
        return train, val, "split field"
    if val_fraction <= 0:
        return records, [], "none"
    keys = list(dict.fromkeys(r.group_key for r in records))
    if len(keys) < 2:
        logger.warning("only one group/id: no validation split possible")
        return records, [], "none"
    n_val = min(len(keys) - 1, max(1, round(val_fraction * len(keys))))
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    val_keys = {keys[i] for i in perm[:n_val]}
    train = [r for r in records if r.group_key not in val_keys]
    val = [r for r in records if r.group_key in val_keys]
    return train, val, f"by group/id, {n_val} of {len(keys)} groups"


def resolve_encoder(encoder: Any) -> tuple[str, Any]:
    """``(name, encoder or factory)``: a TextEncoder passes through; a name or None loads on a cache miss only."""
    if encoder is not None and not isinstance(encoder, (str, Path)):
        if not (hasattr(encoder, "encode") and hasattr(encoder, "name")):
            raise FcpragError(f"encoder: expected a TextEncoder, a model name/path or None, got "
                              f"{type(encoder).__name__}")
        return str(encoder.name), encoder
    from ..encoding import get_encoder, resolve_model

    # loaded once, on first need, shared by the train and validation sets: the process-wide encoder
    return resolve_model(encoder)[0], functools.cache(lambda: get_encoder(encoder))


def trained_for(records: Sequence[LabelRecord]) -> dict[str, Any] | None:
    """``config.trained_for``: the training records' distinct ``model`` / ``adapter_recipe`` values, or None."""
    recipes: list[Any] = []
    models: list[Any] = []
    for r in records:
        for seen, v in ((recipes, r.extra.get("adapter_recipe")), (models, r.extra.get("model"))):
            if v is not None and v not in seen:
                seen.append(v)
    return {"base_model": models, "adapter_recipes": recipes} if recipes else None


def open_cache(cache_dir: str | Path | None, model_name: str, dim: int | None) -> EmbeddingCache | None:
    if cache_dir == "":
        return None
    return EmbeddingCache(default_cache_dir() if cache_dir is None else cache_dir, model_name, dim)


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
    """Data (``val`` may be None), controller and optimizer; :meth:`fit` trains into ``out`` (``info``: provenance)."""

    def __init__(self, train: LabelTensors, val: LabelTensors | None, out: str | Path | None, args: TrainArgs,
                 embedding_model: str, info: dict[str, Any] | None = None) -> None:
        self.train_data, self.val_data, self.args = train, val, args.validate()
        self.out = Path(out) if out is not None else None
        self.info = info or {}
        torch.manual_seed(args.seed)
        cfg = ControllerConfig(embed_dim=train.dim, embedding_model=embedding_model, seed=args.seed,
                               side_features=list(args.side_features), side_scale=side_scales(train),
                               init="uniform", **args.controller).validate()
        self.controller = FusionController(cfg)  # w~ = [1]*N exactly before the first step
        self.optimizer = make_optimizer(self.controller, args)
        self.shuffle_gen = torch.Generator().manual_seed(args.seed)
        self.history: list[dict[str, Any]] = []
        self.epoch = 0
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

    def validate(self) -> dict[str, Any]:
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        # in the training precision (cheaper); the final metrics.json is float32, as `fuse` / `fcprag eval` compute
        o = collect_outputs(self.controller, self.val_data, self.args.eval_batch_size,
                            torch.bfloat16 if self.precision == "bf16" else None)
        m = metrics_from_outputs(o["w"], o["g"], o["tau"], self.val_data, o["wt"])
        return {"val_loss": m["kl"], "val_top1": m["top1"], "val_g_mean": m["g_mean"], "val_gain": m["gain"]}

    def _state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "history": self.history, "args": asdict(self.args), "precision": self.precision,
                "info_label_sha256": self.info.get("label_sha256")}

    def resume(self) -> None:
        """Load the checkpoint in ``out`` when there is one."""
        ckpt = self.out / CHECKPOINT_DIR
        state = read_checkpoint_state(self.out)
        if state is None:
            logger.warning("%s: no checkpoint: the network trains from its start", ckpt)
            return
        old, new = state.get("args", {}), asdict(self.args)
        diff = sorted(k for k in set(old) | set(new) if k not in _RESUME_FREE and old.get(k) != new.get(k))
        if diff:
            both = ", ".join(f"{kw(k, new.get(k))} (the checkpoint has {kw(k, old.get(k))})" for k in diff)
            raise FcpragError(f"{ckpt}: cannot resume, argument(s) {diff} differ from the checkpoint: {both}",
                              params=[(k, v.get(k)) for k in diff for v in (new, old)])
        saved = state.get("precision", self.precision)
        if saved != self.precision:
            raise FcpragError(f"{ckpt}: cannot resume, the checkpoint trained in {saved} but this run would "
                              f"use {self.precision}; pass {kw('precision', saved)}",
                              params=[("precision", saved)])
        if state.get("info_label_sha256") != self.info.get("label_sha256"):
            raise FcpragError(f"{ckpt}: cannot resume, the label file(s) changed since the checkpoint "
                              "(sha256 differs)")
        load_checkpoint(self.out, self.controller, self.optimizer, self.shuffle_gen)
        self.epoch, self.history = int(state["epoch"]), list(state["history"])
        logger.info("resumed from %s at epoch %d", ckpt, self.epoch)

    def fit(self, progress: bool, epochs: int) -> list[dict[str, Any]]:
        """Train from ``self.epoch`` to ``epochs`` (0: uniform), checkpointing every epoch."""
        self.out.mkdir(parents=True, exist_ok=True)
        log_path = self.out / LOG_NAME
        # the log always mirrors the checkpoint's history (an epoch after the checkpoint never happened)
        write_json_lines(log_path, map(finite_or_none, self.history))
        if not (self.out / CHECKPOINT_DIR).exists():  # also for 0 epochs: the directory holds a run from now on
            save_checkpoint(self.out, self.controller, self.optimizer, self.shuffle_gen, self._state())
        if self.epoch >= epochs:
            return self.history
        with tqdm(total=len(self.train_data) * (epochs - self.epoch), unit="rec", desc="training",
                  dynamic_ncols=True, disable=not progress) as bar:
            while self.epoch < epochs:
                t0 = time.perf_counter()
                bar.set_description(f"epoch {self.epoch + 1}/{epochs}")
                train_loss = self.train_epoch(bar)
                train_s = time.perf_counter() - t0
                row = {"epoch": self.epoch + 1, "train_loss": train_loss, **self.validate(),
                       "seconds": round(time.perf_counter() - t0, 3),
                       "records_per_s": round(len(self.train_data) / max(train_s, 1e-9), 1), "lr": self.args.lr}
                self.epoch += 1
                self.history.append(finite_or_none(row))
                save_checkpoint(self.out, self.controller, self.optimizer, self.shuffle_gen, self._state())
                append_json_lines(log_path, self.history[-1:])
                logger.info("epoch %d: %s", self.epoch, {k: v for k, v in row.items() if k != "epoch"})
        return self.history


def train_controller(labels: Any, out: str | Path, *, val: Any = None, encoder: Any = None, resume: bool = False,
                     overwrite: bool = False, progress: bool = True, **kwargs: Any) -> TrainResult:
    """Train a controller from ``labels`` (a label file, a :class:`LabelSet` or records) into ``out`` (plus args,
    metrics, log, checkpoint; the verdict in ``metrics["cv"]`` and the config's ``cv``). ``val``: validation labels
    (else a group-based split); ``encoder``: a ``TextEncoder``, a model name/path or None (the default, loaded on a
    cache miss only); ``resume``: continue from ``out/checkpoint`` (arguments must match but ``epochs`` and a few
    others); ``overwrite``: replace a run there; ``kwargs``: :class:`TrainArgs`."""
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
        run = prepare(labels, Path(out), val, encoder, resume, overwrite, progress, args)
        cv = select_by_cv(run)
        controller, history = fit(run, cv)
        return finalise(run, cv, controller, history)
    finally:
        torch.set_num_threads(prev_threads)


@dataclass
class Run:
    """What :func:`prepare` hands to the later steps of :func:`train_controller`."""

    args: TrainArgs
    out: Path
    resume: bool
    progress: bool
    train_set: LabelSet
    val_set: LabelSet | None
    train: LabelTensors
    val: LabelTensors | None
    embedding_model: str
    info: dict[str, Any]
    t_start: float
    t_data: float

    def trainer(self) -> "Trainer":
        return Trainer(self.train, self.val, self.out, self.args, self.embedding_model, self.info)


def prepare(labels: Any, out: Path, val: Any, encoder: Any, resume: bool, overwrite: bool, progress: bool,
            args: TrainArgs) -> Run:
    """Read, split and embed the labels, record provenance, ready ``out`` (a run there: ``resume``/``overwrite``)."""
    if not resume and not overwrite and (out / CHECKPOINT_DIR).exists():
        raise FcpragError(f"{out}: already holds a training run; pass {kw('resume', True)} to continue it or "
                          f"{kw('overwrite', True)} to start over", params=[("resume", True), ("overwrite", True)])
    t_start = time.perf_counter()
    train_set = as_label_set(labels, args.on_error, "labels")
    records = _drop_test(train_set.records, train_set.path)
    val_set = as_label_set(val, args.on_error, "val") if val is not None else None
    if val_set is not None:
        train_recs, val_recs, how = records, _drop_test(val_set.records, val_set.path), f"file {val_set.path}"
        check_no_leak(train_recs, val_recs)
    else:
        train_recs, val_recs, how = split_records(records, args.val_fraction, args.seed)
    if not train_recs:
        raise LabelFileError(f"{train_set.path}: no training records left after the split ({how})")
    logger.info("%d training and %d validation records (split: %s)", len(train_recs), len(val_recs), how)

    for r in (*train_recs, *val_recs):  # every field the side features need, before any text is embedded
        side_rows(r, args.side_features)
    name, enc = resolve_encoder(encoder)
    cache = open_cache(args.cache_dir, name, getattr(enc, "dim", None))
    tkw = dict(t_label=args.t_label, flat_eps=args.flat_eps, flat_weight=args.flat_weight, progress=progress,
               side_features=args.side_features)
    train_t = build_tensors(train_recs, enc, cache, **tkw)
    if args.scale_metric == "f1" and args.kappa == "auto" and not has_measured(train_t, "f1"):
        raise LabelFileError(f"{train_set.path}: no record has 'f1_at_scales' (with 'f1_all' and 'scales'); "
                             "scale_metric 'f1' chooses kappa on answer-level scale labels: build them with "
                             "'fcprag labels build --scales ...' (with generation), or choose on the label metric")
    val_t = build_tensors(val_recs, enc, cache, **tkw) if val_recs else None
    sha = train_set.sha256 + (("+" + val_set.sha256) if val_set is not None else "")
    info = {"labels": train_set.path, "val": val_set.path if val_set is not None else None, "label_sha256": sha,
            "train_labels_sha256": train_set.sha256, "val_labels_sha256": val_set.sha256 if val_set else None,
            "split": how, "n_train": len(train_recs), "n_val": len(val_recs), "n_train_flat": int(train_t.flat.sum()),
            "embedding_model": name, "embed_dim": train_t.dim,
            "cache_dir": str(cache.dir) if cache is not None else None,
            "skipped": {"labels": len(train_set.skipped), **({"val": len(val_set.skipped)} if val_set else {})},
            "versions": _versions(), "trained_for": trained_for(train_recs)}
    run = Run(args, out, resume, progress, train_set, val_set, train_t, val_t, name, info, t_start,
              time.perf_counter() - t_start)
    out.mkdir(parents=True, exist_ok=True)
    if not resume:  # a later resume must never pick up the old run's state
        if (out / CHECKPOINT_DIR).exists():
            logger.warning("%s: overwriting the previous run", out)
            shutil.rmtree(out / CHECKPOINT_DIR)
        for name in (CV_NAME, CV_PARTIAL_NAME):
            (out / name).unlink(missing_ok=True)
    write_json(out / ARGS_NAME, {**asdict(args), "resume": resume, "precision_used": resolve_precision(args.precision),
                                 "risk_lambda_used": args.risk_lambda_for(train_t), **info})
    return run


def select_by_cv(run: Run) -> dict[str, Any] | None:
    """The nested cross-validation of :mod:`.selection` (None with ``cv_folds=0``), kept in ``cv.json`` so that a
    resume does not redo it unless ``epochs`` changed (:meth:`Trainer.resume` checks the rest)."""
    args, path = run.args, run.out / CV_NAME
    if not args.cv_folds:
        return None
    cv = read_json_if_present(path, FcpragError, fix="delete it to run the cross-validation again")
    if cv is None or cv.get("max_epochs") != args.epochs or "scale" not in cv:
        # finished folds are kept (CV_PARTIAL_NAME), not redone on a resume with the same arguments and labels
        key = {"args": {k: v for k, v in asdict(args).items() if k not in _RESUME_FREE or k == "epochs"},
               "label_sha256": run.info.get("label_sha256")}
        partial = read_cv_partial(run.out) if run.resume else None
        same = partial is not None and partial.get("key") == json.loads(json.dumps(finite_or_none(key), default=str))
        done = partial["folds"] if same else []  # made with other arguments or labels: the CV starts over
        cv = select(run.train, args, run.embedding_model, Trainer, args.scale_rule, run.progress, done=done,
                    on_fold=lambda folds: write_json(run.out / CV_PARTIAL_NAME, {
                        "key": key, "n_folds": args.cv_folds, "folds": folds}))
        write_json(path, cv)
        (run.out / CV_PARTIAL_NAME).unlink(missing_ok=True)
    if args.keep_network and cv["shipped"] != "network":  # keep_network may change on a resume
        cv = {**cv, "shipped": "network"}
    return cv


def fit(run: Run, cv: dict[str, Any] | None) -> tuple[FusionController, list[dict[str, Any]]]:
    """``(controller, history)``: the learned controller trained for the selected epochs, or the scale-only / per-query
    scale controller the verdict ships (the untrained network checkpointed for a resume with ``keep_network``)."""
    shipped = "network" if cv is None else cv["shipped"]
    trainer = run.trainer()
    if run.resume:
        trainer.resume()
    epochs = (run.args.epochs if cv is None else cv["selected_epochs"]) if shipped == "network" else 0
    if trainer.epoch > epochs:
        logger.warning("%s: the checkpoint has %d epochs but %d are to be trained; training again from the start",
                       run.out / CHECKPOINT_DIR, trainer.epoch, epochs)
        shutil.rmtree(run.out / CHECKPOINT_DIR)
    if trainer.epoch == 0 or trainer.epoch > epochs:
        trainer = run.trainer()  # a fresh start after the CV (which drew from the global RNG)
    history = trainer.fit(run.progress, epochs)
    if shipped in ("prag_sum", "scale_only"):
        return FusionController.scale_only(cv["kappa"], embed_dim=run.train.dim,
                                           embedding_model=run.embedding_model), history
    if shipped == "query_scale":
        return query_scale_controller(run, cv), history
    return trainer.controller.eval(), history


def query_scale_controller(run: Run, cv: dict[str, Any]) -> FusionController:
    """Controller mode ``scale``: its head trained on all the training records (the recipe the CV measured)."""
    args = run.args
    head, info = qs.fit_query_scale(run.train, args.scale_metric, cv["scale"]["kappa"], args.scale_rule, args.seed)
    ctrl = FusionController(ControllerConfig(embed_dim=run.train.dim, embedding_model=run.embedding_model,
                                             controller_mode="scale", scale_grid=info["grid"]))
    ctrl.scale_head.load_state_dict(head.state_dict())
    return ctrl.eval()


def finalise(run: Run, cv: dict[str, Any] | None, controller: FusionController,
             history: list[dict[str, Any]]) -> TrainResult:
    """Put kappa and the verdict in the config, save, evaluate on the validation (else training) records, write
    ``metrics.json``."""
    args, out = run.args, run.out
    kappa = cv["kappa"] if cv is not None else fold_kappa(run.train, args, args.scale_rule)[0]
    if controller.config.controller_mode == "scale":
        kappa = 1.0  # its scale is the head's, per query
    updates: dict[str, Any] = {"kappa": kappa, "trained_for": run.info.get("trained_for")}
    if cv is not None:
        part = ("gain", "ci95", "shown", "n_records")
        updates["cv"] = {k: cv[k] for k in ("gain", "ci95", "ci_method", "verdict", "folds", "selected_epochs",
                                            "objective", "n_groups", "metric", "shipped")} | {
            "scale": {k: cv["scale"][k] for k in (*part, "kappa", "chosen_by", "measured", "at_grid_edge")},
            "reweighting": {k: cv["reweighting"][k] for k in part} | {"first_order": True, "measured": False},
            **({"query_scale": {k: cv["query_scale"][k] for k in (*part, "measured")}} if "query_scale" in cv
               else {}),
            "source": str(out)}
    else:  # no cross-validation, no verdict: the controller says it is unproven wherever it is used
        updates["cv"] = {"gain": None, "ci95": None, "verdict": "unproven", "folds": 0, "objective": args.objective,
                         "shipped": "network", "source": str(out)}
    controller.config = replace(controller.config, **updates)
    controller.save_pretrained(out)
    report_on = run.val if run.val is not None else run.train  # no validation data: report the training set
    report, outputs = evaluate(controller, report_on, seed=args.seed, batch_size=args.eval_batch_size)
    metrics: dict[str, Any] = finite_or_none({
        "val" if run.val is not None else "train": report,
        "epochs": len(history), "n_train": len(run.train), "n_val": 0 if run.val is None else len(run.val),
        "split": run.info["split"], "objective": args.objective,
        "risk_lambda": args.risk_lambda_for(run.train),
        "kappa": kappa, **({"cv": cv} if cv is not None else {}),
        "skipped": {s.path: {"count": len(s.skipped), "by_field": s.skip_counts(),
                             "records": [{"line": k.line, "field": k.field, "message": k.message}
                                         for k in s.skipped]}
                    for s in (run.train_set, run.val_set) if s is not None and s.skipped},
        "timing_s": {"data": round(run.t_data, 3), "fit": round(time.perf_counter() - run.t_start - run.t_data, 3),
                     "total": round(time.perf_counter() - run.t_start, 3)},
    })
    write_json(out / METRICS_NAME, metrics)
    logger.info("wrote %s", out)
    return TrainResult(controller, out, metrics, history, metrics["n_train"], metrics["n_val"], outputs, report_on)
