"""Grouped k-fold cross-validation: how many epochs to train (0 = stay uniform) and what that is worth, by held-out
first-order gain over uniform with a group-bootstrap 95% CI (``docs/label-format.md``, "model selection").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from .data import LabelTensors
from .evaluation import collect_outputs
from .targets import first_order_gain

logger = logging.getLogger(__name__)

CV_NAME = "cv.json"
BOOTSTRAP = 2000
CI_METHOD = f"percentile bootstrap over questions (groups), {BOOTSTRAP} resamples"


def group_kfold(groups: Sequence[str], k: int, seed: int) -> list[list[int]]:
    """Row indices of ``k`` folds such that all rows of a group are in one fold.

    Groups are shuffled (seeded) and dealt to the folds largest-first onto the fold with the fewest rows, so folds
    are balanced in records. Fewer than ``k`` groups give fewer (non-empty) folds.
    """
    by_group: dict[str, list[int]] = {}
    for i, gk in enumerate(groups):
        by_group.setdefault(gk, []).append(i)
    keys = list(by_group)
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    order = sorted((keys[i] for i in perm), key=lambda g: -len(by_group[g]))  # stable: shuffled within a size
    folds: list[list[int]] = [[] for _ in range(min(k, len(keys)))]
    for gk in order:
        min(folds, key=len).extend(by_group[gk])
    return [sorted(f) for f in folds]


def bootstrap_ci(values: torch.Tensor, groups: Sequence[str], seed: int, n_boot: int = BOOTSTRAP
                 ) -> tuple[float, float]:
    """95% percentile-bootstrap CI of the record mean of ``values [R]``, resampling whole groups."""
    index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    gid = torch.tensor([index[g] for g in groups])
    G = len(index)
    sums = torch.zeros(G, dtype=torch.float64).index_add_(0, gid, values.to(torch.float64))
    counts = torch.bincount(gid, minlength=G).to(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, G, (n_boot, G), generator=gen)
    means = sums[idx].sum(1) / counts[idx].sum(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def cross_validate(data: LabelTensors, args: Any, embedding_model: str, trainer: Callable[..., Any],
                   progress: bool = False) -> dict[str, Any]:
    """Run the grouped CV (folds by :func:`group_kfold`, the CI by :func:`bootstrap_ci`); returns a JSON-ready dict.

    ``args`` is the run's ``TrainArgs`` (``cv_folds``, ``epochs`` = the most epochs tried, ``kappa``, seed...);
    ``trainer(train_data, None, None, args, embedding_model)`` builds one fold's trainer (the trainer module's
    ``Trainer``, passed in so that this module does not import the one that imports it).
    """
    t0 = time.perf_counter()
    folds = group_kfold(data.groups, args.cv_folds, args.seed)
    if len(folds) < 2:
        raise ValueError(f"cross-validation needs at least 2 groups (questions), got {len(folds)}")
    E, R = args.epochs, len(data)
    gains = torch.zeros(E + 1, R, dtype=torch.float64)  # held-out gain of every record after e epochs
    kappas = torch.ones(len(folds), E + 1, dtype=torch.float64)
    fold_args = dataclasses.replace(args, cv_folds=0, plots=False)
    with tqdm(total=len(folds) * E, unit="epoch", desc=f"{len(folds)}-fold CV", dynamic_ncols=True,
              disable=not progress) as bar:
        for f, held in enumerate(folds):
            held_set = set(held)
            tr = trainer(data.subset([i for i in range(R) if i not in held_set]), None, None, fold_args,
                         embedding_model)
            held_data = data.subset(held)
            for e in range(E + 1):
                if e > 0:
                    tr.train_epoch()
                    bar.update(1)
                o = collect_outputs(tr.controller, held_data, args.eval_batch_size)
                kappa = tr.tuned_kappa() if args.kappa == "auto" else float(args.kappa)
                kappas[f, e] = kappa
                gains[e, held] = first_order_gain(kappa * o["wt"].to(torch.float64), held_data.deltas, held_data.mask)
    curve = gains.mean(1)
    best = int(torch.argmax(curve))  # first maximum: the fewest epochs among ties (epoch 0 = uniform)
    lo, hi = bootstrap_ci(gains[best], data.groups, args.seed)
    fold_curves = [[float(gains[e, torch.tensor(fd)].mean()) for e in range(E + 1)] for fd in folds]
    out = {
        "folds": len(folds), "n_records": R, "n_groups": len(set(data.groups)), "max_epochs": E,
        "objective": args.objective, "selected_epochs": best, "gain": float(curve[best]), "ci95": [lo, hi],
        "ci_method": CI_METHOD, "metric": "mean over records of sum_i (w~_i - 1) delta_i (held-out, first order)",
        "verdict": "better_than_uniform" if lo > 0 else "unproven",
        "curve": [float(v) for v in curve], "fold_curves": fold_curves,
        "fold_sizes": [len(fd) for fd in folds],
        "kappa": "auto" if args.kappa == "auto" else float(args.kappa),
        "fold_kappas_at_selected": [float(k) for k in kappas[:, best]],
        "seconds": round(time.perf_counter() - t0, 3),
    }
    logger.info("%s", cv_summary_line(out))
    return out


def cv_summary_line(cv: dict[str, Any]) -> str:
    """One line for the CLI: the cross-validated gain over uniform with its CI, and the verdict in plain words."""
    lo, hi = cv["ci95"]
    head = (f"{cv['folds']}-fold grouped CV ({cv['n_groups']} questions, objective {cv['objective']}): gain over "
            f"uniform {cv['gain']:+.4g} per record, 95% CI [{lo:+.4g}, {hi:+.4g}] at {cv['selected_epochs']} "
            f"epoch(s)")
    if cv["verdict"] == "better_than_uniform":
        return head + "; better than uniform (PRAG's sum)."
    if cv["selected_epochs"] == 0:
        return head + ("; NOT better than uniform: no epoch count beat PRAG's sum on held-out questions, so the "
                       "saved controller keeps uniform weights.")
    return head + ("; NOT shown to be better than uniform (the CI does not lie above 0): the saved controller may "
                   "be no better than PRAG's sum, and fuse() will say so when it is used.")

