"""FusionController: the formula, masking with mixed N, baselines, persistence and config errors."""

import json

import pytest
import torch

from fcprag_plugin import ControllerError, FusionController
from fcprag_plugin.controller import ControllerConfig
from fcprag_plugin.networks import combine, split_first_linear
from fcprag_plugin.features import pair_features, passage_features


def mlp_on_full_features(net, x):
    """The net's layers applied one after the other to the concatenated features ``x`` (an independent reference for
    ScoreNet, whose forward splits the first layer)."""
    for layer in net:
        x = layer(x)
    return x


def test_reference_vector():
    s = torch.tensor([[0.4886, 0.4649, 0.4761]])
    w, wt = combine(s, torch.tensor([0.8178]), torch.tensor([0.0817]), torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(wt, torch.tensor([[1.1235, 0.8864, 0.9901]]), atol=1e-3, rtol=0)
    torch.testing.assert_close(w.sum(1), torch.ones(1))


def test_formula_against_independent_computation():
    torch.manual_seed(0)
    c = FusionController(embed_dim=8, seed=1, init="random").eval()
    e_q = torch.nn.functional.normalize(torch.randn(1, 8), dim=-1)
    E_p = torch.nn.functional.normalize(torch.randn(1, 4, 8), dim=-1)
    out = c(e_q, E_p)
    # recompute from the parts by hand
    x = torch.cat([e_q.expand(4, 8), E_p[0], e_q * E_p[0], (e_q - E_p[0]).abs()], dim=-1)
    s = torch.sigmoid(mlp_on_full_features(c.score_net, x)).squeeze(-1)
    torch.testing.assert_close(out.scores[0], s)
    g, tau = float(out.g[0]), float(out.tau[0])
    assert 0 < g < 1 and c.config.tau_min <= tau <= c.config.tau_max
    pi = torch.exp(s / tau) / torch.exp(s / tau).sum()
    w = g * pi + (1 - g) / 4
    torch.testing.assert_close(out.probabilities[0], w)
    torch.testing.assert_close(out.merge_weights[0], 4 * w / (w.sum() + 1e-8))


def test_single_passage_gives_one():
    c = FusionController(embed_dim=8, seed=0, init="random").eval()
    out = c(torch.randn(1, 8), torch.randn(1, 1, 8))
    torch.testing.assert_close(out.merge_weights, torch.ones(1, 1))


def test_masking_mixed_n_equals_unpadded():
    """A padded batch of sets with N = 1, 3, 5 gives exactly what each set alone gives."""
    torch.manual_seed(0)
    c = FusionController(embed_dim=8, seed=3, init="random").eval()
    sizes = [1, 3, 5]
    qs = [torch.randn(1, 8) for _ in sizes]
    ps = [torch.randn(1, n, 8) for n in sizes]
    E = torch.zeros(3, 5, 8)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for b, (p, n) in enumerate(zip(ps, sizes)):
        E[b, :n] = p[0]
        E[b, n:] = 123.0  # garbage in the padding must not matter
        mask[b, :n] = True
    batched = c(torch.cat(qs), E, mask)
    for b, n in enumerate(sizes):
        alone = c(qs[b], ps[b])
        torch.testing.assert_close(batched.merge_weights[b, :n], alone.merge_weights[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batched.g[b], alone.g[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batched.tau[b], alone.tau[0], rtol=1e-5, atol=1e-6)
        assert torch.all(batched.merge_weights[b, n:] == 0) and torch.all(batched.probabilities[b, n:] == 0)
        assert float(batched.probabilities[b].sum()) == pytest.approx(1.0, abs=1e-6)
        assert float(batched.merge_weights[b].sum()) == pytest.approx(n, abs=1e-4)


def test_uniform_mode_is_exactly_prag():
    c = FusionController.uniform(8)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = c(torch.randn(2, 8), torch.randn(2, 3, 8), mask)
    assert torch.equal(out.merge_weights, mask.float())
    assert torch.equal(out.g, torch.zeros(2))


def test_random_mode_seeded_and_untrained():
    a, b = FusionController.random(8, seed=7), FusionController.random(8, seed=7)
    c = FusionController.random(8, seed=8)
    for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(v, w), k
    assert not torch.equal(a.score_net[0].weight, c.score_net[0].weight)
    assert a.config.controller_mode == "random"


def test_fixed_mode_uses_global_g_tau_and_cosine():
    c = FusionController.fixed(g=0.6, tau=0.2, embed_dim=4)
    e_q = torch.tensor([[1.0, 0, 0, 0]])
    E_p = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [-1.0, 0, 0, 0]]])
    out = c(e_q, E_p)
    torch.testing.assert_close(out.scores, torch.tensor([[1.0, 0.5, 0.0]]))
    assert torch.allclose(out.g, torch.tensor([0.6])) and torch.allclose(out.tau, torch.tensor([0.2]))
    pi = torch.softmax(torch.tensor([1.0, 0.5, 0.0]) / 0.2, 0)
    torch.testing.assert_close(out.probabilities[0], 0.6 * pi + 0.4 / 3)


def test_pair_features_layout():
    e_q = torch.tensor([[1.0, -2.0]])
    E_p = torch.tensor([[[3.0, 4.0]]])
    torch.testing.assert_close(pair_features(e_q, E_p), torch.tensor([[[1.0, -2.0, 3.0, 4.0, 3.0, -8.0, 2.0, 6.0]]]))


def test_save_load_roundtrip_identical(tmp_path):
    torch.manual_seed(0)
    c = FusionController(embed_dim=8, seed=5, embedding_model="hash-8", init="random").eval()
    c.save_pretrained(tmp_path / "ctrl")
    assert sorted(p.name for p in (tmp_path / "ctrl").iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "ctrl" / "config.json").read_text())
    assert cfg["embedding_model"] == "hash-8" and cfg["embed_dim"] == 8
    d = FusionController.from_pretrained(tmp_path / "ctrl")
    x, P = torch.randn(2, 8), torch.randn(2, 3, 8)
    a, b = c(x, P), d(x, P)
    assert torch.equal(a.merge_weights, b.merge_weights) and torch.equal(a.tau, b.tau)


def test_dimension_mismatch_with_encoder(encoder16):
    c = FusionController(embed_dim=8, embedding_model="hash-8")
    with pytest.raises(ControllerError, match=r"'hash-16' gives 16-d.*expects 8-d.*'hash-8'"):
        c.predict("q", ["p"], encoder16)
    with pytest.raises(ControllerError, match=r"dimension 16 does not match.*embed_dim 8"):
        c(torch.randn(1, 16), torch.randn(1, 2, 16))


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ControllerError, match=r"nothere: controller directory not found"):
        FusionController.from_pretrained(tmp_path / "nothere")
    d = FusionController(embed_dim=8).save_pretrained(tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "temperature": 3}))
    with pytest.raises(ControllerError, match=r"config\.json: unknown key\(s\) \['temperature'\]"):
        FusionController.from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "controller_mode": "smart"}))
    with pytest.raises(ControllerError, match=r"config\.json: key 'controller_mode' is 'smart'"):
        FusionController.from_pretrained(d)
    old = {k: v for k, v in cfg.items() if k != "controller_mode"}  # 'mode' is no key of the format
    (d / "config.json").write_text(json.dumps({**old, "mode": cfg["controller_mode"]}))
    with pytest.raises(ControllerError, match=r"config\.json: unknown key\(s\) \['mode'\]"):
        FusionController.from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "embed_dim": 16}))
    with pytest.raises(ControllerError, match=r"model\.safetensors: key '\w+_net\.0\.weight' has shape .*the config implies .*embed_dim 16"):
        FusionController.from_pretrained(d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ControllerError, match=r"model\.safetensors: corrupt"):
        FusionController.from_pretrained(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ControllerError, match=r"model\.safetensors: controller weights not found"):
        FusionController.from_pretrained(d)


def test_bad_inputs():
    c = FusionController(embed_dim=4)
    with pytest.raises(ControllerError, match=r"at least one unmasked passage"):
        c(torch.randn(1, 4), torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.bool))
    with pytest.raises(ControllerError, match=r"N == 0"):
        c(torch.randn(1, 4), torch.randn(1, 0, 4))
    with pytest.raises(ControllerError, match=r"tau_min/'tau_max'|tau_min'/'tau_max'"):
        ControllerConfig(tau_min=2.0, tau_max=1.0).validate()


def test_split_first_layer_equals_a_linear_on_the_concatenated_features():
    """W[:, :d] e_q + b + W[:, d:] xp_i (the controller's evaluation) == nn.Linear(4d, H) on x_i."""
    torch.manual_seed(0)
    d, B, N, H = 24, 4, 5, 32
    lin = torch.nn.Linear(4 * d, H).double()
    e_q, E_p = torch.randn(B, d, dtype=torch.float64), torch.randn(B, N, d, dtype=torch.float64)
    ref = lin(pair_features(e_q, E_p))
    x = pair_features(e_q, E_p)
    torch.testing.assert_close(torch.cat([e_q.unsqueeze(1).expand(B, N, d), passage_features(e_q, E_p)], -1), x,
                               rtol=0, atol=0)
    got = split_first_linear(lin.weight, lin.bias, e_q, passage_features(e_q, E_p))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    lin32 = lin.float()  # float32: same values up to rounding of a differently ordered sum
    got32 = split_first_linear(lin32.weight, lin32.bias, e_q.float(), passage_features(e_q.float(), E_p.float()))
    torch.testing.assert_close(got32, ref.float(), rtol=1e-5, atol=1e-5)
    # gradients reach every block of the one weight matrix
    lin32.zero_grad()
    split_first_linear(lin32.weight, lin32.bias, e_q.float(), passage_features(e_q.float(), E_p.float())).sum().backward()
    g = lin32.weight.grad.clone()
    lin32.zero_grad()
    lin32(x.float()).sum().backward()
    torch.testing.assert_close(g, lin32.weight.grad, rtol=1e-5, atol=1e-5)


def test_state_dict_layout_is_unchanged():
    """Saved controllers keep loading: the same keys and shapes as the plain two-MLP layout."""
    c = FusionController(embed_dim=8, score_hidden=[16, 8], calib_hidden=4)
    assert {k: list(v.shape) for k, v in c.state_dict().items()} == {
        "score_net.0.weight": [16, 32], "score_net.0.bias": [16], "score_net.3.weight": [8, 16],
        "score_net.3.bias": [8], "score_net.6.weight": [1, 8], "score_net.6.bias": [1],
        "calib_net.0.weight": [4, 42], "calib_net.0.bias": [4], "calib_net.3.weight": [2, 4],
        "calib_net.3.bias": [2]}


def test_unmasked_fast_path_equals_an_all_true_mask_and_the_mlps_on_full_features():
    torch.manual_seed(1)
    c = FusionController(embed_dim=8, seed=2, init="random").eval()
    e_q, E_p = torch.randn(3, 8), torch.randn(3, 4, 8)
    a = c(e_q, E_p)
    b = c(e_q, E_p, torch.ones(3, 4, dtype=torch.bool))
    for k in ("scores", "g", "tau", "probabilities", "merge_weights"):
        torch.testing.assert_close(getattr(a, k), getattr(b, k), rtol=0, atol=0)
    assert a.mask.dtype == torch.bool and bool(a.mask.all())
    # the scores are the score net applied to the full pair features
    x = pair_features(e_q, E_p)
    torch.testing.assert_close(a.scores, torch.sigmoid(mlp_on_full_features(c.score_net, x).squeeze(-1)), rtol=1e-5, atol=1e-6)


def _sharp_controller(d=64, seed=0):
    """A random controller made as decisive as a trained one: scores spread like a trained controller's (std
    ~0.12), g ~ 0.98 and tau near its 0.05 floor, so score errors are amplified ~20x in w~."""
    c = FusionController(embed_dim=d, seed=seed, init="random").eval()
    with torch.no_grad():
        c.score_net[-1].weight.mul_(60.0)
        c.calib_net[-1].bias.copy_(torch.tensor([4.0, -6.0]))
    return c


# documented in FusionController.for_inference: (max |s - s_fp32|, max |w~ - w~_fp32|)
INFERENCE_TOLERANCE = {torch.bfloat16: (5e-3, 0.08)}


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_for_inference_is_within_the_documented_tolerance(dtype):
    c = _sharp_controller()
    fast = c.for_inference(dtype)
    g = torch.Generator().manual_seed(1)
    e_q = torch.nn.functional.normalize(torch.randn(500, 64, generator=g), dim=-1)
    E_p = torch.nn.functional.normalize(torch.randn(500, 5, 64, generator=g), dim=-1)
    with torch.no_grad():
        ref, out = c(e_q, E_p), fast(e_q, E_p)
    assert float(ref.g.mean()) > 0.9 and float(ref.tau.mean()) < 0.1 and float(ref.scores.std()) > 0.1
    tol_s, tol_w = INFERENCE_TOLERANCE[dtype]
    assert float((out.scores - ref.scores).abs().max()) <= tol_s
    assert float((out.merge_weights - ref.merge_weights).abs().max()) <= tol_w
    assert 0 < float((out.merge_weights - ref.merge_weights).abs().max())  # it did use the converted weights
    # the same ranking wherever the float32 scores are 2e-2 apart (twice the score tolerance)
    srt, order = ref.scores.sort(1, descending=True)
    separated = (srt[:, :-1] - srt[:, 1:] >= 2e-2).all(1)
    assert int(separated.sum()) > 50
    assert torch.equal(out.scores.argsort(1, descending=True)[separated], order[separated])
    top_gap = srt[:, 0] - srt[:, 1] >= 2e-2
    assert int(top_gap.sum()) > 300
    assert torch.equal(out.merge_weights.argmax(1)[top_gap], ref.merge_weights.argmax(1)[top_gap])
    # one query at a time (the benchmark's batch 1) gives what the batch gives
    with torch.no_grad():
        one = fast(e_q[:1], E_p[:1])
    torch.testing.assert_close(one.merge_weights, out.merge_weights[:1], atol=tol_w, rtol=0)


def test_for_inference_masks_like_the_original_and_keeps_parameters():
    torch.manual_seed(2)
    c = FusionController(embed_dim=16, seed=4, init="random").eval()
    fast = c.for_inference(torch.float32)
    e_q, E_p = torch.randn(3, 16), torch.randn(3, 4, 16)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True], [True, False, False, False]])
    a, b = c(e_q, E_p, mask), fast(e_q, E_p, mask)
    torch.testing.assert_close(a.merge_weights, b.merge_weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(b.merge_weights[~mask], torch.zeros(int((~mask).sum())))
    # a copy: same float32 parameters, frozen; the original is untouched and still trainable
    for (k, v), (_, w) in zip(c.state_dict().items(), fast.state_dict().items()):
        assert torch.equal(v, w), k
    assert not any(p.requires_grad for p in fast.parameters()) and all(p.requires_grad for p in c.parameters())
    assert c.score_net[0].weight.dtype == torch.float32


def test_for_inference_follows_loaded_weights_and_refuses_training(tmp_path):
    c = FusionController(embed_dim=16, seed=5, init="random").eval()
    other = FusionController(embed_dim=16, seed=6, init="random").eval()
    fast = c.for_inference(torch.bfloat16)
    e_q, E_p = torch.randn(2, 16), torch.randn(2, 3, 16)
    before = fast(e_q, E_p).scores
    fast.load_state_dict(other.state_dict())  # in-place copy into the bf16 weights
    torch.testing.assert_close(fast(e_q, E_p).scores, other(e_q, E_p).scores, atol=5e-3, rtol=0)
    assert not torch.allclose(before, fast(e_q, E_p).scores, atol=1e-3)
    fast.train()
    with pytest.raises(ControllerError, match=r"inference copy \(for_inference\)"):
        fast(e_q, E_p)
    with pytest.raises(ControllerError, match=r"dtype torch.float16 is not supported"):
        c.for_inference(torch.float16)
    # saving an inference copy writes its (bfloat16-rounded) weights as float32: an ordinary controller again
    fast.eval().save_pretrained(tmp_path / "c")
    again = FusionController.from_pretrained(tmp_path / "c")
    for k, v in other.state_dict().items():
        assert again.state_dict()[k].dtype == torch.float32 and torch.equal(again.state_dict()[k], v.bfloat16().float())
    torch.testing.assert_close(again(e_q, E_p).scores, fast(e_q, E_p).scores, rtol=0, atol=5e-3)


def test_for_inference_made_and_used_inside_inference_mode():
    """An inference copy made and used under torch.inference_mode works like one made outside it."""
    c = FusionController(embed_dim=16, seed=7, init="random").eval()
    e_q, E_p = torch.randn(2, 16), torch.randn(2, 3, 16)
    with torch.inference_mode():
        fast = c.for_inference(torch.bfloat16)
        a, b = fast(e_q, E_p), fast(e_q, E_p)
        ref = c(e_q, E_p)
    assert torch.equal(a.merge_weights, b.merge_weights)
    torch.testing.assert_close(a.merge_weights, ref.merge_weights, atol=0.08, rtol=0)


def test_a_config_without_the_optional_keys_loads_with_their_defaults(tmp_path):
    """config.json with only the network's keys (no init / side-feature / scale / cv keys): the same weights and
    outputs, the optional keys at their defaults."""
    c = FusionController(embed_dim=8, seed=9, init="random").eval()
    d = c.save_pretrained(tmp_path / "ctrl")
    cfg = json.loads((d / "config.json").read_text())
    needed = {"embed_dim", "embedding_model", "score_hidden", "calib_hidden", "dropout", "tau_min", "tau_max",
              "scorer", "fixed_g", "fixed_tau", "seed", "format_version", "library"}
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k in needed}))
    again = FusionController.from_pretrained(d)
    assert again.config.side_features == [] and again.config.kappa == 1.0 and again.config.cv is None
    e_q, E_p = torch.randn(2, 8), torch.randn(2, 3, 8)
    assert torch.equal(again(e_q, E_p).merge_weights, c(e_q, E_p).merge_weights)


@pytest.mark.parametrize("key", ["eps", "query_scale"])
def test_a_key_that_is_not_a_field_is_an_error_naming_it(tmp_path, key):
    d = FusionController(embed_dim=8, seed=3).save_pretrained(tmp_path / "ctrl")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, key: 1e-8}))
    with pytest.raises(ControllerError, match=rf"config\.json: unknown key\(s\) \['{key}'\]; expected keys among"):
        FusionController.from_pretrained(d)


@pytest.mark.parametrize("old", [{"controller_mode": "scale", "scale_grid": [0.5, 1.0, 2.0]},
                                 {"scale_grid": [1.0, 2.0]}, {"cv": {"shipped": "query_scale", "gain": 0.1}}])
def test_a_saved_per_query_scale_controller_is_refused_in_one_line_saying_why(tmp_path, old):
    d = FusionController.scale_only(2.0, embed_dim=8).save_pretrained(tmp_path / "ctrl")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **old}))
    with pytest.raises(ControllerError) as e:
        FusionController.from_pretrained(d)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{d / 'config.json'}: a per-query scale controller")
    assert "was removed (docs/results/per-query-scale.md); train a new one with fcprag train" in msg


def test_a_config_of_the_version_before_with_its_empty_scale_grid_still_loads(tmp_path):
    """Every controller saved before the per-query scale was removed says "scale_grid": null."""
    c = FusionController.scale_only(2.0, embed_dim=8)
    d = c.save_pretrained(tmp_path / "ctrl")
    cfg = json.loads((d / "config.json").read_text())
    assert "scale_grid" not in cfg
    (d / "config.json").write_text(json.dumps({**cfg, "scale_grid": None}))
    again = FusionController.from_pretrained(d)
    assert again.config == c.config
    e_q, E_p = torch.randn(2, 8), torch.randn(2, 3, 8)
    assert torch.equal(again(e_q, E_p).merge_weights, torch.full((2, 3), 2.0))
