"""training/query_scale.py: the heads of the inner CV fitted at once (``fit_many``) against one fit at a time,
written out here: a plain linear layer and torch's Adam, one candidate per optimisation."""

import math

import torch

from fcprag_plugin.training import query_scale as qs

GRID = [0.5, 1.0, 1.5, 2.0, 3.0]


def one_fit(x, u, l2):
    """``(linear, mean, std)``: full-batch Adam on ``-mean_b sum_s softmax(W z_b + c)_s u_bs + l2 |W|^2`` from zero,
    ``z`` = ``x`` standardised by its own mean and (biased) std in float32; only ``c`` trained for ``l2 = inf``."""
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
    z = ((x - mean) / std).float()
    lin = torch.nn.Linear(x.shape[1], u.shape[1])
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.Adam([lin.bias] if math.isinf(l2) else [lin.weight, lin.bias], lr=qs.LR)
    for _ in range(qs.STEPS):
        loss = -(torch.softmax(lin(z), 1) * u.float()).sum(1).mean()
        if not math.isinf(l2):
            loss = loss + l2 * lin.weight.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return lin.requires_grad_(False), mean.float(), std.float()


def test_the_batched_fits_are_one_fit_each():
    """Folds of different sizes (so padding), l2 = inf (the bias alone) and finite l2, several rho: each batched
    head has the weights, biases, standardisation and choices of its own fit."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 6, generator=gen, dtype=torch.float64) * 2 + 1
    g = torch.randn(40, len(GRID), generator=gen, dtype=torch.float64) * 0.3 + 0.5 * x[:, :1].tanh()
    rows = [list(range(0, 30)), list(range(0, 40, 2))]
    pairs = [(0.2, math.inf), (0.05, 0.01), (0.0, 0.1)]
    heads = qs.fit_many(x, g, rows, pairs, GRID, 0.1)
    assert [len(h) for h in heads] == [len(pairs)] * len(rows)
    e_q, E_p = x[:, :3].float(), x[:, 3:].float().unsqueeze(1)  # ScaleHead.features gives back x: [e_q; mean E_p]
    moved = 0.0
    for f, r in enumerate(rows):
        for p, (rho, l2) in enumerate(pairs):
            u = g[r] - rho * (g[r] < -0.1).double()  # the utility, by its formula
            lin, mean, std = one_fit(x[r], u, l2)
            got = heads[f][p]
            torch.testing.assert_close(got.linear.weight, lin.weight, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.linear.bias, lin.bias, atol=1e-5, rtol=1e-5)
            assert torch.equal(got.mean, mean) and torch.equal(got.std, std)
            assert got.grid.tolist() == GRID and not got.linear.weight.requires_grad
            if math.isinf(l2):
                assert not got.linear.weight.any()
            with torch.no_grad():
                ref = torch.tensor(GRID)[lin((x.float() - mean) / std).argmax(1)]
            assert torch.equal(got.choose(e_q, E_p), ref)
            moved = max(moved, float(lin.weight.abs().max()))
    assert moved > 0.1  # the fits went somewhere: the comparison is not of zeros
