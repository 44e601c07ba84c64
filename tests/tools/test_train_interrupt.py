"""Ctrl-C anywhere in a real ``fcprag train``: what it prints is true, and the command it prints goes on.

Everything the run created under --out is gone (a run restarts from its start) and the same command runs again
unrefused.
"""

import json
import shlex

import pytest

from fcprag_tools.cli import main
from helpers import SMALL_TRAIN_ARGS as SMALL


def _train_argv(tmp, cache, out, *extra):
    return ["train", str(tmp / "train.jsonl"), "--out", str(out), "--encoder", "syn8", "--cache-dir", str(cache),
            "--epochs", "2", *SMALL, *extra]


def _printed_command(err: str, after: str) -> list[str]:
    """The command the interruption message ends with, as argv for main() (the leading 'fcprag' dropped)."""
    line = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert after in line, line
    words = shlex.split(line.split(after, 1)[1])
    assert words[0] == "fcprag"
    return words[1:]


class CvInterrupt:
    """While armed: KeyboardInterrupt at the third held-out evaluation inside the cross-validation loop (a fold
    trained and evaluated by then)."""

    def __init__(self, monkeypatch):
        from fcprag_plugin.training import selection

        self.cv, self.real, self.monkeypatch, self.calls = selection, selection.reweighting_gain, monkeypatch, 0
        self.at = 3

    def gain(self, *a, **k):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.real(*a, **k)

    def arm(self, at: int = 3):
        self.calls, self.at = 0, at
        self.monkeypatch.setattr(self.cv, "reweighting_gain", self.gain)

    def disarm(self):
        self.monkeypatch.setattr(self.cv, "reweighting_gain", self.real)


@pytest.fixture
def interrupt_in_cv(monkeypatch):
    return CvInterrupt(monkeypatch)


@pytest.mark.parametrize("before", ["absent", "empty"])
def test_ctrl_c_in_cross_validation_keeps_nothing_and_the_same_command_runs(labelled, capsys, interrupt_in_cv,
                                                                            monkeypatch, before):
    from fcprag_plugin.training import selection

    tmp, cache = labelled
    out = tmp / "run"
    if before == "empty":
        out.mkdir()
    wrote = []
    real_cv = selection.select

    def watched(*a, **k):
        wrote.extend(p.name for p in out.iterdir())
        return real_cv(*a, **k)

    monkeypatch.setattr("fcprag_plugin.training.trainer.select", watched)
    interrupt_in_cv.arm()
    argv = _train_argv(tmp, cache, out)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert wrote, "the run had written nothing into --out before the cross-validation: the test proves nothing"
    assert "Traceback" not in err
    assert "interrupted (training restarts from the start); nothing was kept: run the same command again: " in err
    if before == "absent":
        assert not out.exists()
    else:
        assert out.is_dir() and list(out.iterdir()) == []
    again = _printed_command(err, "run the same command again: ")
    assert again == argv
    interrupt_in_cv.disarm()
    assert main(again) == 0
    assert (out / "config.json").is_file() and (out / "cv.json").is_file()


def test_ctrl_c_with_overwrite_keeps_what_was_there(labelled, capsys, interrupt_in_cv):
    """--overwrite into a directory with the user's file: the interrupted run removes only what it created."""
    tmp, cache = labelled
    out = tmp / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    interrupt_in_cv.arm()
    argv = _train_argv(tmp, cache, out, "--overwrite")
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert f"what this run had written into {out} was removed" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    again = _printed_command(err, "run the same command again: ")
    interrupt_in_cv.disarm()
    assert main(again) == 0 and (out / "notes.txt").read_text() == "mine"


def test_ctrl_c_after_an_epoch_keeps_nothing_and_the_same_command_runs(labelled, capsys, monkeypatch):
    from fcprag_plugin.training import trainer

    tmp, cache = labelled
    out = tmp / "run"
    real, logged = trainer.append_json_lines, []

    def log_then_interrupt(path, rows, **k):
        real(path, rows, **k)
        logged.extend(r["epoch"] for r in rows)
        raise KeyboardInterrupt  # right after the first epoch is logged

    monkeypatch.setattr(trainer, "append_json_lines", log_then_interrupt)
    argv = _train_argv(tmp, cache, out, "--cv-folds", "0", "--epochs", "3")
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert logged == [1] and "Traceback" not in err and not out.exists()
    again = _printed_command(err, "run the same command again: ")
    assert again == argv
    monkeypatch.setattr(trainer, "append_json_lines", real)
    assert main(again) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in log] == [1, 2, 3]
