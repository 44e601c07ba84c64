"""Targets, the weighted KL objective and the metrics, against independent per-sample reference computations."""

import math

import pytest
import torch

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.training.data import LabelTensors
from fcprag_plugin.training.evaluation import (average_ranks, entropy, metrics_from_outputs, spearman_per_sample,
                                            top1_credit)
from fcprag_plugin.training.targets import make_targets, weighted_kl


def ragged(seed=0, B=7, N=5):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, N + 1, (B,), generator=g)
    lens[0] = N
    mask = torch.arange(N)[None] < lens[:, None]
    deltas = torch.randn(B, N, generator=g).masked_fill(~mask, 0.0)
    w = torch.rand(B, N, generator=g).masked_fill(~mask, 0.0)
    w = w / w.sum(1, keepdim=True)
    return deltas, w, mask, lens


def ref_softmax(xs, t):
    m = max(xs)
    e = [math.exp((x - m) / t) for x in xs]
    return [v / sum(e) for v in e]


def test_targets_flat_and_weights_match_a_per_sample_reference():
    deltas, _, mask, lens = ragged()
    deltas[1, : lens[1]] = 0.3  # a flat sample
    deltas[2, : lens[2]] = torch.tensor([0.2] * int(lens[2])) + torch.arange(int(lens[2])) * 1e-8  # nearly flat
    y, omega, flat = make_targets(deltas, mask, t_label=0.2, flat_eps=1e-6, flat_weight=0.25)
    for b in range(len(lens)):
        n = int(lens[b])
        d = deltas[b, :n].tolist()
        assert y[b, :n].tolist() == pytest.approx(ref_softmax(d, 0.2), abs=1e-6)
        assert float(y[b, n:].abs().sum()) == 0.0
        is_flat = max(d) - min(d) <= 1e-6
        assert bool(flat[b]) == is_flat
        assert float(omega[b]) == (0.25 if is_flat else 1.0)
    assert bool(flat[1]) and bool(flat[2])
    # N = 1 is always flat (nothing to rank), whatever its delta
    y1, _, flat1 = make_targets(torch.tensor([[0.4, 9.0, -9.0]]), torch.tensor([[True, False, False]]))
    assert bool(flat1[0]) and y1.tolist() == [[1.0, 0.0, 0.0]]


def test_target_argument_errors():
    d, _, m, _ = ragged()
    with pytest.raises(FcpragError, match="t_label is 0"):
        make_targets(d, m, t_label=0)
    with pytest.raises(FcpragError, match="flat_weight is -1"):
        make_targets(d, m, flat_weight=-1)
    with pytest.raises(FcpragError, match="flat_eps is -0.1"):
        make_targets(d, m, flat_eps=-0.1)


def test_weighted_kl_matches_a_float64_loop_and_ignores_padding():
    deltas, w, mask, lens = ragged(seed=3)
    y, omega, _ = make_targets(deltas, mask, t_label=0.5)
    omega = torch.tensor([1.0, 0.1, 2.0, 1.0, 0.5, 1.0, 0.0])
    got = float(weighted_kl(y, w, mask, omega))
    num = den = 0.0
    for b in range(len(lens)):
        n = int(lens[b])
        yb, wb = y[b, :n].double().tolist(), w[b, :n].double().tolist()
        kl = sum(p * (math.log(p) - math.log(q)) for p, q in zip(yb, wb) if p > 0)
        num += float(omega[b]) * kl
        den += float(omega[b])
    assert got == pytest.approx(num / (den + 1e-8), rel=1e-5)
    # padding: garbage in padded slots (targets and weights) changes nothing
    y2, w2 = y.clone(), w.clone()
    y2[~mask], w2[~mask] = 0.7, 0.3
    assert float(weighted_kl(y2, w2, mask, omega)) == pytest.approx(got, rel=1e-6)
    # extra padding columns change nothing either
    pad = lambda t: torch.cat([t, torch.zeros(t.shape[0], 3, dtype=t.dtype)], 1)  # noqa: E731
    assert float(weighted_kl(pad(y), pad(w), pad(mask), omega)) == pytest.approx(got, rel=1e-6)
    # KL(y || y) = 0 and the gradient flows to w
    assert float(weighted_kl(y, y, mask, omega)) == pytest.approx(0.0, abs=1e-6)
    wg = w.clone().requires_grad_(True)
    weighted_kl(y, wg, mask, omega).backward()
    assert torch.isfinite(wg.grad).all() and float(wg.grad[mask].abs().sum()) > 0


def test_spearman_matches_scipy_including_ties():
    from scipy import stats  # the test extra

    deltas, w, mask, lens = ragged(seed=5, B=30, N=6)
    deltas = (deltas * 2).round() / 2  # plenty of ties
    rho, defined = spearman_per_sample(w, deltas, mask)
    for b in range(30):
        n = int(lens[b])
        a, d = w[b, :n].numpy(), deltas[b, :n].numpy()
        if n >= 2 and len(set(a.tolist())) > 1 and len(set(d.tolist())) > 1:
            assert bool(defined[b])
            assert float(rho[b]) == pytest.approx(stats.spearmanr(a, d).statistic, abs=1e-9)
        else:
            assert not bool(defined[b]) and math.isnan(float(rho[b]))
    r = average_ranks(torch.tensor([[3.0, 1.0, 3.0, 2.0]]), torch.tensor([[True, True, True, False]]))
    assert r.tolist() == [[2.5, 1.0, 2.5, 0.0]]


def test_top1_credit_is_tie_aware():
    mask = torch.ones(3, 3, dtype=torch.bool)
    w = torch.tensor([[0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]])
    d = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert top1_credit(w, d, mask).tolist() == pytest.approx([1.0, 1 / 3, 0.5])


def test_entropy_reference():
    w = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    ref = [math.log(2), 0.0, -sum(p * math.log(p) for p in (0.2, 0.3, 0.5))]
    assert entropy(w, mask).tolist() == pytest.approx(ref)


def _tensors(deltas, mask, **kw):
    y, omega, flat = make_targets(deltas, mask, **kw)
    B = deltas.shape[0]
    return LabelTensors(torch.zeros(1, 4), torch.zeros(B, dtype=torch.long), torch.zeros_like(mask, dtype=torch.long),
                        mask, deltas, y, omega, flat, [str(i) for i in range(B)], [str(i) for i in range(B)])


def test_metrics_from_outputs_against_direct_computation():
    deltas, w, mask, lens = ragged(seed=9, B=12, N=4)
    deltas[3, : lens[3]] = 0.0  # flat
    data = _tensors(deltas, mask, t_label=0.3, flat_weight=0.5)
    g, tau = torch.rand(12), torch.rand(12) + 0.05
    m = metrics_from_outputs(w, g, tau, data)
    nonflat = [b for b in range(12) if not bool(data.flat[b])]
    assert m["n"] == 12 and m["n_nonflat"] == len(nonflat)
    kls = []
    for b in range(12):
        n = int(lens[b])
        yb, wb = data.y[b, :n].double(), w[b, :n].double()
        kls.append(float((yb * (yb.log() - wb.log())).sum()))
    om = data.omega.double()
    assert m["kl"] == pytest.approx(float((om * torch.tensor(kls)).sum() / om.sum()), rel=1e-6)
    assert m["kl_nonflat"] == pytest.approx(sum(kls[b] for b in nonflat) / len(nonflat), rel=1e-6)
    top = []
    for b in nonflat:
        n = int(lens[b])
        top.append(float(int(w[b, :n].argmax()) in set(torch.nonzero(deltas[b, :n] == deltas[b, :n].max()).flatten().tolist())))
    assert m["top1"] == pytest.approx(sum(top) / len(top))
    assert m["g_mean"] == pytest.approx(float(g.mean())) and m["g_std"] == pytest.approx(float(g.std(unbiased=False)))
    assert m["tau_mean"] == pytest.approx(float(tau.mean()))
