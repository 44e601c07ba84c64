"""CPU stages of the study: split + BM25 retrieval, deterministic augmentation, embeddings.

- ``retrieval(data, out, test_fraction, top_k)``: every question of a ``../shared/data``-schema file (but the
  ``exclude``d ids), split by question with a seeded shuffle (``test_fraction`` of the questions in test; the
  first 3 HotpotQA questions, which the demo asks, always in test), BM25 (``retrieve.bm25_rank``) of the question
  over its own 10 passages, top ``top_k`` kept with their score, rank and supporting flag.
- ``augmentation(retrieval, out)``: the documented deterministic augmentation, no model generation: per passage
  the passage itself and three QA pairs from ``examples/build_demo_adapters.py:derive_qa_pairs`` (an overview
  question answered by the first sentence, cloze questions whose answer is a year or name in the passage).
  (The model's own augmentation parsed for only 6% of QA pairs in the earlier study, so it is not used.)
- ``embeddings(retrieval, out)``: MiniLM (the packaged all-MiniLM-L6-v2, the library's ``TextEncoder``)
  embeddings of every question and retrieved passage, ``{sha256(text): [384]}`` safetensors (float32).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from augment import complete_pairs
from common import read_jsonl, rng, write_jsonl
from retrieve import BM25, bm25_rank, passage_id

DEMO_QUESTIONS = 3


def retrieval(data: Path, out: Path, test_fraction: float, top_k: int, limit: int | None = None,
              dataset: str | None = None, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``exclude``: question ids left out before ``limit`` counts (a controller's training questions)."""
    rows = read_jsonl(data)
    for n, row in enumerate(rows, 1):
        for key in ("id", "question", "answer", "passages", "titles", "supporting_titles"):
            if key not in row:
                raise SystemExit(f"{data}:{n}: field '{key}' missing; expected the ../shared/data record schema")
    name = dataset or data.stem
    rows = [r for r in rows if r["id"] not in exclude]
    if limit is not None:
        rows = rows[:limit]
    forced = set(range(min(DEMO_QUESTIONS, len(rows)))) if "hotpotqa" in name else set()
    order = [i for i in range(len(rows)) if i not in forced]
    rng("split", name).shuffle(order)
    n_test = max(1, round(test_fraction * len(rows))) if len(rows) > 1 else 0
    test_idx = set(forced) | set(order[: max(0, n_test - len(forced))])
    out_rows = []
    for k, row in enumerate(rows):
        ranked = bm25_rank(row["question"], row["passages"])[:top_k]
        answer = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
        out_rows.append({
            "id": row["id"], "dataset": name, "index": k, "split": "test" if k in test_idx else "train",
            "question": row["question"], "answer": answer, "type": row.get("type"),
            "supporting_titles": row["supporting_titles"],
            "passages": [{"source_index": i, "title": row["titles"][i], "text": row["passages"][i],
                          "pid": passage_id(row["passages"][i]), "bm25": round(s, 4), "rank": r,
                          "supporting": row["titles"][i] in row["supporting_titles"]}
                         for r, (i, s) in enumerate(ranked)],
        })
    write_jsonl(out, out_rows)
    return out_rows


def retrieval_summary(rows: list[dict[str, Any]], top_k: int) -> dict[str, Any]:
    top3 = [r["passages"][:3] for r in rows]
    return {"questions": len(rows), "train": sum(r["split"] == "train" for r in rows),
            "test": sum(r["split"] == "test" for r in rows), "top_k": top_k, "bm25": BM25,
            "supporting_in_top3": sum(p["supporting"] for ps in top3 for p in ps),
            "supporting_in_topk": sum(p["supporting"] for r in rows for p in r["passages"]),
            "questions_with_no_supporting_in_top3": sum(not any(p["supporting"] for p in ps) for ps in top3)}


def augmentation(rows: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        for p in r["passages"]:
            if p["pid"] not in seen:
                seen[p["pid"]] = {"pid": p["pid"], "passage": p["text"], "rewrite": None,
                                  "qa_pairs": complete_pairs([], p["text"]), "qa_parsed": 0,
                                  "qa_format": "deterministic"}
    aug = list(seen.values())
    write_jsonl(out, aug)
    return aug


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def embeddings(rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """``{sha256(text): tensor [d]}`` for every question and retrieved passage (computed once, saved)."""
    import torch
    from safetensors.torch import load_file, save_file

    from fcprag_plugin.encoding import TextEncoder

    have = load_file(str(out)) if out.exists() else {}
    texts = list(dict.fromkeys([r["question"] for r in rows] + [p["text"] for r in rows for p in r["passages"]]))
    todo = [t for t in texts if text_key(t) not in have]
    if todo:
        enc = TextEncoder()
        E = enc.encode(todo)
        for t, e in zip(todo, E):
            have[text_key(t)] = e.float().contiguous().clone()
        save_file({k: v.contiguous() for k, v in have.items()}, str(out))
    return {k: torch.as_tensor(v) for k, v in have.items()}
