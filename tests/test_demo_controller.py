"""The demo's controller (examples/quickstart.py): trained once per key (labels sha256, recipe, encoder, library
version) and reused after; the objective that decides is printed with its numbers. No language model is loaded:
a slice of the shipped efficacy labels and a hash encoder stand in."""

import json

import pytest

import quickstart
from helpers import first_questions, hash_encoder

SMALL_RECIPE = {**quickstart.RECIPE, "epochs": 1, "cv_folds": 2, "threads": 1,
                "controller": {"score_hidden": [32], "calib_hidden": 16}}  # small and quick


@pytest.fixture
def labels(tmp_path, monkeypatch):
    """The first 16 questions of the shipped labels (all their records, side features included)."""
    monkeypatch.setattr(quickstart, "RECIPE", SMALL_RECIPE)
    path = first_questions(quickstart.LABELS, 16, tmp_path / "labels.jsonl")
    return path


def _train(labels, out_dir, **kw):
    lines = []
    ctrl = quickstart.train_demo_controller(hash_encoder(16), labels=labels, out_dir=out_dir, out=lines.append,
                                            **kw)
    return ctrl, lines


def test_trained_once_then_reused(labels, tmp_path, monkeypatch):
    out = tmp_path / "ctrl"
    ctrl, lines = _train(labels, out)
    assert lines[0].startswith("training a controller on labels.jsonl (recipe: objective risk, kappa auto")
    assert any(ln.startswith("trained a controller on labels.jsonl") for ln in lines)
    key = json.loads((out / quickstart.KEY_NAME).read_text())
    assert key == quickstart.demo_key(labels, hash_encoder(16))
    assert key["train_args"] == SMALL_RECIPE and key["encoder"] == "hash-16" and len(key["labels_sha256"]) == 64

    from fcprag_plugin.training import trainer

    monkeypatch.setattr(trainer, "train_controller", lambda *a, **k: pytest.fail("trained again"))
    again, lines2 = _train(labels, out)
    assert lines2[0].startswith(f"reusing the controller in {out}, trained earlier from the same inputs")
    cv = json.loads((out / "metrics.json").read_text())["cv"]
    assert any(f"{cv['gain']:+.4g}" in ln for ln in lines2)  # the saved verdict is said again
    for a, b in zip(ctrl.state_dict().values(), again.state_dict().values()):
        assert a.equal(b)
    # the same objective table either way (the reused controller, the same training records)
    def decides(ls):
        return ls[next(i for i, ln in enumerate(ls) if "what decides" in ln):]

    assert decides(lines) == decides(lines2) and len(decides(lines)) == 7
    # the reused run prints the saved table too, so "the kl rows above" are there
    assert [ln for ln in lines2 if ln.lstrip().startswith("kl ")] == [ln for ln in lines if ln.lstrip().startswith("kl ")]


@pytest.mark.parametrize("change", ["labels", "recipe", "retrain", "version"])
def test_a_changed_input_trains_again(labels, tmp_path, monkeypatch, change):
    out = tmp_path / "ctrl"
    _train(labels, out)
    kw = {}
    if change == "labels":
        text = labels.read_text()
        rec = json.loads(text.splitlines()[0])
        rec["id"] += "-changed"  # one byte of the file: the sha256 differs
        labels.write_text(json.dumps(rec) + "\n" + "\n".join(text.splitlines()[1:]) + "\n")
    elif change == "recipe":
        monkeypatch.setattr(quickstart, "RECIPE", {**SMALL_RECIPE, "seed": 1})
    elif change == "retrain":
        kw["retrain"] = True
    else:
        import fcprag_plugin

        monkeypatch.setattr(fcprag_plugin, "__version__", "9.9.9")
    _, lines = _train(labels, out, **kw)
    assert lines[0].startswith("training a controller"), lines[0]
    assert json.loads((out / quickstart.KEY_NAME).read_text()) == quickstart.demo_key(labels, hash_encoder(16))


def test_the_deciding_objective_is_said_with_its_numbers(labels, tmp_path):
    """risk decides: the printed gain of each controller equals the trainer's own gain on its training records
    (computed independently by the trainer), uniform's gain and J are 0, and J <= gain (the penalty is >= 0)."""
    out = tmp_path / "ctrl"
    _, lines = _train(labels, out)
    text = "\n".join(lines)
    assert ("what decides: the recipe trains the network on the risk objective J = sum_i (w~_i - 1) delta_i - "
            "lambda") in text
    assert "KL, the paper's objective (the kl rows above), decides neither" in text
    metrics = json.loads((out / "metrics.json").read_text())
    table = lines[next(i for i, ln in enumerate(lines) if "training records, in sample (mean per record)" in ln) + 1:]
    names = table[0].split()
    shipped = next(iter(metrics["train"]))  # the learned controller (keep_network), or a scale-only one
    # (at kappa 1 the scale-only controller is PRAG's sum itself: the "uniform" row)
    assert names == list(dict.fromkeys([shipped, "uniform", "random"])) and shipped in ("learned", "scale_only",
                                                                                         "uniform")
    assert table[1].split()[:2] == ["gain", "sum_i"] and table[2].split()[:2] == ["risk", "J"]
    gain = dict(zip(names, map(float, table[1].split()[-len(names):])))
    risk = dict(zip(names, map(float, table[2].split()[-len(names):])))
    assert f"on the {metrics['n_train']} training records" in text
    kappa = metrics["kappa"]  # the shipped row is its weights divided by kappa: what the network was trained on
    for n in names:
        if n != shipped or kappa == 1.0:
            assert gain[n] == pytest.approx(metrics["train"][n]["gain"], abs=1e-4)
        elif shipped == "scale_only":
            assert gain[n] == 0 and risk[n] == 0  # uniform weights times kappa: uniform once divided
        assert risk[n] <= gain[n] + 1e-9
    assert gain["uniform"] == 0 and risk["uniform"] == 0
    assert f"(lambda {metrics['risk_lambda']:.4f})" in text
