"""PRAG's data augmentation, by the model itself (greedy): per passage a rewrite and three question-answer pairs.

Prompts (our wording of PRAG's recipe): :data:`REWRITE_PROMPT`, :data:`QA_PROMPT`. Parsing, deterministic:
- a rewrite with fewer than ``MIN_REWRITE_WORDS`` words is dropped (the adapter trains on the passage and QA);
- QA output: the first ``[...]`` JSON list of ``{"question", "answer"}`` objects, else ``Question: ...`` /
  ``Answer: ...`` line pairs; answers longer than ``MAX_ANSWER_WORDS`` words, answers repeating the question and
  duplicate questions are dropped; fewer than 3 pairs are completed by :func:`fallback_pairs` (built from the
  passage text alone; never from a study question or its answer). Each pair records its ``source``.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Callable, Iterator, Sequence

REWRITE_PROMPT = ("Rewrite the following passage in your own words. Keep every name, date and number.\n\n"
                  "Passage: {passage}")
QA_PROMPT = ("Read the passage and write three questions about its facts, each with a short answer. "
             "Reply only with a JSON list like "
             "[{{\"question\": \"...\", \"answer\": \"...\"}}, ...].\n\nPassage: {passage}")
MIN_REWRITE_WORDS = 10
MAX_ANSWER_WORDS = 12
QA_PAIRS = 3
_QA_LINES = re.compile(r"Question:\s*(?P<q>[^\n]+?)\s*\n\s*(?:\n\s*)*Answer:\s*(?P<a>[^\n]+)")
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"(])")
_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})\b")
_NAME = re.compile(r"\b[A-Z][a-z]+(?:\s+[A-Z][a-z]+)*")


def _json_candidates(text: str) -> list[tuple[Any, Any]]:
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end <= start:
        return []
    try:
        obj = json.loads(text[start:end + 1])
    except json.JSONDecodeError:
        return []
    return [(it.get("question"), it.get("answer")) for it in obj if isinstance(it, dict)] \
        if isinstance(obj, list) else []


def parse_qa(text: str) -> list[dict[str, str]]:
    """The valid pairs in the model's QA output (possibly none), at most ``QA_PAIRS``."""
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
        if all(p["question"] != q for p in pairs):
            pairs.append({"question": q, "answer": a, "source": f"model-{fmt}"})
    return pairs[:QA_PAIRS]


def fallback_pairs(passage: str, max_words: int = 28) -> list[dict[str, str]]:
    """Deterministic pairs from the passage text: an overview question answered by the first sentence, then
    cloze questions (a sentence's last year, else its last capitalised name, blanked)."""
    title, sep, body = passage.partition(": ")
    if not sep:
        title, body = "", passage
    subject = title.strip() or "this topic"
    sentences = [" ".join(s.split()[:max_words]) for s in _SENT.split(body.strip()) if s.strip()]
    pairs = [{"question": f"What do you know about {subject}?", "answer": sentences[0], "source": "fallback"}] \
        if sentences else []
    for s in sentences:
        spans = _YEAR.findall(s) or [m.group(0) for m in _NAME.finditer(s)
                                     if m.start() > 0 and m.group(0).lower() not in subject.lower()]
        if spans:
            cut = s.rfind(spans[-1])
            pairs.append({"question": f"Fill in the blank about {subject}: {s[:cut]}___{s[cut + len(spans[-1]):]}",
                          "answer": spans[-1], "source": "fallback"})
    return pairs


def complete_pairs(model_pairs: Sequence[dict[str, str]], passage: str) -> list[dict[str, str]]:
    pairs = list(model_pairs)
    for p in fallback_pairs(passage):
        if len(pairs) >= QA_PAIRS:
            break
        if all(p["question"] != q["question"] for q in pairs):
            pairs.append(p)
    return pairs


def clean_rewrite(text: str) -> str | None:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text.split()) >= MIN_REWRITE_WORDS else None


def _prompt_ids(tok: Any, text: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return list(tok(chat, add_special_tokens=False)["input_ids"])
    return list(tok(text + "\n", add_special_tokens=True)["input_ids"])


@contextlib.contextmanager
def forward_steps(module: Any, on_step: Callable[[], None] | None) -> Iterator[None]:
    """Call ``on_step()`` after every forward of ``module`` inside the block (each token of a ``generate``, each
    training step): progress inside a batch. A counting hook only; it changes nothing."""
    if on_step is None:
        yield
        return
    handle = module.register_forward_hook(lambda *_: on_step())
    try:
        yield
    finally:
        handle.remove()


def augment_batch(model: Any, tok: Any, items: Sequence[tuple[str, str]], max_new_tokens: int = 128,
                  max_passage_words: int = 150, on_step: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """``[(pid, passage text)]`` -> one augmentation row per passage: ``{"id": pid, "passage", "rewrite",
    "qa_pairs", "qa_parsed", "raw"}``; every prompt of the batch in one left-padded ``generate`` (on a device
    out-of-memory error, in halves: :func:`fcprag_tools.lm.oom.halving`). ``on_step``: called after each generated
    token of a ``generate`` (:func:`forward_steps`)."""
    from ..lm.batched import batched_greedy
    from ..lm.oom import halving

    texts = [" ".join(t.split()[:max_passage_words]) for _, t in items]
    rewrite = [_prompt_ids(tok, REWRITE_PROMPT.format(passage=t)) for t in texts]
    qa = [_prompt_ids(tok, QA_PROMPT.format(passage=t)) for t in texts]

    def generate(batch: list[int]) -> list[tuple[str, str]]:
        with forward_steps(model, on_step):
            gen = batched_greedy(model, tok, [rewrite[j] for j in batch] + [qa[j] for j in batch], max_new_tokens)
        return list(zip(gen[:len(batch)], gen[len(batch):]))  # (rewrite, QA) per passage

    raw: dict[int, tuple[str, str]] = {}
    for batch, outs in halving(list(range(len(items))), max(1, len(items)), generate, what="augmentation"):
        raw.update(zip(batch, outs))
    out = []
    for j, (pid, text) in enumerate(items):
        rewrite_raw, qa_raw = raw[j]
        model_pairs = parse_qa(qa_raw)
        out.append({"id": pid, "passage": text, "rewrite": clean_rewrite(rewrite_raw),
                    "qa_pairs": complete_pairs(model_pairs, text), "qa_parsed": len(model_pairs),
                    "raw": {"rewrite": rewrite_raw, "qa": qa_raw}})
    return out
