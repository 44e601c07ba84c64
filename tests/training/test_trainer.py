"""The trainer end to end on synthetic label sets with a known answer; outputs, round trip, overwrite, held-out
records."""

import json

import pytest
import torch

from fcprag_plugin.controller import FusionController
from fcprag_plugin.errors import FcpragError, LabelFileError
from fcprag_plugin.training import evaluate, load_labels, train_controller
from fcprag_plugin.training.data import build_tensors
from fcprag_tools.synthetic import synthetic_records, table_encoder, write_labels
from fcprag_tools.train_report import train_table

SMALL = {"score_hidden": [64, 32], "calib_hidden": 32}  # the default 2048/1024 net is too slow for unit tests
# one thread: tiny nets gain nothing from two, and a busy shared CPU makes OpenMP barriers very slow
# keep_network: these tests are about the network itself (the default recipe ships none on labels alone)
FAST = dict(epochs=10, lr=3e-4, controller=SMALL, progress=False, precision="fp32", threads=1,
            keep_network=True)


def run(records, table, out, name="syn16", calls=None, **kw):
    args = {**FAST, **kw}
    return train_controller(records, out, encoder=table_encoder(table, name, calls), cache_dir=out.parent / "cache",
                            **args)


def held_out(res, kind, seed=2):
    """The metrics of the trained controller and the baselines on 160 records of the same ``kind`` it never saw."""
    recs, table = synthetic_records(160, (2, 4), 16, kind=kind, seed=seed, prefix="held-")
    return evaluate(res.controller, build_tensors(recs, table_encoder(table, "syn16")))[0]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    base = tmp_path_factory.mktemp("planted")
    recs, table = synthetic_records(640, (2, 4), 16, kind="planted", seed=1)
    return run(recs, table, base / "run"), recs, table


@pytest.fixture(scope="module")
def noise(tmp_path_factory):
    base = tmp_path_factory.mktemp("noise")
    recs, table = synthetic_records(640, (2, 4), 16, kind="noise", noise=0.05, seed=1)
    return run(recs, table, base / "run", keep_network=True)  # the network, although its verdict says "not shown"


def test_planted_signal_beats_uniform_and_random_and_finds_the_best_passage(planted):
    res, _, _ = planted
    v = held_out(res, "planted")
    assert res.n_train == 640 and v["learned"]["n"] == 160 and v["learned"]["n_nonflat"] == 160
    assert v["learned"]["kl"] < 0.5 * v["uniform"]["kl"], v
    assert v["learned"]["kl"] < 0.5 * v["random"]["kl"], v
    assert v["learned"]["top1"] >= 0.85, v
    assert v["learned"]["top1"] > v["uniform"]["top1"] + 0.3 and v["learned"]["top1"] > v["random"]["top1"] + 0.3
    assert v["learned"]["spearman"] > 0.5
    assert v["learned"]["entropy_norm_mean"] < 0.9 * v["uniform"]["entropy_norm_mean"]
    # the uniform baseline is exactly uniform
    assert v["uniform"]["g_mean"] == 0.0 and v["uniform"]["entropy_norm_mean"] == pytest.approx(1.0)
    assert v["uniform"]["spearman"] is None and v["uniform"]["spearman_n"] == 0
    # training loss went down
    losses = [h["train_loss"] for h in res.history]
    assert losses[-1] < 0.6 * losses[0]


def test_pure_noise_gives_no_confident_weights(planted, noise):
    assert not noise.metrics["cv"]["reweighting"]["shown"] and noise.metrics["cv"]["shipped"] == "network"
    p, n = held_out(planted[0], "planted")["learned"], held_out(noise, "noise")
    assert n["learned"]["g_mean"] < p["g_mean"] - 0.1, (n["learned"]["g_mean"], p["g_mean"])
    assert n["learned"]["entropy_norm_mean"] > 0.95  # close to uniform weights
    assert n["learned"]["kl"] <= 1.1 * n["uniform"]["kl"]  # not confidently wrong


def test_output_directory_contents(planted):
    res, _, _ = planted
    out = res.out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "cv.json", "metrics.json", "model.safetensors",
                                                     "train_log.jsonl", "training_args.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["embedding_model"] == "syn16" and cfg["embed_dim"] == 16 and cfg["score_hidden"] == [64, 32]
    args = json.loads((out / "training_args.json").read_text())
    assert (args["lr"], args["batch_size"], args["weight_decay"], args["epochs"]) == (3e-4, 32, 0.01, 10)
    assert args["n_train"] == 640 and args["embedding_model"] == "syn16"
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in log] == list(range(1, 11))
    assert all(set(h) == {"epoch", "train_loss", "seconds", "records_per_s", "lr"} for h in log)
    metrics = json.loads((out / "metrics.json").read_text())
    # the table is the saved controller's on the training records, as an evaluation of it from the files gives it
    _, recs, table = planted
    again = evaluate(FusionController.from_pretrained(out), build_tensors(recs, table_encoder(table, "syn16")))[0]
    assert json.loads(json.dumps(again)) == metrics["train"] and set(again) == {"learned", "uniform", "random"}


def test_saved_controller_gives_identical_weights(planted):
    res, recs, table = planted
    loaded = FusionController.from_pretrained(res.out)
    data = build_tensors(recs[:64], table_encoder(table, "syn16"))
    b = data.batch(torch.arange(64))
    res.controller.eval()
    a, c = res.controller(b.e_q, b.E_p, b.mask), loaded(b.e_q, b.E_p, b.mask)
    assert torch.equal(a.probabilities, c.probabilities) and torch.equal(a.g, c.g) and torch.equal(a.tau, c.tau)
    sd1, sd2 = res.controller.state_dict(), loaded.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)


def test_records_of_another_split_than_train_are_left_out(tmp_path):
    recs, table = synthetic_records(40, 3, 8, seed=2)
    splits = ["val", "test", "train", None, "dev", "validation", "train", None]
    for i, r in enumerate(recs):
        r.split = splits[i % 8]
    res = run(recs, table, tmp_path / "run", epochs=1, name="syn8")
    assert res.n_train == 20 and res.metrics["train"]["learned"]["n"] == 20
    for r in recs:
        r.split = "test"
    with pytest.raises(LabelFileError, match="no record to train on"):
        run(recs, table, tmp_path / "run2", epochs=1, name="syn8")


@pytest.mark.parametrize("removed", [dict(val_fraction=0.2), dict(val="val.jsonl")])
def test_the_validation_split_is_refused_saying_what_replaced_it(tmp_path, removed):
    recs, table = synthetic_records(10, 3, 8)
    with pytest.raises(FcpragError) as ei:
        run(recs, table, tmp_path / "r", name="syn8", **removed)
    msg, (name,) = str(ei.value), removed
    assert msg.startswith(f"train_controller: {name}= is gone with the validation split: the nested "
                          "cross-validation (cv_folds=) chooses the epochs") and "\n" not in msg
    assert not (tmp_path / "r").exists()


def test_a_run_into_a_run_needs_overwrite_and_trains_from_the_start(tmp_path):
    recs, table = synthetic_records(120, (1, 4), 8, seed=5)  # N = 1 records included: gradients must stay finite
    kw = dict(name="syn8", controller={"score_hidden": [32], "calib_hidden": 16}, lr=1e-3, cv_folds=0, epochs=3)
    straight = run(recs, table, tmp_path / "straight", **kw)
    run(recs, table, tmp_path / "again", **{**kw, "epochs": 2, "lr": 5e-4})
    with pytest.raises(FcpragError, match=r"already holds a training run; pass overwrite=True to start over$"):
        run(recs, table, tmp_path / "again", **kw)
    again = run(recs, table, tmp_path / "again", overwrite=True, **kw)
    assert [h["train_loss"] for h in again.history] == [h["train_loss"] for h in straight.history]
    assert all(torch.isfinite(torch.tensor(h["train_loss"])) for h in again.history)
    sd1, sd2 = straight.controller.state_dict(), again.controller.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    log = (tmp_path / "again" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in log] == [1, 2, 3]  # the first run's epochs are gone


def test_cache_prevents_re_encoding_across_runs(tmp_path):
    recs, table = synthetic_records(50, 3, 8, seed=6)
    write_labels(recs, tmp_path / "l.jsonl")
    calls1, calls2 = [], []
    run(tmp_path / "l.jsonl", table, tmp_path / "a", calls=calls1, epochs=2, name="syn8")
    n_texts = len({r.query for r in recs} | {p for r in recs for p in r.passages})
    assert sum(len(c) for c in calls1) == n_texts  # every distinct text once, for all epochs together
    run(tmp_path / "l.jsonl", table, tmp_path / "b", calls=calls2, epochs=2, name="syn8")
    assert calls2 == []


def test_skip_mode_trains_on_the_good_records_and_reports(tmp_path):
    recs, table = synthetic_records(40, 3, 8, seed=7)
    lines = [json.dumps({"id": r.id, "query": r.query, "passages": r.passages, "deltas": r.deltas}) for r in recs]
    lines[3] = lines[3].replace('"deltas": [', '"deltas": [1.0, ')  # 4 deltas for 3 passages
    lines[10] = "{broken"
    (tmp_path / "l.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(LabelFileError, match=r"l.jsonl:4: field 'deltas'"):
        run(tmp_path / "l.jsonl", table, tmp_path / "run", epochs=1, name="syn8")
    res = run(tmp_path / "l.jsonl", table, tmp_path / "run", epochs=1, name="syn8", on_error="skip")
    assert res.n_train == 38
    sk = res.metrics["skipped"][str(tmp_path / "l.jsonl")]
    assert sk["count"] == 2 and sk["by_field"] == {"deltas": 1, "<json>": 1}
    assert [r["line"] for r in sk["records"]] == [4, 11]


def test_bf16_mixed_precision_learns_and_leaves_the_module_untouched(tmp_path):
    recs, table = synthetic_records(320, 3, 16, seed=8)
    res = run(recs, table, tmp_path / "run", precision="bf16", name="syn16", lr=1e-3)
    v = held_out(res, "planted")
    assert v["learned"]["kl"] < 0.5 * v["uniform"]["kl"] and v["learned"]["top1"] >= 0.8
    assert all(p.dtype == torch.float32 for p in res.controller.parameters())


def test_argument_errors(tmp_path):
    recs, table = synthetic_records(10, 3, 8)
    with pytest.raises(FcpragError, match="'batch_size' is 0"):
        run(recs, table, tmp_path / "r", batch_size=0, name="syn8")
    with pytest.raises(FcpragError, match=r"'controller' has unknown key\(s\) \['hidden'\]"):
        run(recs, table, tmp_path / "r", controller={"hidden": 3}, name="syn8")
    with pytest.raises(FcpragError, match=r"unknown argument\(s\) \['epoch'\]"):
        train_controller(recs, tmp_path / "r", encoder=table_encoder(table, "syn8"), epoch=3)
    with pytest.raises(FcpragError, match="t_label is -1"):
        run(recs, table, tmp_path / "r", t_label=-1, name="syn8")


def test_labels_from_file_and_records_agree(tmp_path):
    recs, table = synthetic_records(60, (2, 3), 8, seed=9)
    p = write_labels(recs, tmp_path / "l.jsonl")
    a = run(load_labels(p), table, tmp_path / "a", epochs=2, name="syn8")
    b = run(p, table, tmp_path / "b", epochs=2, name="syn8")
    assert [h["train_loss"] for h in a.history] == [h["train_loss"] for h in b.history]


def test_the_training_set_is_reported(tmp_path):
    recs, table = synthetic_records(40, 3, 8, seed=10)
    res = run(recs, table, tmp_path / "run", epochs=1, name="syn8")
    assert res.n_train == 40 and set(res.metrics) >= {"train", "n_train"} and "val" not in res.metrics
    assert set(res.metrics["train"]) == {"learned", "uniform", "random"} and res.metrics["train"]["learned"]["n"] == 40
    assert "training set" in train_table(res.metrics)
    # overwrite=True starts over: without cross-validation, the first run's verdict (cv.json) is gone
    assert (tmp_path / "run" / "cv.json").is_file()
    res2 = run(recs, table, tmp_path / "run", epochs=1, name="syn8", overwrite=True, seed=1, cv_folds=0)
    args = json.loads((tmp_path / "run" / "training_args.json").read_text())
    assert args["seed"] == 1 and res2.history[0]["epoch"] == 1 and not (tmp_path / "run" / "cv.json").exists()
