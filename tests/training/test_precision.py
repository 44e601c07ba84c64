"""Training precision (training.precision: plain float32 autograd, or torch.autocast bfloat16) against an
independent float64 autograd reference: the full controller loss built from the concatenated pair features and
plain matrix products, with the same dropout masks (read back from the Dropout modules' outputs)."""

import pytest
import torch

from fcprag_plugin.controller import ControllerConfig, FusionController
from fcprag_plugin.features import pair_features
from fcprag_plugin.training.precision import autocast
from fcprag_plugin.training.targets import weighted_kl

D, B, N = 12, 5, 4
CFG = dict(embed_dim=D, seed=0, score_hidden=[24, 16], calib_hidden=8, init="random")


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    e_q = torch.randn(B, D, generator=g)
    E_p = torch.randn(B, N, D, generator=g)
    mask = torch.rand(B, N, generator=g) > 0.3
    mask[:, 0] = True
    mask[1] = True
    deltas = torch.randn(B, N, generator=g)
    y = torch.softmax((deltas / 0.5).masked_fill(~mask, float("-inf")), 1).masked_fill(~mask, 0.0)
    return e_q, E_p, mask, y, torch.rand(B, generator=g) + 0.1


def reference_loss(params, cfg, e_q, E_p, mask, y, omega, keeps):
    """The controller's loss in float64 from the documented formula (pair features x_i, two MLPs, set summary,
    combine, weighted KL); ``keeps`` are the dropout masks (score layer 1, score layer 2, calib layer 1)."""
    P = {k: v.double() for k, v in params.items()}
    e_q, E_p, y, omega = e_q.double(), E_p.double(), y.double(), omega.double()
    scale = 1 / (1 - cfg.dropout)
    m = mask.double()
    x = pair_features(e_q, E_p)                                                     # [B, N, 4d]
    h = torch.relu(x @ P["score_net.0.weight"].T + P["score_net.0.bias"]) * keeps[0] * scale
    h = torch.relu(h @ P["score_net.3.weight"].T + P["score_net.3.bias"]) * keeps[1] * scale
    s = torch.sigmoid((h @ P["score_net.6.weight"].T + P["score_net.6.bias"]).squeeze(-1)) * m
    cos = torch.einsum("bd,bnd->bn", e_q, E_p)
    n = m.sum(1)

    def stats(v):
        mean = (v * m).sum(1) / n
        var = ((v - mean[:, None]) ** 2 * m).sum(1) / n
        std = torch.where(var > 0, var.clamp_min(1e-300).sqrt(), 0.0)  # N = 1: std 0 with a finite gradient
        mx = v.masked_fill(~mask, float("-inf")).amax(1)
        mn = v.masked_fill(~mask, float("inf")).amin(1)
        return mean, std, mx, mn

    s_mean, s_std, s_max, s_min = stats(s)
    c_mean, c_std, c_max, c_min = stats(cos)
    summary = torch.cat([(x * m[..., None]).sum(1) / n[:, None],
                         torch.stack([s_mean, s_std, s_max, s_min, s_max - s_min,
                                      c_mean, c_std, c_max, c_min, n.log()], 1)], 1)
    hc = torch.relu(summary @ P["calib_net.0.weight"].T + P["calib_net.0.bias"]) * keeps[2] * scale
    out = hc @ P["calib_net.3.weight"].T + P["calib_net.3.bias"]
    g = torch.sigmoid(out[:, 0])
    tau = cfg.tau_min + (cfg.tau_max - cfg.tau_min) * torch.sigmoid(out[:, 1])
    pi = torch.softmax((s / tau[:, None]).masked_fill(~mask, float("-inf")), 1)
    w = (g[:, None] * pi + (1 - g[:, None]) / n[:, None]) * m
    kl = torch.where(mask & (y > 0), y * (y.clamp_min(1e-300).log() - w.clamp_min(1e-300).log()), 0).sum(1)
    return (omega * kl).sum() / omega.sum()


def train_step(c, batch, precision="fp32"):
    """One loss + backward as the trainer does it; returns (loss, grads, keep masks of the Dropout layers in
    forward order: score layer 1, score layer 2, calib layer 1)."""
    e_q, E_p, mask, y, omega = batch
    c.train()
    keeps = []
    # a unit is dropped where the ReLU output was positive and the Dropout output is 0; where the ReLU output is 0
    # the mask does not matter (no value, no gradient), so "output != 0" is a valid keep mask
    hooks = [m.register_forward_hook(lambda mod, inp, out: keeps.append((out != 0).double()))
             for m in c.modules() if isinstance(m, torch.nn.Dropout)]
    try:
        with autocast(precision):
            out = c(e_q, E_p, mask)
    finally:
        for h in hooks:
            h.remove()
    assert out.probabilities.dtype == torch.float32 and out.g.dtype == torch.float32
    loss = weighted_kl(y, out.probabilities, mask, omega, eps=0.0)
    c.zero_grad(set_to_none=True)
    loss.backward()
    return loss, {k: p.grad.clone() for k, p in c.named_parameters()}, keeps


def reference_grads(c, batch, keeps):
    params = {k: p.detach().double().requires_grad_(True) for k, p in c.named_parameters()}
    loss = reference_loss(params, c.config, *batch, keeps)
    loss.backward()
    return loss, {k: p.grad for k, p in params.items()}


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_float32_training_matches_the_float64_reference(dropout):
    torch.manual_seed(1)
    c = FusionController(ControllerConfig(**CFG, dropout=dropout))
    batch = data()
    loss, grads, keeps = train_step(c, batch)
    assert len(keeps) == 3
    if dropout:
        assert all(0 < float((k == 0).double().mean()) for k in keeps)  # dropout did drop units
    ref_loss, ref = reference_grads(c, batch, keeps if dropout else [1.0, 1.0, 1.0])
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    scale = max(float(r.abs().max()) for r in ref.values())  # float32 rounding, measured ~1e-6 of this
    for k in ref:
        err = float((grads[k].double() - ref[k]).abs().max())
        assert err <= 1e-5 * scale, (k, err, scale)


def test_bfloat16_autocast_is_close_to_the_float64_reference():
    torch.manual_seed(2)
    c = FusionController(ControllerConfig(**CFG, dropout=0.2))
    batch = data(1)
    loss, grads, keeps = train_step(c, batch, "bf16")
    ref_loss, ref = reference_grads(c, batch, keeps)
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=2e-2)
    for k in ref:
        if k.endswith("weight"):  # biases of the 1-output layer can sum nearly cancelling terms: weights suffice
            rel = float((grads[k].double() - ref[k]).norm() / ref[k].norm())
            assert rel < 3e-2, (k, rel)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in c.parameters())
    # it did compute in bfloat16 (not silently float32)
    _, grads32, _ = train_step(c, batch, "fp32")
    assert any(not torch.equal(grads[k], grads32[k]) for k in grads)


def test_autocast_contexts():
    with autocast("bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast("fp32"):
        assert not torch.is_autocast_enabled("cpu")
