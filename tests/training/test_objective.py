"""Issue 15 section 1: a controller starts at PRAG's merge exactly; the risk objective and its lambda against
independent references; grouped CV (folds never share a question) and its verdict in metrics.json, config.json
and the warnings of fuse()."""

import json
import logging
import math

import pytest
import torch

from fcprag_plugin.controller import FusionController
from fcprag_plugin.training import train_controller
from fcprag_plugin.training.data import build_tensors
from fcprag_plugin.training.evaluation import collect_outputs
from fcprag_tools.synthetic import synthetic_records, table_encoder, write_labels
from fcprag_tools.train_report import train_table
from fcprag_plugin.training.targets import estimate_lambda, first_order_gain, risk_loss
from fcprag_plugin.training import TrainArgs, Trainer

SMALL = {"score_hidden": [64, 32], "calib_hidden": 32}
FAST = dict(epochs=6, lr=1e-3, controller=SMALL, progress=False, precision="fp32", threads=1,
            cv_folds=3)


def run(records, table, out, name="syn16", **kw):
    return train_controller(records, out, encoder=table_encoder(table, name), cache_dir=out.parent / "cache",
                            **{**FAST, **kw})


# ------------------------------------------------------------------------------------------------ initialisation
def test_a_new_learned_controller_is_exactly_prags_merge():
    g = torch.Generator().manual_seed(0)
    c = FusionController(embed_dim=16, score_hidden=[32, 16], calib_hidden=8, seed=3, init="uniform")
    e_q, E_p = torch.randn(6, 16, generator=g), torch.randn(6, 5, 16, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.4
    mask[:, 0] = True
    for m in (None, mask):
        for mode in (c.train(), c.eval()):  # dropout does not matter either
            out = mode(e_q, E_p, m)
            ref = torch.ones(6, 5) if m is None else m.float()
            assert torch.equal(out.merge_weights, ref)  # exactly, not approximately
    # with the calibration net's scale c too (c = 2 sigmoid(0) = 1 exactly)
    qs = FusionController(embed_dim=16, score_hidden=[8], calib_hidden=8, seed=4, init="uniform", calib_scale=True)
    out = qs(e_q, E_p, mask)
    assert torch.equal(out.merge_weights, mask.float()) and torch.equal(out.scale, torch.ones(6))
    # the constructor's default keeps PyTorch's initialisation, as before
    assert not torch.equal(FusionController(embed_dim=16, seed=3)(e_q, E_p).merge_weights, torch.ones(6, 5))
    # the trainer's controller before its first step, on real label tensors
    recs, table = synthetic_records(40, (1, 4), 16, seed=2)
    data = build_tensors(recs, table_encoder(table, "syn16"))
    tr = Trainer(data, TrainArgs(controller=SMALL, cv_folds=0), "syn16")
    o = collect_outputs(tr.controller, data)
    assert torch.equal(o["wt"], data.mask.float())
    # ... and one step moves it (gradients reach the zeroed output layer)
    tr.train_epoch()
    assert not torch.equal(collect_outputs(tr.controller, data)["wt"], data.mask.float())


# ------------------------------------------------------------------------------------------------ risk objective
def ragged(seed, B=7, N=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, N, generator=g) > 0.3
    mask[:, 0] = True
    deltas = torch.randn(B, N, generator=g, dtype=torch.float64).masked_fill(~mask, 0.0)
    wt = (1 + 0.5 * torch.randn(B, N, generator=g, dtype=torch.float64)).masked_fill(~mask, 0.0)
    return wt, deltas, mask


def test_risk_loss_and_its_gradient_against_a_hand_written_reference():
    wt, deltas, mask = ragged(0)
    lam = 0.37
    w = wt.clone().requires_grad_(True)
    loss = risk_loss(w, deltas, mask, lam)
    loss.backward()
    B = wt.shape[0]
    # by hand, record by record, over the real passages only
    J, grad = [], torch.zeros_like(wt)
    for b in range(B):
        idx = [i for i in range(wt.shape[1]) if mask[b, i]]
        J.append(sum((float(wt[b, i]) - 1) * float(deltas[b, i]) - lam * (float(wt[b, i]) - 1) ** 2 for i in idx))
        for i in idx:  # d(-mean_b J_b)/dw~_bi = -(delta_bi - 2 lambda (w~_bi - 1)) / B
            grad[b, i] = -(float(deltas[b, i]) - 2 * lam * (float(wt[b, i]) - 1)) / B
    assert float(loss) == pytest.approx(-sum(J) / B, rel=1e-12)
    torch.testing.assert_close(w.grad, grad, rtol=1e-12, atol=1e-15)
    assert torch.all(w.grad[~mask] == 0)
    # uniform weights: zero objective, gradient = -delta / B (the first-order gain direction)
    ones = mask.double().requires_grad_(True)
    risk_loss(ones, deltas, mask, lam).backward()
    torch.testing.assert_close(ones.grad, -deltas / B * mask)
    assert torch.equal(first_order_gain(mask.double(), deltas, mask), torch.zeros(B, dtype=torch.float64))


def test_risk_gradient_through_the_controller_matches_finite_differences():
    torch.manual_seed(0)
    c = FusionController(embed_dim=6, score_hidden=[8], calib_hidden=4, seed=1, init="random", dropout=0.0).double()
    g = torch.Generator().manual_seed(1)
    e_q, E_p = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    _, deltas, mask = ragged(1, B=3, N=4)

    def f():
        return risk_loss(c(e_q, E_p, mask).merge_weights, deltas, mask, 0.5)

    loss = f()
    loss.backward()
    p = c.score_net[0].weight
    for idx in [(0, 0), (3, 7), (7, 20)]:
        with torch.no_grad():
            old = float(p[idx])
            p[idx] = old + 1e-6
            up = float(f())
            p[idx] = old - 1e-6
            down = float(f())
            p[idx] = old
        assert float(p.grad[idx]) == pytest.approx((up - down) / 2e-6, rel=1e-5, abs=1e-10)


def test_lambda_is_the_pooled_within_record_standard_deviation():
    _, deltas, mask = ragged(2, B=9, N=5)
    num, den = 0.0, 0
    for b in range(9):
        d = [float(deltas[b, i]) for i in range(5) if mask[b, i]]
        if len(d) >= 2:
            m = sum(d) / len(d)
            num += sum((x - m) ** 2 for x in d)
            den += len(d) - 1
    assert estimate_lambda(deltas, mask) == pytest.approx(math.sqrt(num / den), rel=1e-12)
    assert estimate_lambda(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)) == 1.0  # all flat: fallback


# ------------------------------------------------------------------------------------------------ grouped CV
@pytest.mark.parametrize("objective", ["kl", "risk"])
def test_planted_signal_is_proven_and_the_verdict_is_everywhere(tmp_path, objective, caplog):
    recs, table = synthetic_records(240, 3, 16, seed=1, groups=80)  # 3 records per question
    res = run(recs, table, tmp_path / "run", objective=objective, keep_network=True)
    cv = res.metrics["cv"]
    assert cv["folds"] == 3 and cv["n_groups"] == 80 and cv["objective"] == objective
    assert cv["verdict"] == "better_than_uniform" and cv["ci95"][0] > 0 and cv["selected_epochs"] >= 1
    assert cv["reweighting"]["shown"] and cv["shipped"] == "network" and cv["gain"] == cv["reweighting"]["gain"]
    assert cv["curve"][0] == 0.0 and len(cv["curve"]) == 7 and cv["selected_epochs"] == max(
        range(7), key=lambda e: (cv["curve"][e], -e))
    assert res.metrics["epochs"] == cv["selected_epochs"]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["cv"]["verdict"] == "better_than_uniform" and saved["cv"]["ci95"] == cv["ci95"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["cv"]["gain"] == cv["gain"]
    text = train_table(res.metrics)
    assert "it is better than PRAG's sum" in text and "95% CI" in text
    # on the training records too, the learned weights gain over uniform
    assert res.metrics["train"]["learned"]["gain"] > 0 and res.metrics["train"]["uniform"]["gain"] == 0
    c = FusionController.from_pretrained(tmp_path / "run")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert not c.warn_if_unproven()
        c.predict(recs[0].query, recs[0].passages, table_encoder(table, "syn16"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_pure_noise_is_unproven_and_warns_once(tmp_path, caplog):
    recs, table = synthetic_records(240, 3, 16, kind="noise", noise=0.05, seed=3, groups=80)
    res = run(recs, table, tmp_path / "run", objective="risk")
    cv = res.metrics["cv"]
    assert cv["verdict"] == "unproven" and cv["ci95"][0] <= 0 and cv["shipped"] == "prag_sum"
    assert "NOT shown" in train_table(res.metrics)
    c = FusionController.from_pretrained(tmp_path / "run")
    assert c.config.cv["verdict"] == "unproven" and c.config.controller_mode == "uniform"
    enc = table_encoder(table, "syn16")
    with caplog.at_level(logging.WARNING, logger="fcprag_plugin.controller"), pytest.warns(UserWarning) as seen:
        c.predict(recs[0].query, recs[0].passages, enc)
        c.predict(recs[1].query, recs[1].passages, enc)
        assert c.warn_if_unproven()
    warned = [r for r in caplog.records if r.name == "fcprag_plugin.controller"]
    assert len(warned) == 1 and "NOT shown to beat PRAG's sum" in warned[0].getMessage()
    assert [str(w.message) for w in seen] == [warned[0].getMessage()]  # Python users see it too, once


def test_selected_zero_epochs_keeps_uniform_weights(tmp_path, monkeypatch):
    """When no epoch count beats uniform on held-out questions, the learned controller is PRAG's merge."""
    import fcprag_plugin.training.trainer as trainer_mod

    real = trainer_mod.select

    def nothing_helps(*a, **k):  # the real CV, its selection forced to "no epoch beat uniform"
        return {**real(*a, **k), "selected_epochs": 0, "shipped": "network", "kappa": 1.0}

    monkeypatch.setattr(trainer_mod, "select", nothing_helps)
    recs, table = synthetic_records(60, 3, 16, seed=4, groups=20)
    res = run(recs, table, tmp_path / "run", epochs=2)
    assert res.metrics["epochs"] == 0 and res.history == []
    data = build_tensors(recs, table_encoder(table, "syn16"))
    assert torch.equal(collect_outputs(res.controller, data)["wt"], data.mask.float())
    again = FusionController.from_pretrained(tmp_path / "run")
    assert torch.equal(collect_outputs(again, data)["wt"], data.mask.float())


def test_the_final_controller_is_the_plain_run_of_the_selected_length(tmp_path):
    recs, table = synthetic_records(120, 3, 8, seed=8, groups=40)
    kw = dict(name="syn8", epochs=3, controller={"score_hidden": [16], "calib_hidden": 8}, keep_network=True)
    cv = run(recs, table, tmp_path / "cv", **kw)
    e = cv.metrics["cv"]["selected_epochs"]
    assert e >= 1 and cv.metrics["cv"]["shipped"] == "network"  # the planted signal is found
    plain = run(recs, table, tmp_path / "plain", **{**kw, "epochs": e, "cv_folds": 0})
    a, b = cv.controller.state_dict(), plain.controller.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_argument_errors(tmp_path):
    recs, table = synthetic_records(10, 3, 8)
    from fcprag_plugin.errors import FcpragError

    for kw, msg in ((dict(objective="mse"), "'objective' is 'mse'"), (dict(cv_folds=1), "'cv_folds' is 1"),
                    (dict(risk_lambda=-1.0), "'risk_lambda' is -1.0"), (dict(kappa=0), "'kappa' is 0"),
                    (dict(controller={"calib_scale": True}), "needs objective 'risk'")):
        with pytest.raises(FcpragError, match=msg):
            run(recs, table, tmp_path / "r", name="syn8", **kw)


def test_cli_train_states_the_cross_validated_verdict(tmp_path, capsys):
    from fcprag_tools.cli import main

    recs, table = synthetic_records(150, 3, 8, seed=7, groups=50)
    write_labels(recs, tmp_path / "train.jsonl")
    cache = tmp_path / "cache"
    # fill the cache under the name 'syn8', so the CLI never loads a model
    train_controller(tmp_path / "train.jsonl", tmp_path / "warm", encoder=table_encoder(table, "syn8"),
                     cache_dir=cache, **{**FAST, "cv_folds": 0, "epochs": 1})
    rc = main(["train", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "c"), "--encoder", "syn8",
               "--cache-dir", str(cache), "--epochs", "3", "--lr", "1e-3", "--score-hidden", "32", "--calib-hidden",
               "16", "--threads", "1", "--no-progress", "--objective", "risk", "--cv-folds", "3", "--kappa", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    cv = json.loads((tmp_path / "c" / "metrics.json").read_text())["cv"]
    assert "3-fold nested CV" in out and "95% CI" in out and f"{cv['gain']:+.4g}" in out
    assert "scale part" in out and "reweighting part" in out
    assert ("it is better than PRAG's sum" in out) == (cv["verdict"] == "better_than_uniform")
    args = json.loads((tmp_path / "c" / "training_args.json").read_text())
    assert (args["objective"], args["cv_folds"], args["kappa"]) == ("risk", 3, 1.0) and args["risk_lambda_used"] > 0
    with pytest.raises(SystemExit) as exc:  # argparse's one-line usage error
        main(["train", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "d"), "--encoder", "syn8",
              "--cache-dir", str(cache), "--kappa", "big", "--no-progress"])
    assert exc.value.code == 2
    assert "argument --kappa: 'big': expected a number > 0 or 'auto'" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_kappa_auto_without_scale_measurements_stays_at_the_sum(tmp_path):
    """Every adapter helps, so a first-order extrapolation would ask for kappa > 1; nothing measured a scale, so
    the default keeps PRAG's sum and says why."""
    recs, table = synthetic_records(90, 3, 8, seed=9, groups=30)
    recs = [type(r)(id=r.id, query=r.query, passages=r.passages, deltas=[d + 0.3 for d in r.deltas], group=r.group)
            for r in recs]  # all adapters help
    assert sum(d for r in recs for d in r.deltas) > 0  # the first-order optimum 1 + mean(delta) / (2 lambda) > 1
    res = run(recs, table, tmp_path / "k", name="syn8", epochs=2, objective="risk")
    s = res.metrics["cv"]["scale"]
    assert res.metrics["kappa"] == 1.0 and FusionController.from_pretrained(tmp_path / "k").config.kappa == 1.0
    assert s["chosen_by"] == "no_scales" and not s["shown"] and all(x == 1.0 for x in s["fold_kappas"])
    assert "no scale measurements in the labels" in train_table(res.metrics)


def test_fuse_logs_one_warning_for_an_unproven_controller(tmp_path, adapter_dirs, encoder16, caplog):
    import dataclasses

    import fcprag_plugin
    from fcprag_plugin import fuse

    c = FusionController(embed_dim=16, embedding_model=encoder16.name, score_hidden=[8], calib_hidden=8)
    c.config = dataclasses.replace(c.config, cv={"gain": -0.004, "ci95": [-0.02, 0.011], "verdict": "unproven"})
    d = c.save_pretrained(tmp_path / "unproven")
    proven = FusionController(embed_dim=16, embedding_model=encoder16.name, score_hidden=[8], calib_hidden=8)
    proven.config = dataclasses.replace(proven.config, cv={"gain": 0.03, "ci95": [0.01, 0.05],
                                                            "verdict": "better_than_uniform"})
    p = proven.save_pretrained(tmp_path / "proven")
    fcprag_plugin.clear_caches()
    try:
        with caplog.at_level(logging.WARNING):
            for q in ("who wrote it", "where is it", "when was it"):
                fuse(adapter_dirs, q, ["a one", "b two", "c three"], controller=d, encoder=encoder16)
                fuse(adapter_dirs, q, ["a one", "b two", "c three"], controller=p, encoder=encoder16)
    finally:
        fcprag_plugin.clear_caches()
    warned = [r.getMessage() for r in caplog.records if "NOT shown to beat PRAG's sum" in r.getMessage()]
    assert len(warned) == 1 and "95% CI [-0.02, +0.011]" in warned[0]


def test_quiet_counts_the_unproven_warning_as_said(caplog):
    """A caller that measures the controller itself (fcprag study) marks the first-order verdict as said: no
    warning then or later; the same controller without ``quiet`` warns."""
    import dataclasses
    import warnings

    def unproven():
        c = FusionController(embed_dim=16, score_hidden=[8], calib_hidden=8)
        c.config = dataclasses.replace(c.config, cv={"gain": -0.004, "ci95": [-0.02, 0.011], "verdict": "unproven"})
        return c

    quiet, loud = unproven(), unproven()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert quiet.warn_if_unproven(quiet=True) and quiet.warn_if_unproven()
        assert not seen and not any("NOT shown" in r.getMessage() for r in caplog.records)
        assert loud.warn_if_unproven()
    assert len(seen) == 1 and "NOT shown to beat PRAG's sum" in str(seen[0].message)
