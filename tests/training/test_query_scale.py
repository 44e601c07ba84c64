"""training/query_scale.py: the inner CV's heads fitted at once (``fit_many``) against one sequential fit each."""

import math

import torch

from fcprag_plugin.training import query_scale as qs

GRID = [0.5, 1.0, 1.5, 2.0, 3.0]


def test_the_batched_fits_are_the_sequential_fits():
    """Folds of different sizes (so padding), l2 = inf (the bias alone) and finite l2, several rho: each batched
    head has the weights, biases, standardisation and choices of its own sequential fit."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 6, generator=gen, dtype=torch.float64) * 2 + 1
    g = torch.randn(40, len(GRID), generator=gen, dtype=torch.float64) * 0.3 + 0.5 * x[:, :1].tanh()
    rows = [list(range(0, 30)), [i for i in range(40) if i % 3], list(range(0, 40, 2))]
    pairs = [(0.2, math.inf), (0.2, 1.0), (0.05, 0.01), (0.0, 0.1)]
    heads = qs.fit_many(x, g, rows, pairs, GRID, 0.1)
    assert [len(h) for h in heads] == [len(pairs)] * len(rows)
    moved = 0.0
    for f, r in enumerate(rows):
        for p, (rho, l2) in enumerate(pairs):
            ref = qs._fit(x[r], qs.utility(g[r], rho, 0.1), GRID, l2)
            got = heads[f][p]
            torch.testing.assert_close(got.linear.weight, ref.linear.weight, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.linear.bias, ref.linear.bias, atol=1e-5, rtol=1e-5)
            assert torch.equal(got.mean, ref.mean) and torch.equal(got.std, ref.std)
            assert torch.equal(got.grid, ref.grid)
            if math.isinf(l2):
                assert not got.linear.weight.any() and not ref.linear.weight.any()
            e_q, E_p = x[:, :3].float(), x[:, 3:].float().unsqueeze(1)  # features() gives back x: [e_q; mean E_p]
            assert torch.equal(got.choose(e_q, E_p), ref.choose(e_q, E_p))
            moved = max(moved, float(ref.linear.weight.abs().max()))
    assert moved > 0.1  # the fits went somewhere: the comparison is not of zeros
