"""``evaluate_controller`` (``fcprag eval``): a saved controller on any label file, and the warning when that file
is the one it was trained on (or, by a run of an earlier version, validated on)."""

import hashlib
import json
import logging

from fcprag_plugin.training import train_controller
from fcprag_tools.evaluate import evaluate_controller
from fcprag_tools.synthetic import synthetic_records, table_encoder, write_labels

FAST = dict(epochs=1, lr=1e-3, controller={"score_hidden": [64, 32], "calib_hidden": 32}, progress=False,
            precision="fp32", threads=1, cv_folds=0)


def test_eval_warns_on_the_training_file(tmp_path, caplog):
    recs, table = synthetic_records(60, 3, 8, seed=6)
    write_labels(recs[:45], tmp_path / "train.jsonl")
    write_labels(recs[45:], tmp_path / "val.jsonl")
    enc = table_encoder(table, "syn8")
    train_controller(tmp_path / "train.jsonl", tmp_path / "run", encoder=enc, cache_dir=tmp_path / "cache", **FAST)
    args_path = tmp_path / "run" / "training_args.json"
    args = json.loads(args_path.read_text())
    assert args["train_labels_sha256"] and "val_labels_sha256" not in args
    # a run of an earlier version, with a validation file
    val_sha = hashlib.sha256((tmp_path / "val.jsonl").read_bytes()).hexdigest()
    args_path.write_text(json.dumps({**args, "val_labels_sha256": val_sha}))
    for f, seen in (("train.jsonl", "trained"), ("val.jsonl", "validated")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            res = evaluate_controller(tmp_path / "run", tmp_path / f, encoder=enc, cache_dir=tmp_path / "cache")
        assert res.trained_on == seen
        assert any(f"this controller was {seen} on" in r.getMessage() for r in caplog.records)
    write_labels(recs[:30], tmp_path / "other.jsonl")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        res = evaluate_controller(tmp_path / "run", tmp_path / "other.jsonl", encoder=enc, cache_dir=tmp_path / "cache")
    assert res.trained_on is None and not [r for r in caplog.records if "was trained on" in r.getMessage()]
