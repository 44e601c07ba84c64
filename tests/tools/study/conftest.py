"""A tiny study: a random Llama with the tiny word tokenizer, and questions written in its words."""

from __future__ import annotations

import json
import random

import pytest

from fcprag_tools.study import scoring
from helpers import TINY_WORDS, save_tiny_lm

REAL_SCORE = scoring.score  # what the scored_rows fixture wraps


def write_questions(path, n: int, passages: int = 4, seed: int = 0):
    words = [w for w in TINY_WORDS if w.isalpha()]
    r = random.Random(seed)
    rows = []
    for i in range(n):
        ps = [f"{t}: " + " ".join(r.choice(words) for _ in range(10)) + " ."
              for t in r.sample(words, passages)]
        rows.append({"id": f"q{i}", "question": "what is the " + " ".join(r.choice(words) for _ in range(3)) + " ?",
                     "answer": r.choice(["paris", "berlin", "rome"]), "passages": ps})
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return path


@pytest.fixture
def tiny_study(tmp_path):
    return {"model": str(save_tiny_lm(tmp_path / "lm")), "questions": str(write_questions(tmp_path / "q.jsonl", 6)),
            "root": tmp_path}


@pytest.fixture
def scored_rows(monkeypatch):
    """The ids (``qid|name``) of every row ``scoring.score`` is asked to score from now on, in order; the scoring
    itself is :data:`REAL_SCORE`'s."""
    seen: list[str] = []

    def counted(model, tok, slot, rows, *a, **k):
        seen.extend(f"{r.qid}|{r.name}" for r in rows)
        return REAL_SCORE(model, tok, slot, rows, *a, **k)

    monkeypatch.setattr(scoring, "score", counted)
    return seen
