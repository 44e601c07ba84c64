"""``scoring="prag"``: PRAG's answer scoring, from its description (strip, cut at the first '.', newline or ',',
SQuAD normalisation, token F1 with the yes/no/noanswer rule, max over aliases). Expected values are worked out by
hand in the comments, not computed with the library."""

from __future__ import annotations

import json

import pytest

from fcprag_tools.cli import main
from fcprag_tools.lm.metrics import SCORINGS, extract_answer, score_generation
from helpers import make_adapter_dir, save_tiny_lm

# (generation, gold aliases, cot, expected prediction, f1, em) under scoring="prag"
PRAG_CASES = [
    # cut at the first stop; ',' comes before '.'
    ("Paris, France.", ["Paris"], False, "Paris", 1.0, 1.0),
    # leading newlines/spaces are stripped before cutting (not an empty answer)
    # tokens [paris, is, capital] ("the" dropped) vs [paris]: p = 1/3, r = 1, f1 = 0.5
    ("\n\n  Paris is the capital.", ["Paris"], False, "Paris is the capital", 0.5, 0.0),
    # the earliest of the three stops wins, whatever their order in the list
    ("1,000. Paris", ["1"], False, "1", 1.0, 1.0),
    ("x\ny. z, w", ["x"], False, "x", 1.0, 1.0),
    # punctuation inside the answer is dropped ("U-S" -> "us"), and so is the article
    ("The U-S Army", ["us army"], False, "The U-S Army", 1.0, 1.0),
    # yes/no/noanswer: a special gold or prediction scores F1 0 unless equal after normalisation
    ("Yes, it is.", ["yes"], False, "Yes", 1.0, 1.0),
    ("yes it is", ["yes"], False, "yes it is", 0.0, 0.0),  # plain token F1 would be 0.5
    ("No", ["noanswer"], False, "No", 0.0, 0.0),
    # max over aliases: "new york city" vs "new york": p = 2/3, r = 1, f1 = 0.8
    ("New York City.", ["NYC", "new york"], False, "New York City", 0.8, 0.0),
    # nothing before the first stop: an empty answer scores 0
    (". Paris", ["Paris"], False, "", 0.0, 0.0),
    # chain-of-thought: the answer after the lower-case marker
    ("Paris is in France. So the answer is The Beatles.\nDone", ["Beatles"], True, "The Beatles", 1.0, 1.0),
    # PRAG's marker is case-sensitive: "The answer is" is not found, the whole text is cut and scored:
    # tokens [answer, is, rome] vs [rome]: p = 1/3, r = 1, f1 = 0.5
    ("The answer is Rome, surely", ["Rome"], True, "The answer is Rome", 0.5, 0.0),
]


@pytest.mark.parametrize("gen,gold,cot,pred,f1,em", PRAG_CASES)
def test_prag_scoring_hand_made_cases(gen, gold, cot, pred, f1, em):
    got = score_generation(gen, gold, cot=cot, scoring="prag")
    assert got[0] == pred
    assert got[1] == pytest.approx(f1) and got[2] == em


def test_default_differs_only_in_the_cot_marker_case():
    for gen, gold, cot, *_ in PRAG_CASES:
        if not cot:
            assert score_generation(gen, gold, scoring="default") == score_generation(gen, gold, scoring="prag")
    assert extract_answer("The answer is Rome, surely", cot=True) == "Rome"
    assert extract_answer("The answer is Rome, surely", cot=True, scoring="prag") == "The answer is Rome"
    # the text right after the marker, even behind a character that lower() turns into two
    assert extract_answer("\u0130 so The Answer Is: Oslo.", cot=True) == ": Oslo"


def test_unknown_scoring_is_refused():
    assert SCORINGS == ("default", "prag")
    with pytest.raises(ValueError, match="scoring 'squad'"):
        extract_answer("x", scoring="squad")


@pytest.mark.parametrize("scoring,f1", [("default", 1.0), ("prag", 0.5)])
def test_labels_build_scoring_option_reaches_the_labels(tmp_path, monkeypatch, scoring, f1):
    """`fcprag labels build --cot --scoring S`: the label's f1 is the one S gives for the generation."""
    from fcprag_tools.label_builder import builder

    # a fixed generation through the sequential path's generator (--batch-size 1 below selects that path)
    monkeypatch.setattr(builder, "greedy_generate", lambda *a, **k: "The answer is Rome, surely")
    ad = make_adapter_dir(tmp_path / "passage_0", seed=0)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "q0", "question": "Capital of Italy?", "answer": "Rome",
                                    "passages": ["Rome is in Italy."], "adapters": [str(ad)]}) + "\n")
    out = tmp_path / "labels.jsonl"
    assert main(["labels", "build", str(manifest), "--model", str(save_tiny_lm(tmp_path / "lm", seed=0)),
                 "--out", str(out), "--cot", "--metric", "f1", "--scoring", scoring, "--batch-size", "1",
                 "--no-progress"]) == 0
    lab = json.loads(out.read_text().splitlines()[0])
    assert lab["metric_all"] == pytest.approx(f1) and lab["metric_without"] == [pytest.approx(f1)]
