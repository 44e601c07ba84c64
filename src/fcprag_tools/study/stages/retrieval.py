"""The retrieval stage: each question with its split and top-k passages (``questions.jsonl``, a row a question)."""

from __future__ import annotations

import time
from typing import Any

from .. import data
from ..preflight import Selection
from ..run import StudyRun

Questions = dict[str, dict[str, Any]]  # {qid: {"question", "answers", "split", "dataset", "subtask", "passages"}}


def retrieve_questions(run: StudyRun, sel: Selection, top_k: int) -> Questions:
    """The selected questions with ``top_k`` passages each (BM25 over the question's own passages, or the user's
    retrieval file) and their split, written once on rank 0; every question, in file order."""
    t0 = time.perf_counter()
    qs, given, test = sel.questions, sel.given, sel.test
    st = run.store("questions")
    done = st.done()
    todo = [q for q in qs if q["id"] not in done]
    run.kept("retrieval", len(qs), len(qs) - len(todo), "questions")
    if todo and run.shard.rank == 0:
        with run.bar("retrieval", len(qs), len(qs) - len(todo), "q") as bar:
            for q in todo:
                st.append([{"id": q["id"], "question": q["question"], "answers": q["answers"],
                            "split": "test" if q["id"] in test else "train", "dataset": q["dataset"],
                            "subtask": q["subtask"], "supporting_titles": q["supporting"],
                            "passages": data.retrieve(q, top_k, given and given[q["id"]])}])
                bar.update(1)
    run.barrier("questions")
    rows = st.done()
    run.timed("retrieval", t0, questions=len(todo))
    # a cached row without a dataset or subtask takes them from the question files
    return {q["id"]: {"dataset": q["dataset"], "subtask": q["subtask"], **rows[q["id"]]} for q in qs}

