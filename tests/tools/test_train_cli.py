"""``fcprag train`` / ``fcprag eval`` and the plots."""

import json
import sys

import pytest

from fcprag_tools.cli import main
from fcprag_plugin.training import train_controller
from fcprag_tools.plots import write_training_plots
from fcprag_tools.synthetic import synthetic_records, table_encoder, write_labels
from helpers import SMALL_TRAIN_ARGS as SMALL

PNG = b"\x89PNG\r\n\x1a\n"


def test_cli_train_then_eval(labelled, capsys):
    tmp, cache = labelled
    out = tmp / "ctrl"
    rc = main(["train", str(tmp / "train.jsonl"), "--out", str(out), "--encoder", "syn8", "--cache-dir", str(cache),
               "--epochs", "3", "--lr", "1e-3", "--batch-size", "16", "--seed", "2",
               "--t-label", "0.2", "--flat-eps", "1e-4", "--flat-weight", "0.5", "--recipe", "paper", *SMALL])
    assert rc == 0
    text = capsys.readouterr().out
    assert "learned" in text and "uniform" in text and "random" in text and "120 training records" in text
    args = json.loads((out / "training_args.json").read_text())
    assert (args["epochs"], args["lr"], args["batch_size"], args["seed"]) == (3, 1e-3, 16, 2)
    assert (args["t_label"], args["flat_eps"], args["flat_weight"]) == (0.2, 1e-4, 0.5)
    assert args["controller"] == {"score_hidden": [32], "calib_hidden": 16}
    from fcprag_plugin.training.precision import native_bf16

    assert args["precision"] == "auto" and args["precision_used"] == ("bf16" if native_bf16() else "fp32")
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 3

    rc = main(["eval", str(out), str(tmp / "train.jsonl"), "--cache-dir", str(cache), "--json", str(tmp / "m.json"),
               "--plots", str(tmp / "plots"), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "kl" in text and "top1" in text
    m = json.loads((tmp / "m.json").read_text())
    saved = json.loads((out / "metrics.json").read_text())["train"]
    # same controller, same file, same targets (read back from training_args.json) -> same numbers
    assert m["metrics"]["learned"]["kl"] == pytest.approx(saved["learned"]["kl"], rel=1e-6)
    assert m["metrics"]["uniform"]["kl"] == pytest.approx(saved["uniform"]["kl"], rel=1e-6)
    for name in ("g_tau.png", "entropy.png"):
        assert (tmp / "plots" / name).read_bytes()[:8] == PNG


def test_cli_overwrite_and_errors(labelled, capsys):
    tmp, cache = labelled
    out = tmp / "ctrl"
    base = ["train", str(tmp / "train.jsonl"), "--out", str(out), "--encoder", "syn8", "--cache-dir", str(cache),
            "--recipe", "paper", *SMALL]  # the paper's recipe saves the network: its epochs are logged
    assert main(base + ["--epochs", "1"]) == 0
    assert main(base + ["--epochs", "2"]) == 2
    assert "already holds a training run" in capsys.readouterr().err
    assert main(base + ["--epochs", "2", "--overwrite"]) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in log] == [1, 2]
    bad = tmp / "bad.jsonl"
    bad.write_text((tmp / "train.jsonl").read_text().replace('"deltas": [', '"deltas": [7, ', 1))
    assert main(["train", str(bad), "--out", str(tmp / "x"), "--encoder", "syn8", "--cache-dir", str(cache),
                 *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1: field 'deltas'" in err
    assert main(["train", str(bad), "--out", str(tmp / "x"), "--encoder", "syn8", "--cache-dir", str(cache),
                 "--on-error", "skip", "--epochs", "1", *SMALL]) == 0
    assert "skipped 1 record(s)" in capsys.readouterr().out
    for flag in ("--val", "--val-fraction"):  # the validation split is gone: said in one line, before any work
        with pytest.raises(SystemExit) as ei:  # argparse's
            main(["train", str(tmp / "train.jsonl"), "--out", str(tmp / "y"), flag, "0.2"])
        err = capsys.readouterr().err
        assert ei.value.code == 2
        assert err.startswith(f"fcprag train: error: {flag} is gone with the validation split: the nested "
                              "cross-validation (--cv-folds) chooses the epochs") and err.count("\n") == 1
    assert not (tmp / "y").exists()


def test_training_plots_are_pngs(labelled):
    tmp, cache = labelled
    recs, table = synthetic_records(60, 3, 8, seed=13)
    res = train_controller(recs, tmp / "p", encoder=table_encoder(table, "syn8p"), cache_dir=cache, epochs=2,
                           progress=False, threads=1, controller={"score_hidden": [8], "calib_hidden": 8},
                           cv_folds=0)  # two epochs of the network, whatever a verdict would say
    write_training_plots(res.out / "plots", res.history, res.outputs, res.report_data)
    for name in ("loss.png", "g_tau.png", "entropy.png"):
        data = (res.out / "plots" / name).read_bytes()
        assert data[:8] == PNG and len(data) > 1000


def test_missing_matplotlib_is_a_clear_error_before_training(labelled, monkeypatch, capsys):
    tmp, cache = labelled
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    recs, table = synthetic_records(20, 3, 8, seed=14)
    write_labels(recs, tmp / "np.jsonl")
    monkeypatch.setattr("fcprag_plugin.training.trainer.train_controller", lambda *a, **k: pytest.fail("trained"))
    assert main(["train", str(tmp / "np.jsonl"), "--out", str(tmp / "np"), "--encoder", "syn8", "--cache-dir",
                 str(cache), "--plots", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "plots need matplotlib" in err and "pip install 'fcprag-plugin[plot]'" in err
    assert not (tmp / "np").exists()  # failed before any work


@pytest.mark.integration
def test_real_encoder_on_hotpotqa_gold_passages(tmp_path, monkeypatch):
    """The default offline TextEncoder on real questions: gold passages get delta 1, distractors 0."""
    from pathlib import Path

    from fcprag_plugin.encoding import TextEncoder
    from fcprag_tools.evaluate import evaluate_controller

    data = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "hotpotqa_dev_sample.jsonl"
    if not data.is_file():
        pytest.skip(f"{data} not available")
    rows = [json.loads(x) for x in data.read_text().splitlines()[:40]]
    records = []
    for r in rows:
        gold = [p for p, t in zip(r["passages"], r["titles"]) if t in r["supporting_titles"]][:2]
        other = [p for p, t in zip(r["passages"], r["titles"]) if t not in r["supporting_titles"]][:2]
        records.append({"id": r["id"], "query": r["question"], "passages": gold + other,
                        "deltas": [1.0] * len(gold) + [0.0] * len(other), "metric": "gold-support"})
    write_labels(records, tmp_path / "hotpot.jsonl")
    enc = TextEncoder()
    res = train_controller(tmp_path / "hotpot.jsonl", tmp_path / "ctrl", encoder=enc, cache_dir=tmp_path / "cache",
                           epochs=3, progress=False, threads=1, keep_network=True)
    cfg = json.loads((tmp_path / "ctrl" / "config.json").read_text())
    assert cfg["embed_dim"] == enc.dim == 384 and cfg["embedding_model"] == enc.name
    v = res.metrics["train"]
    assert res.n_train == 40 and all(v[k]["kl"] is not None for k in ("learned", "uniform", "random"))

    # everything is cached now: evaluating by model name must not load the model again
    def no_load(*a, **k):
        raise AssertionError("model loaded although every text is cached")

    monkeypatch.setattr(TextEncoder, "__init__", no_load)
    ev = evaluate_controller(tmp_path / "ctrl", tmp_path / "hotpot.jsonl", cache_dir=tmp_path / "cache")
    assert ev.metrics["learned"]["n"] == 40


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_recipe_paper_is_the_papers_setting_one_flag_away(labelled, capsys):
    """--recipe paper: the learned network shipped at kappa 1 with the KL objective, exactly what the same run
    with those options spelled out gives; the default recipe ships no network on the same labels."""
    tmp, cache = labelled
    base = ["train", str(tmp / "train.jsonl"), "--encoder", "syn8", "--cache-dir", str(cache), "--epochs", "2",
            "--lr", "1e-3", "--cv-folds", "2", *SMALL]
    assert main(base + ["--out", str(tmp / "paper"), "--recipe", "paper"]) == 0
    paper_text = capsys.readouterr().out
    assert main(base + ["--out", str(tmp / "spelled"), "--kappa", "1", "--keep-network", "--objective", "kl"]) == 0
    capsys.readouterr()
    cfg = json.loads((tmp / "paper" / "config.json").read_text())
    args = json.loads((tmp / "paper" / "training_args.json").read_text())
    assert cfg["controller_mode"] == "learned" and cfg["kappa"] == 1.0 and cfg["cv"]["shipped"] == "network"
    assert (args["recipe"], args["kappa"], args["keep_network"], args["objective"]) == ("paper", 1.0, True, "kl")
    a, b = _weights(tmp / "paper"), _weights(tmp / "spelled")
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert "because --keep-network asked for it" in paper_text and "first order" in paper_text
    assert main(base + ["--out", str(tmp / "measured")]) == 0
    text = capsys.readouterr().out
    cfg = json.loads((tmp / "measured" / "config.json").read_text())
    args = json.loads((tmp / "measured" / "training_args.json").read_text())
    assert cfg["controller_mode"] == "uniform" and args["recipe"] == "measured" and args["kappa"] == "auto"
    assert "FIRST ORDER" in text and "fcprag study" in text and "--keep-network saves it" in text
    assert "no scale measurements in the labels" in text
    # an option given explicitly wins over the recipe
    assert main(base + ["--out", str(tmp / "paper2"), "--recipe", "paper", "--kappa", "2"]) == 0
    capsys.readouterr()
    assert json.loads((tmp / "paper2" / "config.json").read_text())["kappa"] == 2.0


def _last_lines(text: str) -> list[str]:
    lines = text.splitlines()
    return lines[next(i for i, ln in enumerate(lines) if ln.startswith("In short (unit: ")):]


def test_the_last_lines_say_the_gain_its_unit_and_parts_what_was_saved_and_how_to_use_it(labelled, capsys):
    tmp, cache = labelled
    out = tmp / "ctrl"
    assert main(["train", str(tmp / "train.jsonl"), "--out", str(out), "--encoder", "syn8", "--cache-dir",
                 str(cache), "--epochs", "2", *SMALL]) == 0
    last = _last_lines(capsys.readouterr().out)
    cv = json.loads((out / "cv.json").read_text())
    head, gain, first_order, saved, use = last[:5]
    assert head.startswith("In short (unit: the label metric, per record, over PRAG's sum")  # no metric field
    assert gain.startswith(f"  gain {cv['gain']:+.4g}, 95% CI [{cv['ci95'][0]:+.4g}, ")
    assert "its parts: scale (" in gain and f"reweighting {cv['reweighting']['gain']:+.4g}" in gain
    assert first_order.startswith("  first order: estimated from the leave-one-out deltas")
    assert saved.startswith("Saved ") and f"to {out} (config.json, model.safetensors;" in saved
    assert use.startswith(f"Use it: fcprag fuse --controller {out} --query TEXT --adapter DIR --passage TEXT")
    assert f"fcprag run prag --controller {out} -- " in use


def test_defaults_ending_in_prags_own_merge_suggest_kappa_auto(labelled, capsys):
    """Deltas that are noise: nothing is shown, and the defaults (kappa 1) ship PRAG's own merge; the last line
    is the same command with --kappa auto, which runs."""
    tmp, cache = labelled
    gen = __import__("random").Random(3)
    noisy = []
    for line in (tmp / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k in ("metric_all", "metric_without", "scales", "metric_at_scales"):
            rec.pop(k, None)
        rec["deltas"] = [gen.gauss(0, 1) for _ in rec["passages"]]
        noisy.append(json.dumps(rec))
    (tmp / "noise.jsonl").write_text("\n".join(noisy) + "\n")
    argv = ["train", str(tmp / "noise.jsonl"), "--out", str(tmp / "noise"), "--encoder", "syn8", "--cache-dir",
            str(cache), "--epochs", "2", *SMALL]
    assert main(argv) == 0
    last = _last_lines(capsys.readouterr().out)
    assert last[-1].startswith("This is PRAG's own merge (scale-only, kappa 1): to let the scale be chosen from "
                               "the labels, add --kappa auto: fcprag train ")
    again = last[-1].split("add --kappa auto: fcprag ", 1)[1].split()
    assert again[-2:] == ["--kappa", "auto"] and again[:-2] == argv
    assert main(again + ["--overwrite"]) == 0
    assert "add --kappa auto" not in capsys.readouterr().out


def test_eval_refuses_another_embedding_model_before_embedding(labelled, capsys):
    tmp, cache = labelled
    out = tmp / "ctrl"
    assert main(["train", str(tmp / "train.jsonl"), "--out", str(out), "--encoder", "syn8", "--cache-dir",
                 str(cache), "--epochs", "1", "--cv-folds", "0", *SMALL]) == 0
    capsys.readouterr()
    base = ["eval", str(out), str(tmp / "val.jsonl"), "--cache-dir", str(cache), "--no-progress"]
    assert main(base + ["--encoder", "syn8"]) == 0  # its own model, named: fine
    capsys.readouterr()
    assert main(base + ["--encoder", "other-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--encoder other-model is not the embedding model" in err and "'syn8'" in err
