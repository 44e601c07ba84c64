"""Questions in, retrieved passages out.

Input files (a JSON array or JSON Lines each): the ``data/README.md`` schema (``id``, ``question``, ``answer``,
``passages`` as ``"<title>: <text>"``, optional ``titles`` / ``supporting_titles`` / ``type``), or the data files of
PRAG's four datasets: HotpotQA / 2WikiMultihopQA (``_id``, ``question``, ``answer``, ``context`` as
``[[title, [sentence, ...]], ...]``, ``supporting_facts`` as ``[[title, index], ...]``, ``type``), PopQA
(``question``, ``possible_answers``) and ComplexWebQuestions (``ID``, ``question``, ``answers`` as
``[{"answer", "aliases"}]``); the last two carry no passages and need a retrieval file. A question's dataset is its
``dataset`` field, else its file's name without extension; its subtask is its ``type``, else ``all``.

Retrieval: BM25 (``bm25s``, Lucene, k1 1.5, b 0.75, English stop words) of the question over its own passages, the
top ``k`` kept in rank order; or a user's retrieval file, JSON Lines ``{"id": ..., "passages": [text, ...]}`` in
rank order (optional ``"scores"``), used as given.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_records

logger = logging.getLogger(__name__)

QUESTION_FORMATS = ("JSON Lines or a JSON array of the data/README.md schema (id, question, answer, passages), "
                    "PRAG's HotpotQA / 2WikiMultihopQA JSON (_id, question, answer, context), PopQA (question, "
                    "possible_answers) or ComplexWebQuestions (question, answers)")
BM25 = {"library": "bm25s", "method": "lucene", "k1": 1.5, "b": 0.75, "stopwords": "en"}


def passage_id(text: str) -> str:
    """A stable id of a passage text: one adapter per distinct text."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _records(path: Path) -> list[tuple[int, Any]]:
    return read_records(path, FcpragError)


def _answers(r: dict[str, Any]) -> Any:
    """The gold answers of a record in any of the read layouts (None when it has none)."""
    if "answer" in r:
        return [r["answer"]] if isinstance(r["answer"], str) else r["answer"]
    if "possible_answers" in r:  # PopQA: a JSON-encoded list (the released file) or a list
        pa = r["possible_answers"]
        if isinstance(pa, str):
            try:
                pa = json.loads(pa)
            except json.JSONDecodeError:
                return None
        return pa
    if "answers" in r:  # ComplexWebQuestions: [{"answer", "aliases"}], or plain strings
        out: list[Any] = []
        for a in r["answers"] if isinstance(r["answers"], list) else [None]:
            if isinstance(a, dict):
                out += [a.get("answer"), *(a.get("aliases") or [])]
            else:
                out.append(a)
        return list(dict.fromkeys(out))
    return None


def read_questions(path: str | Path) -> list[dict[str, Any]]:
    """``[{"id", "question", "answers": [...], "passages": [...] | None, "titles", "supporting", "dataset",
    "subtask"}]``. ``dataset``: the record's ``dataset`` field, else the file's name without extension;
    ``subtask``: its ``type`` field, else ``all``. ``passages`` is None for a file without them (PopQA,
    ComplexWebQuestions): such questions need ``--retrieval``."""
    path = Path(path)
    if not path.is_file():
        raise FcpragError(f"{path}: question file not found; expected {QUESTION_FORMATS}")
    out, seen = [], set()
    for n, r in _records(path):
        where = f"{path}:{n}"
        if not isinstance(r, dict):
            raise FcpragError(f"{where}: expected a JSON object per question")
        if "context" in r and "passages" not in r:  # PRAG's / the original datasets' layout
            ctx = r["context"]
            titles = [c[0] for c in ctx]
            passages = [f"{c[0]}: {' '.join(s.strip() for s in c[1])}" for c in ctx]
            support = list(dict.fromkeys(f[0] for f in r.get("supporting_facts", [])))
        else:
            passages = r.get("passages")
            titles = r.get("titles") or [p.partition(": ")[0] for p in passages or [] if isinstance(p, str)]
            support = r.get("supporting_titles", [])
        qid = next((r[k] for k in ("id", "_id", "ID") if k in r), f"{path.stem}:{n}")
        qid = str(qid) if isinstance(qid, int) and not isinstance(qid, bool) else qid
        for key, val, ok in (("id", qid, isinstance(qid, str) and qid),
                             ("question", r.get("question"), isinstance(r.get("question"), str)
                              and r["question"].strip()),
                             ("passages", passages, passages is None or (isinstance(passages, list) and passages
                              and all(isinstance(p, str) and p.strip() for p in passages)))):
            if not ok:
                raise FcpragError(f"{where}: field '{key}': missing or invalid ({str(val)[:60]!r}); expected "
                                  f"{QUESTION_FORMATS}")
        answers = _answers(r)
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise FcpragError(f"{where}: field 'answer' (or 'possible_answers' / 'answers'): expected a non-empty "
                              "string or list of strings")
        if qid in seen:
            raise FcpragError(f"{where}: field 'id': duplicate id '{qid}'")
        seen.add(qid)
        dataset = r.get("dataset") if isinstance(r.get("dataset"), str) and r["dataset"].strip() else path.stem
        subtask = r.get("type") if isinstance(r.get("type"), str) and r["type"].strip() else "all"
        out.append({"id": qid, "question": r["question"], "answers": answers, "passages": passages,
                    "titles": titles, "supporting": support, "dataset": dataset, "subtask": subtask})
    if not out:
        raise FcpragError(f"{path}: no questions in it")
    return out


def read_question_files(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """:func:`read_questions` of every file, in order; an id in two files is an error naming both."""
    out: list[dict[str, Any]] = []
    first: dict[str, str] = {}
    for path in paths:
        for q in read_questions(path):
            if q["id"] in first:
                raise FcpragError(f"{path}: field 'id': question id '{q['id']}' is also in {first[q['id']]}; "
                                  "ids must be unique across the question files")
            first[q["id"]] = str(path)
            out.append(q)
    return out


def split(ids: list[str], test_fraction: float, seed: int) -> set[str]:
    """The test ids: a seeded shuffle of the question ids, ``round(test_fraction * n)`` of them (at least 1 and
    at most n - 1 when there are two or more questions)."""
    order = sorted(ids)
    random.Random(f"split:{seed}").shuffle(order)
    n = len(order)
    k = min(max(1, round(test_fraction * n)), n - 1) if n > 1 else 0
    return set(order[:k])


def stratified_split(qs: Sequence[dict[str, Any]], test_fraction: float, seed: int) -> set[str]:
    """The test ids, stratified by ``(dataset, subtask)``: ``round(test_fraction * n)`` held out in all (at least 1,
    at most n - 1 when n >= 2), shared among the strata by largest remainder (each gets the floor of its share, the
    largest remainders one more; ties by stratum name), each stratum's taken from a seeded shuffle of its sorted ids.
    A pure function of the ids, datasets, subtasks, fraction and seed (not of the questions' order)."""
    strata: dict[tuple[str, str], list[str]] = {}
    for q in qs:
        strata.setdefault((q["dataset"], q["subtask"]), []).append(q["id"])
    n = sum(map(len, strata.values()))
    k = min(max(1, round(test_fraction * n)), n - 1) if n > 1 else 0
    keys = sorted(strata)
    share = {s: test_fraction * len(strata[s]) for s in keys}
    take = {s: min(int(share[s]), len(strata[s])) for s in keys}
    for s in sorted(keys, key=lambda s: (-(share[s] - int(share[s])), s)):
        if sum(take.values()) >= k:
            break
        take[s] += take[s] < len(strata[s])
    for s in sorted(keys, key=lambda s: (-len(strata[s]), s)):  # the floor of 1: still short, the largest first
        while sum(take.values()) < k and take[s] < len(strata[s]):
            take[s] += 1
    while sum(take.values()) > k:  # at most n - 1: give one back from the largest stratum's share
        s = max(keys, key=lambda s: (take[s], s))
        take[s] -= 1
    test: set[str] = set()
    for s in keys:
        order = sorted(strata[s])
        random.Random(f"split:{seed}:{s[0]}/{s[1]}").shuffle(order)
        test.update(order[:take[s]])
    return test


def split_method(qs: Sequence[dict[str, Any]], test: set[str], settings: dict[str, Any]) -> str:
    """How the recorded held-out set ``test`` was made, checked against each rule rather than assumed."""
    if settings.get("controller"):
        return "none: a given controller, every question evaluated"
    if settings.get("train_ids"):
        return "the --train-ids file's complement"
    fraction, seed = settings.get("test_fraction"), settings.get("seed")
    if isinstance(fraction, (int, float)) and isinstance(seed, int):
        if stratified_split(qs, fraction, seed) == test:
            return f"stratified by dataset and subtask (seed {seed}, test fraction {fraction:g})"
        if split([q["id"] for q in qs], fraction, seed) == test:
            return f"a seeded shuffle, not stratified (seed {seed}, test fraction {fraction:g})"
    return "as recorded in questions.jsonl (no rule of this version reproduces it)"


def read_ids(path: str | Path, where: str | None = None) -> list[str]:
    """Question ids from a file: JSON ``{"ids": [...]}`` (a controller's ``train_question_ids.json``), a JSON list,
    or one id per line; ``where`` names the file in the error (default ``--train-ids PATH``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        text = ""  # not text: refused below
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(value, dict):
        value = value.get("ids")
    if not isinstance(value, list) or not value or not all(isinstance(i, str) and i for i in value):
        raise FcpragError(f"{where or f'--train-ids {path}'}: expected JSON {{\"ids\": [...]}}, a JSON list, or one "
                          "id per line, with at least one id")
    return value


def split_by_ids(ids: list[str], train: list[str], where: str) -> set[str]:
    """The test ids: every question whose id is not in ``train``; at least one of each side."""
    train_set = set(train)
    test = {i for i in ids if i not in train_set}
    if len(test) == len(ids) or not test:
        side = "none of" if test else "every one of"
        raise FcpragError(f"{where}: {side} the questions' ids is listed there; a study needs training and held-out "
                          "questions")
    missing = len(train_set - set(ids))
    if missing:
        logger.warning("%s: %d listed id(s) are not among the questions", where, missing)
    return test


def bm25_rank(question: str, passages: list[str]) -> list[tuple[int, float]]:
    """``[(passage index, score)]`` best first (ties by index)."""
    try:
        import bm25s
    except ImportError:
        raise FcpragError("retrieval needs the bm25s package (pip install bm25s), or pass --retrieval FILE") from None
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index it builds at DEBUG
    corpus = bm25s.tokenize(passages, stopwords=BM25["stopwords"], show_progress=False)
    retriever = bm25s.BM25(method=BM25["method"], k1=BM25["k1"], b=BM25["b"])
    retriever.index(corpus, show_progress=False)
    docs, scores = retriever.retrieve(bm25s.tokenize([question], stopwords=BM25["stopwords"], show_progress=False),
                                      k=len(passages), show_progress=False)
    return sorted(((int(d), float(s)) for d, s in zip(docs[0], scores[0])), key=lambda t: (-t[1], t[0]))


def read_retrieval(path: str | Path) -> dict[str, dict[str, Any]]:
    """A user's retrieval file: ``{id: {"passages": [...], "scores": [...] | None}}``."""
    path = Path(path)
    if not path.is_file():
        raise FcpragError(f"--retrieval {path}: file not found; expected JSON Lines {{\"id\", \"passages\": [...]}}")
    out = {}
    for n, r in _records(path):
        ps = r.get("passages") if isinstance(r, dict) else None
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(ps, list) or not ps \
                or not all(isinstance(p, str) and p.strip() for p in ps):
            raise FcpragError(f"--retrieval {path}:{n}: expected {{\"id\": str, \"passages\": [non-empty text, ...]}}")
        sc = r.get("scores")
        if sc is not None and (not isinstance(sc, list) or len(sc) != len(ps)):
            raise FcpragError(f"--retrieval {path}:{n}: field 'scores': expected one number per passage")
        out[r["id"]] = {"passages": ps, "scores": sc}
    return out


def retrieve(q: dict[str, Any], top_k: int, given: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The question's top ``top_k`` passages: ``[{"pid", "text", "title", "rank", "score", "supporting"}]``."""
    if given is not None:
        texts = given["passages"][:top_k]
        scores = given["scores"] or [0.0] * len(texts)
        ranked = [(texts[i], float(scores[i])) for i in range(len(texts))]
    else:
        ranked = [(q["passages"][i], s) for i, s in bm25_rank(q["question"], q["passages"])[:top_k]]
    out = []
    for r, (text, s) in enumerate(ranked):
        title = text.partition(": ")[0]
        out.append({"pid": passage_id(text), "text": text, "title": title, "rank": r, "score": round(s, 4),
                    "supporting": title in q["supporting"]})
    return out
