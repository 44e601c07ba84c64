"""A tiny study: a random Llama with the tiny word tokenizer, and questions written in its words."""

from __future__ import annotations

import json
import random

import pytest

from helpers import TINY_WORDS, save_tiny_lm


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
