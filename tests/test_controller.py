"""FusionController: the formula, masking with mixed N, baselines, persistence and config errors."""

import json

import pytest
import torch

from fcprag_plugin import ControllerError, FusionController
from fcprag_plugin.controller import ControllerConfig, combine
from fcprag_plugin.features import pair_features


def test_reference_vector():
    s = torch.tensor([[0.4886, 0.4649, 0.4761]])
    w, wt = combine(s, torch.tensor([0.8178]), torch.tensor([0.0817]), torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(wt, torch.tensor([[1.1235, 0.8864, 0.9901]]), atol=1e-3, rtol=0)
    torch.testing.assert_close(w.sum(1), torch.ones(1))


def test_formula_against_independent_computation():
    torch.manual_seed(0)
    c = FusionController(embed_dim=8, seed=1).eval()
    e_q = torch.nn.functional.normalize(torch.randn(1, 8), dim=-1)
    E_p = torch.nn.functional.normalize(torch.randn(1, 4, 8), dim=-1)
    out = c(e_q, E_p)
    # recompute from the parts by hand
    x = torch.cat([e_q.expand(4, 8), E_p[0], e_q * E_p[0], (e_q - E_p[0]).abs()], dim=-1)
    s = torch.sigmoid(c.score_net(x)).squeeze(-1)
    torch.testing.assert_close(out.scores[0], s)
    g, tau = float(out.g[0]), float(out.tau[0])
    assert 0 < g < 1 and c.config.tau_min <= tau <= c.config.tau_max
    pi = torch.exp(s / tau) / torch.exp(s / tau).sum()
    w = g * pi + (1 - g) / 4
    torch.testing.assert_close(out.weights[0], w)
    torch.testing.assert_close(out.merge_weights[0], 4 * w / (w.sum() + 1e-8))


def test_single_passage_gives_one():
    c = FusionController(embed_dim=8, seed=0).eval()
    out = c(torch.randn(1, 8), torch.randn(1, 1, 8))
    torch.testing.assert_close(out.merge_weights, torch.ones(1, 1))


def test_masking_mixed_n_equals_unpadded():
    """A padded batch of sets with N = 1, 3, 5 gives exactly what each set alone gives."""
    torch.manual_seed(0)
    c = FusionController(embed_dim=8, seed=3).eval()
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
        assert torch.all(batched.merge_weights[b, n:] == 0) and torch.all(batched.weights[b, n:] == 0)
        assert float(batched.weights[b].sum()) == pytest.approx(1.0, abs=1e-6)
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
    assert a.config.mode == "random"


def test_fixed_mode_uses_global_g_tau_and_cosine():
    c = FusionController.fixed(g=0.6, tau=0.2, embed_dim=4)
    e_q = torch.tensor([[1.0, 0, 0, 0]])
    E_p = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [-1.0, 0, 0, 0]]])
    out = c(e_q, E_p)
    torch.testing.assert_close(out.scores, torch.tensor([[1.0, 0.5, 0.0]]))
    assert torch.allclose(out.g, torch.tensor([0.6])) and torch.allclose(out.tau, torch.tensor([0.2]))
    pi = torch.softmax(torch.tensor([1.0, 0.5, 0.0]) / 0.2, 0)
    torch.testing.assert_close(out.weights[0], 0.6 * pi + 0.4 / 3)


def test_pair_features_layout():
    e_q = torch.tensor([[1.0, -2.0]])
    E_p = torch.tensor([[[3.0, 4.0]]])
    torch.testing.assert_close(pair_features(e_q, E_p), torch.tensor([[[1.0, -2.0, 3.0, 4.0, 3.0, -8.0, 2.0, 6.0]]]))


def test_save_load_roundtrip_identical(tmp_path):
    torch.manual_seed(0)
    c = FusionController(embed_dim=8, seed=5, embedding_model="hash-8").eval()
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
    (d / "config.json").write_text(json.dumps({**cfg, "mode": "smart"}))
    with pytest.raises(ControllerError, match=r"config\.json: key 'mode' is 'smart'"):
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
