"""The training arguments, :class:`TrainArgs`: the network's hyper-parameters, what ships (:data:`RECIPES`) and the
verdict's rule; each checked in one line naming the argument."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..controller_config import ControllerConfig
from ..errors import FcpragError, kw
from ..features import SIDE_FEATURES
from .data import LabelTensors
from .selection import BOUNDS, ScaleRule
from .targets import DEFAULT_FLAT_EPS, DEFAULT_FLAT_WEIGHT, DEFAULT_T_LABEL, check_target_args, estimate_lambda

# what a recipe sets unless the caller does: "measured" (the TrainArgs defaults) and "paper" (the network at total 1)
RECIPES: dict[str, dict[str, Any]] = {"measured": {}, "paper": {"kappa": 1.0, "keep_network": True, "objective": "kl"}}
# the fields that take one of a few words: TrainArgs.validate checks them, fcprag train offers them as choices
CHOICES = {"precision": ("auto", "fp32", "bf16"), "objective": ("kl", "risk"), "scale_bound": BOUNDS,
           "recipe": tuple(RECIPES)}
# sizes refused before allocation: more epochs than anyone trains for (the CV keeps (epochs + 1) x records), a
# wider layer than any controller needs (16384 x 16384 is 1 GiB)
MAX_EPOCHS, MAX_HIDDEN = 10_000, 16_384
# arguments of earlier versions, refused saying what replaced them (train_controller, fcprag train's flags)
REMOVED = {name: f"{kw(name)} is gone with the validation split: the nested cross-validation ({kw('cv_folds')}) "
                 "chooses the epochs and measures the gain on questions it did not train on; fcprag eval scores a "
                 "controller on other labels" for name in ("val", "val_fraction")}


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
