"""Stage 1: questions, split and BM25 retrieval -> ``cache/<dataset>/retrieval.jsonl``.

The first ``--questions`` questions of the data file (file order, no selection), split by question with a
seeded shuffle into train / test. BM25 (``bm25s``, Lucene variant, k1 = 1.5, b = 0.75, English stop words) ranks
each question's own 10 passages; the top ``--top-k`` are kept and marked supporting or distractor.
Questions the demo uses (the first 3 HotpotQA questions) are always in the test split, so the demo's
shipped train labels never contain them.
"""

from __future__ import annotations

import argparse
import hashlib

from common import cache_dir, check_dataset, read_jsonl, rng, timed, write_json, write_jsonl

BM25 = {"library": "bm25s", "method": "lucene", "k1": 1.5, "b": 0.75, "stopwords": "en",
        "corpus": "the question's own 10 passages"}
DEMO_QUESTIONS = 3  # examples/quickstart.py asks the first 3 HotpotQA questions


def passage_id(text: str) -> str:
    """A stable id for a passage text (adapters are keyed by text: the same passage shares one adapter)."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def bm25_rank(question: str, passages: list[str]) -> list[tuple[int, float]]:
    import bm25s

    corpus = bm25s.tokenize(passages, stopwords=BM25["stopwords"], show_progress=False)
    retriever = bm25s.BM25(method=BM25["method"], k1=BM25["k1"], b=BM25["b"])
    retriever.index(corpus, show_progress=False)
    docs, scores = retriever.retrieve(bm25s.tokenize([question], stopwords=BM25["stopwords"], show_progress=False),
                                      k=len(passages), show_progress=False)
    return sorted(((int(d), float(s)) for d, s in zip(docs[0], scores[0])), key=lambda t: (-t[1], t[0]))


def run(dataset: str, questions: int, test: int, top_k: int) -> None:
    rows = read_jsonl(check_dataset(dataset))
    if len(rows) < questions:
        raise SystemExit(f"{dataset}: the data file has {len(rows)} questions, {questions} were asked for")
    rows = rows[:questions]
    forced = set(range(DEMO_QUESTIONS)) if dataset == "hotpotqa" else set()
    order = [i for i in range(questions) if i not in forced]
    rng("split", dataset).shuffle(order)
    test_idx = set(forced) | set(order[: test - len(forced)])
    out = []
    with timed(dataset, "retrieve", questions=questions, top_k=top_k):
        for k, row in enumerate(rows):
            ranked = bm25_rank(row["question"], row["passages"])[:top_k]
            answer = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
            out.append({
                "id": row["id"], "index": k, "split": "test" if k in test_idx else "train",
                "question": row["question"], "answer": answer, "type": row.get("type"),
                "supporting_titles": row["supporting_titles"],
                "passages": [{"source_index": i, "title": row["titles"][i], "text": row["passages"][i],
                              "pid": passage_id(row["passages"][i]), "bm25": round(s, 4),
                              "supporting": row["titles"][i] in row["supporting_titles"]} for i, s in ranked],
            })
    write_jsonl(cache_dir(dataset) / "retrieval.jsonl", out)
    n_sup = sum(p["supporting"] for r in out for p in r["passages"])
    write_json(cache_dir(dataset) / "retrieval_summary.json", {
        "dataset": dataset, "questions": questions, "train": questions - len(test_idx), "test": len(test_idx),
        "top_k": top_k, "bm25": BM25, "supporting_retrieved": n_sup, "retrieved": top_k * questions,
        "questions_with_no_supporting_retrieved": sum(not any(p["supporting"] for p in r["passages"]) for r in out),
        "questions_with_all_supporting_retrieved": sum(
            sum(p["supporting"] for p in r["passages"]) == len(r["supporting_titles"]) for r in out),
    })


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--test", type=int, default=50)
    p.add_argument("--top-k", type=int, default=3)
    a = p.parse_args(argv)
    run(a.dataset, a.questions, a.test, a.top_k)


if __name__ == "__main__":
    main()
