"""The trainer's MLP kernels (training.precision.TrainRunner) against an independent float64 autograd reference:
the full controller loss built from the concatenated pair features and plain matrix products, with the same
dropout masks. Also: gradient buffers are reused (no per-step allocation), accumulation, bfloat16 accuracy."""

import pytest
import torch

from fcprag_plugin.controller import ControllerConfig, FusionController
from fcprag_plugin.features import pair_features
from fcprag_plugin.training.precision import TrainRunner, _ReluDropoutFn, mixed_precision, use_runner
from fcprag_plugin.training.targets import weighted_kl

D, B, N = 12, 5, 4
CFG = dict(embed_dim=D, seed=0, score_hidden=[24, 16], calib_hidden=8)


class RecordingRunner(TrainRunner):
    """Records the dropout keep-masks it draws, in order."""

    def __init__(self, dtype):
        super().__init__(dtype)
        self.keeps = []

    def keep_mask(self, shape, p, device):
        k = super().keep_mask(shape, p, device)
        self.keeps.append(k)
        return k


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


def runner_step(c, runner, batch):
    e_q, E_p, mask, y, omega = batch
    c.train()
    with use_runner(c, runner):
        out = c(e_q, E_p, mask)
    loss = weighted_kl(y, out.weights, mask, omega, eps=0.0)
    c.zero_grad(set_to_none=True)
    loss.backward()
    return loss, {k: p.grad.clone() for k, p in c.named_parameters()}


def reference_grads(c, batch, keeps):
    params = {k: p.detach().double().requires_grad_(True) for k, p in c.named_parameters()}
    loss = reference_loss(params, c.config, *batch, keeps)
    loss.backward()
    return loss, {k: p.grad for k, p in params.items()}


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_float32_kernels_match_the_float64_reference(dropout):
    torch.manual_seed(1)
    c = FusionController(ControllerConfig(**CFG, dropout=dropout))
    batch = data()
    runner = RecordingRunner(torch.float32)
    loss, grads = runner_step(c, runner, batch)
    keeps = [k.double() for k in runner.keeps] if dropout else [1.0, 1.0, 1.0]
    assert len(runner.keeps) == (3 if dropout else 0)
    ref_loss, ref = reference_grads(c, batch, keeps)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    scale = max(float(r.abs().max()) for r in ref.values())  # float32 rounding, measured ~1e-6 of this
    for k in ref:
        err = float((grads[k].double() - ref[k]).abs().max())
        assert err <= 1e-5 * scale, (k, err, scale)


def test_bfloat16_kernels_are_close_to_the_float64_reference():
    torch.manual_seed(2)
    c = FusionController(ControllerConfig(**CFG, dropout=0.2))
    batch = data(1)
    runner = RecordingRunner(torch.bfloat16)
    loss, grads = runner_step(c, runner, batch)
    ref_loss, ref = reference_grads(c, batch, [k.double() for k in runner.keeps])
    assert float(loss.detach()) == pytest.approx(float(ref_loss), rel=2e-2)
    for k in ref:
        if k.endswith("weight"):  # biases of the 1-output layer can sum nearly cancelling terms: weights suffice
            rel = float((grads[k].double() - ref[k]).norm() / ref[k].norm())
            assert rel < 3e-2, (k, rel)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in c.parameters())


def test_relu_dropout_function_against_autograd():
    torch.manual_seed(3)
    x = torch.randn(4, 3, 7, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(4, 3, 7) >= 0.25
    g = torch.randn(4, 3, 7, dtype=torch.float64)
    out = _ReluDropoutFn.apply(x, keep, 1 / 0.75)
    (gx,) = torch.autograd.grad(out, x, g)
    x2 = x.detach().clone().requires_grad_(True)
    ref = torch.relu(x2) * keep / 0.75
    (gref,) = torch.autograd.grad(ref, x2, g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, gref)


def test_keep_rate_is_one_minus_p():
    torch.manual_seed(4)
    k = TrainRunner(torch.float32).keep_mask(torch.Size([200_000]), 0.1, torch.device("cpu"))
    assert float(k.float().mean()) == pytest.approx(0.9, abs=3e-3)  # 0.9 +- 4.5 sigma


def test_gradient_buffers_are_reused_and_accumulation_adds():
    torch.manual_seed(5)
    c = FusionController(ControllerConfig(**CFG, dropout=0.0))
    runner = TrainRunner(torch.bfloat16)
    batch = data(2)
    _, g1 = runner_step(c, runner, batch)
    ptrs = {k: p.grad.data_ptr() for k, p in c.named_parameters() if k.endswith("weight")}
    _, g2 = runner_step(c, runner, batch)
    assert {k: p.grad.data_ptr() for k, p in c.named_parameters() if k.endswith("weight")} == ptrs
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k  # same weights, same batch: same gradient
    # without set_to_none the second backward adds to the first
    e_q, E_p, mask, y, omega = batch
    c.zero_grad(set_to_none=False)
    with use_runner(c, runner):
        for _ in range(2):
            weighted_kl(y, c(e_q, E_p, mask).weights, mask, omega, eps=0.0).backward()
    for k, p in c.named_parameters():
        torch.testing.assert_close(p.grad, 2 * g1[k], rtol=1e-6, atol=1e-9, msg=k)


def test_shadow_weights_follow_the_fused_optimizer():
    """Fused AdamW changes parameters without bumping their version counter; the bf16 copies must follow."""
    torch.manual_seed(6)
    c = FusionController(ControllerConfig(**CFG, dropout=0.0))
    opt = torch.optim.AdamW(c.parameters(), lr=1e-2)
    runner = TrainRunner(torch.bfloat16)
    batch = data(3)
    runner_step(c, runner, batch)
    opt.step()
    c.eval()
    with torch.no_grad(), use_runner(c, runner):
        fast = c(*batch[:3]).merge_weights
    with torch.no_grad():
        exact = c(*batch[:3]).merge_weights
    torch.testing.assert_close(fast, exact, atol=2e-2, rtol=0)
    assert all(torch.equal(s.w, s.weight.to(torch.bfloat16)) for s in runner._slots.values())


def test_mixed_precision_context_restores_the_controller():
    c = FusionController(ControllerConfig(**CFG))
    with mixed_precision(c, torch.bfloat16):
        assert isinstance(c.runner, TrainRunner)
    assert "_runner" not in vars(c) and type(c.runner).__name__ == "MLPRunner"
    with pytest.raises(ValueError, match="bfloat16 only"):
        with mixed_precision(c, torch.float16):
            pass
    with pytest.raises(ValueError, match="training precision supports"):
        TrainRunner(torch.float16)


def test_default_float32_path_matches_the_float64_reference():
    """Without a TrainRunner (plain autograd, e.g. a user's own training loop) the same loss and gradients."""
    torch.manual_seed(7)
    c = FusionController(ControllerConfig(**CFG, dropout=0.0)).train()
    batch = data(4)
    e_q, E_p, mask, y, omega = batch
    loss = weighted_kl(y, c(e_q, E_p, mask).weights, mask, omega, eps=0.0)
    loss.backward()
    ref_loss, ref = reference_grads(c, batch, [1.0, 1.0, 1.0])
    torch.testing.assert_close(loss.detach().double(), ref_loss, rtol=1e-5, atol=1e-7)
    scale = max(float(r.abs().max()) for r in ref.values())
    for k, p in c.named_parameters():
        assert float((p.grad.double() - ref[k]).abs().max()) <= 1e-5 * scale, k


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_rate_and_odd_sizes(p):
    torch.manual_seed(8)
    r = TrainRunner(torch.float32)
    k = r.keep_mask(torch.Size([3, 66_667]), p, torch.device("cpu"))  # odd element count
    assert k.shape == (3, 66_667) and k.dtype == torch.bool
    # 200,001 Bernoulli draws: the rate within 5 sigma of 1 - p
    assert abs(float(k.float().mean()) - (1 - p)) < 5 * ((p * (1 - p)) / k.numel()) ** 0.5
    assert not torch.equal(k, r.keep_mask(torch.Size([3, 66_667]), p, torch.device("cpu")))
