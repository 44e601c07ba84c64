"""A per-query scale from measured scale labels (``docs/label-format.md``, "The parts"): a
:class:`~fcprag_plugin.controller.ScaleHead` policy ``pi [S]`` over the grid maximising
``J = mean_b sum_s pi_bs u_bs - l2 |W|^2`` with ``u_s = g_s - rho * 1[g_s < -margin]`` (g: measured gains [S]);
``rho`` and ``l2`` are chosen by an inner grouped CV, the risk rule's own kappa for every query winning ties."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..controller import ScaleHead
from .data import LabelTensors
from .stats import group_kfold, loss_share

L2_GRID = (math.inf, 1.0, 0.1, 0.01)  # strongest first: ties go to the simpler head
RHO_FACTORS = (1.0, 0.25, 1 / 16, 0.0)  # times risk_price: the safest first
STEPS = 300
LR = 0.05


def grid_with_sum(scales: torch.Tensor, gains: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """The grid with scale 1 (gain 0 by definition) added when missing, sorted, and the gains ``[R, S]`` to match."""
    grid = scales.tolist()
    if 1.0 not in grid:
        grid, gains = grid + [1.0], torch.cat([gains, torch.zeros(len(gains), 1, dtype=gains.dtype)], 1)
    order = sorted(range(len(grid)), key=grid.__getitem__)
    return [grid[j] for j in order], gains[:, order]


def utility(gains: torch.Tensor, rho: float, margin: float) -> torch.Tensor:
    """``u = g - rho * 1[g < -margin]`` (``[R, S]``)."""
    return gains - rho * (gains < -margin).to(gains.dtype)


def risk_price(gains: torch.Tensor, grid: Sequence[float], kappa: float, margin: float) -> float:
    """The smallest ``rho`` on a geometric ladder (0, then 1/64 .. 64 times the mean |gain|) at which the best
    global scale by mean utility is ``kappa`` (the risk rule's choice); the largest when none is."""
    base = float(gains.abs().mean()) or 1.0
    ladder = [0.0] + [base * 2.0 ** k for k in range(-6, 7)]
    if kappa in grid:
        for rho in ladder:
            if int(torch.argmax(utility(gains, rho, margin).mean(0))) == grid.index(kappa):
                return rho
    return ladder[-1]


def _head(grid: Sequence[float], mean: torch.Tensor, std: torch.Tensor, weight: torch.Tensor,
          bias: torch.Tensor) -> ScaleHead:
    """A frozen :class:`ScaleHead` with these standardisation buffers ``[2d]`` and linear parameters."""
    head = ScaleHead(len(mean) // 2, grid).requires_grad_(False)
    for t, v in ((head.mean, mean), (head.std, std), (head.linear.weight, weight), (head.linear.bias, bias)):
        t.copy_(v)
    return head.eval()


def fit_many(x: torch.Tensor, g: torch.Tensor, rows: Sequence[Sequence[int]], pairs: Sequence[tuple[float, float]],
             grid: Sequence[float], margin: float) -> list[list[ScaleHead]]:
    """``heads[f][p]``: the head fitted on ``x[rows[f]]`` (standardised by their own mean and std) with utility
    ``utility(g[rows[f]], rho, margin)`` and ``l2`` of ``pairs[p] = (rho, l2)`` by full-batch Adam on ``-J``
    (module docstring) from zero weights, the weights fixed at 0 for ``l2 = inf``; deterministic. Every fold and
    pair at once: one Adam over stacked parameters ``[F, P*S, 2d]``; Adam is elementwise and the candidates share
    no parameter, so each follows its own fit, up to float32 summation order. Rows are padded, with zero weight."""
    F, P, S, D = len(rows), len(pairs), len(grid), x.shape[1]
    n = max(len(r) for r in rows)
    z = torch.zeros(F, n, D)
    u = torch.zeros(F, n, P, S)  # [fold, row, pair, scale]: the logits' layout, softmax over a contiguous last dim
    row_w = torch.zeros(F, n, 1)  # 1/n_f on real rows: each fold's loss is a mean over its own rows
    stats = []
    for f, r in enumerate(rows):
        xr, gr = x[list(r)], g[list(r)]
        mean, std = xr.mean(0), xr.std(0, unbiased=False).clamp_min(1e-6)
        z[f, : len(r)], row_w[f, : len(r)] = ((xr - mean) / std).float(), 1.0 / len(r)
        stats.append((mean.float(), std.float()))
        for p, (rho, _) in enumerate(pairs):
            u[f, : len(r), p] = utility(gr, rho, margin).float()
    free = torch.tensor([not math.isinf(l2) for _, l2 in pairs])  # l2 = inf: the bias alone is trained
    l2s = torch.tensor([0.0 if math.isinf(l2) else l2 for _, l2 in pairs]).repeat_interleave(S)[:, None]
    weight = torch.zeros(F, P * S, D, requires_grad=True)  # row p * S + s: pair p's weights of scale s
    bias = torch.zeros(F, 1, P * S, requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=LR)
    for _ in range(STEPS):
        pi = torch.softmax(torch.baddbmm(bias, z, weight.transpose(1, 2)).view(F, n, P, S), -1)
        loss = -((pi * u).sum(-1) * row_w).sum() + (l2s * weight.pow(2)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        weight.grad.view(F, P, S, D)[:, ~free] = 0.0  # a zero gradient keeps Adam's step at exactly 0: weights stay 0
        opt.step()
    weight, bias = weight.detach().view(F, P, S, D), bias.detach().view(F, P, S)
    return [[_head(grid, *stats[f], weight[f, p], bias[f, p]) for p in range(P)] for f in range(F)]


def _constant(d: int, grid: Sequence[float], kappa: float) -> ScaleHead:
    """The head that gives every query ``kappa`` (the global rule's own choice)."""
    head = ScaleHead(d, grid)
    head.linear.bias.data[list(grid).index(kappa)] = 1.0
    return head.requires_grad_(False).eval()


def choose(head: ScaleHead, data: LabelTensors) -> torch.Tensor:
    """The head's scale for every record of ``data`` ``[R]`` (float64)."""
    with torch.no_grad():  # the controller's own path (ScaleHead.choose), so the verdict scores what ships
        return head.choose(data.table[data.q_idx], data.table[data.p_idx], data.mask).double()


def gains_at(grid: Sequence[float], gains: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``gains[r, grid.index(chosen[r])]`` per record ``[R]``."""
    idx = torch.tensor([list(grid).index(float(s)) for s in chosen.tolist()], dtype=torch.long)
    return gains.gather(1, idx.unsqueeze(1)).squeeze(1)


def fit_query_scale(data: LabelTensors, metric: str, kappa: float, rule: Any, seed: int,
                    folds: int = 3) -> tuple[ScaleHead, dict[str, Any]]:
    """``(head, {"grid", "rho", "l2"})``: the head trained on the records of ``data`` with measured gains in
    ``metric``; ``rho`` and ``l2`` chosen by an inner grouped CV under ``rule`` (a ``ScaleRule``) at ``kappa``."""
    gains = data.gains(metric)
    ok = ~torch.isnan(gains).any(1)
    rows = torch.nonzero(ok).squeeze(1).tolist()
    sub = data.subset(rows)
    grid, g = grid_with_sum(data.scales, gains[ok])
    price = risk_price(g, grid, kappa, rule.loss_margin)
    x = ScaleHead.features(sub.table[sub.q_idx], sub.table[sub.p_idx], sub.mask).double()  # [R, 2d]
    inner = group_kfold(sub.groups, folds, seed)
    constant = _constant(x.shape[1] // 2, grid, kappa)
    if len(inner) < 2:  # one question: nothing held out to choose on, the rule's own choice
        return constant, {"grid": grid, "rho": None, "l2": None}
    # first the rule's own choice, kappa for every query (rho None); a free rule (price 0) still prices risk
    base = [f * price for f in RHO_FACTORS] if price > 0 else [float(g.abs().mean()) * f for f in RHO_FACTORS]
    pairs = [(None, math.inf)] + list(dict.fromkeys((rho, l2) for rho in base for l2 in L2_GRID))
    everything = list(range(len(rows)))
    keeps = [sorted(set(everything) - set(held)) for held in inner]
    heads = fit_many(x, g, keeps, pairs[1:], grid, rule.loss_margin)
    best, best_gain = pairs[0], -math.inf
    for p, (rho, l2) in enumerate(pairs):
        got = torch.zeros(len(rows), dtype=torch.float64)
        for f, held in enumerate(inner):
            head = constant if p == 0 else heads[f][p - 1]
            got[held] = gains_at(grid, g[held], choose(head, sub.subset(held)))
        ls = loss_share(got, sub.groups, rule.loss_margin)
        tested = ls["ci95"][1] if rule.bound == "upper" else ls["share"]
        allowed = p == 0 or tested <= rule.max_loss_share
        mean = float(got.mean())
        if allowed and mean > best_gain:  # strict: ties keep the safer, simpler pair listed first
            best, best_gain = (rho, l2), mean
    rho, l2 = best
    head = constant if rho is None else fit_many(x, g, [everything], [(rho, l2)], grid, rule.loss_margin)[0][0]
    return head, {"grid": grid, "rho": rho, "l2": None if math.isinf(l2) else l2}
