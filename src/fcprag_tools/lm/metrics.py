"""Label metrics: answer log-probability under teacher forcing, greedy generation, and SQuAD-style F1 / EM with
PRAG's answer extraction (the conventions: ``docs/labels-builder.md``, section 2)."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, Sequence

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_SPECIAL = {"yes", "no", "noanswer"}
ANSWER_MARKER = "the answer is"
STOPS = (".", "\n", ",")
SCORINGS = ("default", "prag")


# ----------------------------------------------------------------------------- text metrics
def normalize_answer(text: str) -> str:
    """Lower-case, remove punctuation, remove articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1_one(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred), normalize_answer(gold)
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    common = sum((Counter(pt) & Counter(gt)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pt), common / len(gt)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """Token F1 of ``prediction`` against the best of the gold ``answers`` (aliases)."""
    return max(_f1_one(prediction, a) for a in answers)


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold alias, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(a) for a in answers))


def answer_in_text(text: str, answers: Sequence[str]) -> float:
    """Answer-presence accuracy: 1.0 when some gold alias, normalised (:func:`normalize_answer`), occurs in the
    normalised ``text`` as a run of whole words, else 0.0. ``text`` is the whole generation, not the extracted
    answer, so an answer the model states after a preamble still counts. Whole words (not substrings) so that the
    gold "no" is not found in "know" or "not"; an alias that normalises to nothing never counts."""
    hay = f" {normalize_answer(text)} "
    return float(any(g and f" {g} " in hay for g in (normalize_answer(a) for a in answers)))


def extract_answer(text: str, cot: bool = False, scoring: str = "default") -> str:
    """The short answer in a generation: with chain-of-thought the text after the first "the answer is" (the whole
    text without it; ``scoring="default"`` finds it in any letter case, ``"prag"`` only in lower case, as PRAG
    does), then the stripped text up to its first '.', newline or ',' (PRAG's convention), stripped."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring '{scoring}': expected one of {list(SCORINGS)}")
    if cot:
        # a regex, not text.lower().find: lower() may change the length of non-ASCII text before the marker
        m = re.search(re.escape(ANSWER_MARKER), text, 0 if scoring == "prag" else re.IGNORECASE)
        if m:
            text = text[m.end():]
    text = text.strip()
    cuts = [i for i in (text.find(stop) for stop in STOPS) if i != -1]
    return (text[:min(cuts)] if cuts else text).strip()


def reaches_cut(text: str) -> bool:
    """Whether PRAG's short answer of ``text`` (:func:`extract_answer` without chain-of-thought) is fixed: the
    text, stripped on the left, holds '.', newline or ','. Then every continuation of ``text`` has the same short
    answer, so a greedy answer may stop there (a stop before the first non-blank character would not be: the
    scorer strips leading blanks and newlines first)."""
    rest = text.lstrip()
    return any(stop in rest for stop in STOPS)


def score_generation(generation: str, answers: Sequence[str], *, cot: bool = False,
                     scoring: str = "default") -> tuple[str, float, float]:
    """``(prediction, f1, em)`` of a raw generation against the gold aliases, under ``scoring``."""
    prediction = extract_answer(generation, cot, scoring)
    return prediction, f1_score(prediction, answers), exact_match(prediction, answers)


# ----------------------------------------------------------------------------- model scoring
@torch.no_grad()
def answer_logprob(model: Any, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> float:
    """Mean log-probability of the answer tokens ``[T]`` after the prompt ``[P]`` under teacher forcing.

    One forward pass over ``[1, P + T]``; the logits at positions ``P-1 .. P+T-2`` predict the answer tokens.
    Log-softmax in float32 so half-precision models do not lose the small differences between subsets.
    """
    if not prompt_ids or not answer_ids:
        raise ValueError("answer_logprob needs a non-empty prompt and answer")
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], dtype=torch.long, device=model_device(model))
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # [1, P+T, V]
    p, t = len(prompt_ids), len(answer_ids)
    logp = torch.log_softmax(logits[0, p - 1: p + t - 1].float(), dim=-1)  # [T, V]
    target = ids[0, p:].unsqueeze(1)  # [T, 1]
    return float(logp.gather(1, target).mean())


@torch.no_grad()
def greedy_generate(model: Any, tokenizer: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> str:
    """Greedy continuation of the prompt, decoded without special tokens."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model_device(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, num_beams=1, pad_token_id=pad if pad is not None else 0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def model_device(model: Any) -> torch.device:
    dev = getattr(model, "device", None)
    return dev if isinstance(dev, torch.device) else next(model.parameters()).device
