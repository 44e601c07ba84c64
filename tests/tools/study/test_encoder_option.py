"""``fcprag study --encoder PATH``: a sentence encoder given by path trains the controller and weighs the held-out
questions (the evaluation once passed the path string on as if it were an encoder)."""

from __future__ import annotations

import json

from fcprag_tools.cli import main
from fcprag_tools.study import check_summary
from helpers import save_tiny_sentence_encoder


def test_study_with_an_encoder_path(tiny_study):
    out = tiny_study["root"] / "enc"
    encoder = save_tiny_sentence_encoder(tiny_study["root"] / "encoder")
    assert main(["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--top-k", "2",
                 "--scales", "2,4", "--max-new-tokens", "3", "--test-fraction", "0.5", "--epochs", "2",
                 "--no-progress", "--encoder", str(encoder)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert check_summary(s) == []
    assert json.loads((out / "controller" / "config.json").read_text())["embed_dim"] == 32
