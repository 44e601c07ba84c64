"""Stage 2: PRAG-style data augmentation -> ``cache/<dataset>/augment.jsonl`` (one line per retrieved passage).

For every retrieved passage the model itself (SmolLM2-135M-Instruct, greedy) writes
- a rewrite of the passage (``REWRITE_PROMPT``), and
- three question-answer pairs as a JSON list (``QA_PROMPT``).
The prompts are our own wording. Deterministic fallbacks, recorded per passage:
- a rewrite with fewer than ``MIN_REWRITE_WORDS`` words is dropped (the adapter trains on the passage and QA only);
- QA output is parsed as the first ``[...]`` JSON list of objects with non-empty string ``question`` and
  ``answer``; when that fails, as ``Question: ...`` / ``Answer: ...`` line pairs (the format this small model
  tends to write instead of JSON); answers longer than ``MAX_ANSWER_WORDS`` words, answers that repeat the
  question and duplicate questions are dropped; when fewer than 3 pairs survive, the
  rest come from ``examples/build_demo_adapters.py:derive_qa_pairs`` (an overview question and cloze questions
  built from the passage text alone), in its order, skipping duplicates.
Generation is batched (left padding) and resumable: finished passages are appended after every batch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from common import REPO, append_jsonl, cache_dir, load_model, logger, read_jsonl, setup_logging, timed

sys.path.insert(0, str(REPO / "examples"))
from build_demo_adapters import derive_qa_pairs  # noqa: E402

REWRITE_PROMPT = ("Rewrite the following passage in your own words. Keep every name, date and number.\n\n"
                  "Passage: {passage}")
QA_PROMPT = ("Read the passage and write three questions about its facts, each with a short answer. "
             "Reply only with a JSON list like "
             "[{{\"question\": \"...\", \"answer\": \"...\"}}, ...].\n\nPassage: {passage}")
MIN_REWRITE_WORDS = 10
MAX_ANSWER_WORDS = 12
QA_PAIRS = 3


_QA_LINES = re.compile(r"Question:\s*(?P<q>[^\n]+?)\s*\n\s*(?:\n\s*)*Answer:\s*(?P<a>[^\n]+)")


def _json_candidates(text: str) -> list[tuple[Any, Any]]:
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end <= start:
        return []
    try:
        obj = json.loads(text[start:end + 1])
    except json.JSONDecodeError:
        return []
    if not isinstance(obj, list):
        return []
    return [(it.get("question"), it.get("answer")) for it in obj if isinstance(it, dict)]


def parse_qa(text: str) -> tuple[list[dict[str, str]], str]:
    """The valid pairs in the model's QA output (possibly none) and the format they came from."""
    candidates, fmt = _json_candidates(text), "json"
    if not candidates:
        candidates, fmt = [(m.group("q"), m.group("a")) for m in _QA_LINES.finditer(text)], "lines"
    pairs: list[dict[str, str]] = []
    for q, a in candidates:
        if not (isinstance(q, str) and isinstance(a, str) and q.strip() and a.strip()):
            continue
        q, a = q.strip(), a.strip()
        if len(a.split()) > MAX_ANSWER_WORDS or a.lower().rstrip("?") == q.lower().rstrip("?"):
            continue
        if any(p["question"] == q for p in pairs):
            continue
        pairs.append({"question": q, "answer": a, "source": f"model-{fmt}"})
    return pairs[:QA_PAIRS], (fmt if pairs else "none")


def complete_pairs(model_pairs: list[dict[str, str]], passage: str) -> list[dict[str, str]]:
    pairs = list(model_pairs)
    for p in derive_qa_pairs(passage, max_pairs=QA_PAIRS):
        if len(pairs) >= QA_PAIRS:
            break
        if all(p["question"] != q["question"] for q in pairs):
            pairs.append({"question": p["question"], "answer": p["answer"], "source": "fallback"})
    return pairs


def clean_rewrite(text: str) -> str | None:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text.split()) >= MIN_REWRITE_WORDS else None


def generate(model: Any, tok: Any, prompts: list[str], max_new_tokens: int) -> list[str]:
    import torch

    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id)
    return [tok.decode(o[enc["input_ids"].shape[1]:], skip_special_tokens=True) for o in out]


def run(dataset: str, batch_size: int, max_new_tokens: int, max_passage_words: int, limit: int | None) -> None:
    from tqdm import tqdm

    rows = read_jsonl(cache_dir(dataset) / "retrieval.jsonl")
    out_path = cache_dir(dataset) / "augment.jsonl"
    done = {r["pid"] for r in read_jsonl(out_path)} if out_path.exists() else set()
    todo: dict[str, str] = {}
    for r in rows:
        for p in r["passages"]:
            if p["pid"] not in done:
                todo.setdefault(p["pid"], p["text"])
    items = sorted(todo.items(), key=lambda kv: len(kv[1]))  # similar lengths per batch: less padding
    if limit is not None:
        items = items[:limit]
    if not items:
        logger.info("%s: augmentation already complete (%d passages)", dataset, len(done))
        return
    model, tok = load_model("bfloat16")
    with timed(dataset, "augment", passages=len(items), batch_size=batch_size, max_new_tokens=max_new_tokens):
        for s in tqdm(range(0, len(items), batch_size), desc="augment", unit="batch"):
            batch = items[s:s + batch_size]
            texts = [" ".join(t.split()[:max_passage_words]) for _, t in batch]
            gen = generate(model, tok, [REWRITE_PROMPT.format(passage=t) for t in texts]
                           + [QA_PROMPT.format(passage=t) for t in texts], max_new_tokens)
            out = []
            for j, (pid, text) in enumerate(batch):
                rewrite_raw, qa_raw = gen[j], gen[len(batch) + j]
                model_pairs, fmt = parse_qa(qa_raw)
                out.append({"pid": pid, "passage": text, "rewrite": clean_rewrite(rewrite_raw),
                            "qa_pairs": complete_pairs(model_pairs, text), "qa_parsed": len(model_pairs),
                            "qa_format": fmt,
                            "raw": {"rewrite": rewrite_raw, "qa": qa_raw}})
            append_jsonl(out_path, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--batch-size", type=int, default=16, help="passages per batch (x2 prompts)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-passage-words", type=int, default=150)
    p.add_argument("--limit", type=int, default=None, help="only this many passages (a trial run)")
    a = p.parse_args(argv)
    setup_logging()
    run(a.dataset, a.batch_size, a.max_new_tokens, a.max_passage_words, a.limit)


if __name__ == "__main__":
    main()
