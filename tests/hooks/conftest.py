import pytest

from dyprag_double import harness as H


@pytest.fixture
def double(tmp_path):
    """The DyPRAG double's ``src/`` copied under ``tmp_path`` and a data file with one question per
    ``harness.COUNTS``: ``(script, data file, questions)``."""
    script = H.copy_double(tmp_path)
    questions = H.make_questions(H.COUNTS)
    data = H.write_data(tmp_path / "data.jsonl", questions)
    return script, data, questions
