"""Build the demo passage adapters in ``adapters/demo/`` for the offline SmolLM2-135M-Instruct.

What it does (deterministic; a few minutes on a 2-core CPU):

1. takes the first ``--questions`` questions of ``data/hotpotqa_sample.jsonl.gz`` (HotpotQA dev,
   distractor setting: 10 passages per question, 2 of them supporting);
2. ranks each question's 10 passages with BM25 (``bm25s``, Lucene variant, k1=1.5, b=0.75, English stop words)
   and keeps the top ``--top-k``; whether each kept passage is supporting or a distractor is recorded;
3. trains one LoRA per kept passage with PRAG's recipe (PEFT LoRA r=2, alpha=32 on gate/up/down_proj, lr 3e-4),
   with a causal-LM loss on the passage text and on QA pairs derived from that passage alone
   (:func:`derive_qa_pairs`); the question and its gold answer are never used as training targets;
4. saves each as a PEFT adapter directory (bf16) ``q{k}/passage_{i}`` and writes ``manifest.json``.

Run: ``.venv/latest/bin/python examples/build_demo_adapters.py`` (offline).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demo_common when run as a script

from demo_common import (  # noqa: E402
    DATA_FILE,
    DEMO_DIR,
    GGUF_FILE,
    MANIFEST_NAME,
    MODEL_NAME,
    MODEL_PACKAGE,
    DemoModelError,
    chat_text,
    configure_stdout,
    library_versions,
    load_model,
    read_jsonl,
)

logger = logging.getLogger("build_demo_adapters")

LORA = {"r": 2, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj", "down_proj"], "lora_dropout": 0.0}
LEARNING_RATE = 3e-4
BM25 = {"library": "bm25s", "method": "lucene", "k1": 1.5, "b": 0.75, "stopwords": "en",
        "corpus": "the question's own 10 passages"}


# ----------------------------------------------------------------------------- retrieval
def bm25_top_k(question: str, passages: list[str], k: int) -> list[tuple[int, float]]:
    """Indices and BM25 scores of the ``k`` best passages for ``question`` (ties: lower index first)."""
    try:
        import bm25s
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("building the demo needs the BM25 library bm25s: pip install bm25s") from e
    corpus_tokens = bm25s.tokenize(passages, stopwords=BM25["stopwords"], show_progress=False)
    retriever = bm25s.BM25(method=BM25["method"], k1=BM25["k1"], b=BM25["b"])
    retriever.index(corpus_tokens, show_progress=False)
    query_tokens = bm25s.tokenize([question], stopwords=BM25["stopwords"], show_progress=False)
    docs, scores = retriever.retrieve(query_tokens, k=len(passages), show_progress=False)
    ranked = sorted(((int(d), float(s)) for d, s in zip(docs[0], scores[0])), key=lambda t: (-t[1], t[0]))
    return ranked[:k]


# ----------------------------------------------------------------------------- QA pairs from a passage
_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_NO_BREAK = re.compile(r"(?:\b[A-HJ-Z]|\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Lt|Col|Gen|Gov|No|vs|Inc|Co|Ltd|U\.S))\.$")
_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})\b")
# A run of capitalized words (allowing inner "of", "the", "de", ... and digits), e.g. "Imperial German Army".
_NAME = re.compile(r"\b[A-Z][\w'\-.]*(?:\s+(?:(?:of|the|de|von|van|and|du|la)\s+)*[A-Z0-9][\w'\-.]*)*")


def split_passage(passage: str) -> tuple[str, list[str]]:
    """``"Title: text"`` (the data file's format) -> (title, sentences)."""
    title, sep, body = passage.partition(": ")
    if not sep:
        title, body = "", passage
    sentences: list[str] = []
    for piece in (s.strip() for s in _SENT_SPLIT.split(body.strip())):
        if not piece:
            continue
        # Rejoin false breaks: after an initial (not "I": "World War I.") or a short abbreviation ("M. Night",
        # "Samuel L. Jackson", "St. Louis") or inside an open parenthesis ('("88. Infanterie-Division")').
        if sentences and (_NO_BREAK.search(sentences[-1]) or sentences[-1].count("(") > sentences[-1].count(")")):
            sentences[-1] = f"{sentences[-1]} {piece}"
        else:
            sentences.append(piece)
    return title.strip(), sentences


def _blank_span(sentence: str, title: str) -> str | None:
    """The span to blank out in a cloze: the last year, else the last capitalized name that is not the sentence's
    first word, nor the title, nor inside the title. None when nothing fits."""
    years = _YEAR.findall(sentence)
    if years:
        return years[-1]
    names = [m for m in _NAME.finditer(sentence) if m.start() > 0]
    for m in reversed(names):
        span = m.group(0).rstrip(".")
        if len(span) > 2 and span.lower() not in title.lower():
            return span
    return None


def derive_qa_pairs(passage: str, max_pairs: int = 3, max_words: int = 28) -> list[dict[str, str]]:
    """Deterministic QA pairs built from the passage text alone (never from a question or its answer).

    - an overview question, "What do you know about <title>?", answered by the passage's first sentence;
    - cloze questions, "Fill in the blank about <title>: <sentence with ___>", answered by the blanked span
      (the sentence's last year, else its last capitalized name), for the following sentences in order.

    Sentences are cut to ``max_words`` words to keep the training sequences short. Every answer is a substring
    of the passage.
    """
    title, sentences = split_passage(passage)
    subject = title or "this topic"
    pairs: list[dict[str, str]] = []
    if sentences:
        first = " ".join(sentences[0].split()[:max_words])
        pairs.append({"question": f"What do you know about {subject}?", "answer": first, "kind": "overview"})
    for sent in sentences:
        if len(pairs) >= max_pairs:
            break
        sent = " ".join(sent.split()[:max_words])
        span = _blank_span(sent, title)
        if span is None:
            continue
        cut = sent.rfind(span)
        masked = sent[:cut] + "___" + sent[cut + len(span):]
        q = f"Fill in the blank about {subject}: {masked}"
        if any(p["question"] == q for p in pairs):
            continue
        pairs.append({"question": q, "answer": span, "kind": "cloze"})
    return pairs


# ----------------------------------------------------------------------------- training data
def passage_batch(tok: Any, passage: str, max_tokens: int) -> dict[str, torch.Tensor]:
    """The passage as one sequence, loss on every token (cut to ``max_tokens``)."""
    ids = tok(passage, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :max_tokens]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def qa_batch(tok: Any, pairs: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """The QA pairs as chat turns in one right-padded batch; loss on the answer tokens only."""
    seqs, labels = [], []
    for p in pairs:
        prompt_ids = tok(chat_text(tok, p["question"]), add_special_tokens=False)["input_ids"]
        full_ids = tok(chat_text(tok, p["question"], p["answer"]), add_special_tokens=False)["input_ids"]
        if full_ids[:len(prompt_ids)] != prompt_ids:  # the tokenizer merged across the boundary: keep the split
            full_ids = prompt_ids + tok(p["answer"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        seqs.append(full_ids)
        labels.append([-100] * len(prompt_ids) + full_ids[len(prompt_ids):])
    width = max(len(s) for s in seqs)
    pad = tok.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([lb + [-100] * (width - len(lb)) for lb in labels])
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


@torch.no_grad()
def lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    return float(model(**batch).loss)


def train_adapter(model: torch.nn.Module, tok: Any, passage: str, pairs: list[dict[str, str]], *, seed: int,
                  epochs: int, max_passage_tokens: int) -> tuple[Any, dict[str, Any]]:
    """One PEFT LoRA on ``model`` trained on the passage and its QA pairs; returns (LoraAdapter, stats).

    Each epoch takes two optimizer steps in a fixed order: the passage, then the batch of QA pairs.
    The base weights are frozen by PEFT and restored by ``unload()``.
    """
    from peft import LoraConfig, get_peft_model

    from fcprag_plugin import LoraAdapter
    from fcprag_plugin.compat import clear_stale_peft_config

    torch.manual_seed(seed)  # the LoRA A initialization
    batches = [passage_batch(tok, passage, max_passage_tokens), qa_batch(tok, pairs)]
    before = [lm_loss(model, b) for b in batches]
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", bias="none", **LORA))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)
    peft_model.train()
    for _ in range(epochs):
        for b in batches:
            loss = peft_model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    peft_model.eval()
    after = [lm_loss(peft_model, b) for b in batches]
    adapter = LoraAdapter.from_peft_model(peft_model, "default")
    base = peft_model.unload()  # removes the LoRA layers; no merge, base weights untouched
    clear_stale_peft_config(base)
    stats = {
        "seed": seed,
        "steps": epochs * len(batches),
        "train_tokens": {"passage": int(batches[0]["input_ids"].numel()),
                         "qa_answer_tokens": int((batches[1]["labels"] != -100).sum())},
        "loss_before": {"passage": round(before[0], 4), "qa": round(before[1], 4)},
        "loss_after": {"passage": round(after[0], 4), "qa": round(after[1], 4)},
    }
    return adapter, stats


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DATA_FILE), help="HotpotQA questions (JSON Lines, gzipped when named .gz)")
    p.add_argument("--out", default=str(DEMO_DIR), help="output folder (replaced: q*/ and manifest.json)")
    p.add_argument("--questions", type=int, default=3, help="how many questions, from the top of the file")
    p.add_argument("--top-k", type=int, default=3, help="passages (adapters) per question")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-passage-tokens", type=int, default=256)
    p.add_argument("--qa-pairs", type=int, default=3, help="QA pairs derived per passage (at most)")
    p.add_argument("--seed", type=int, default=1234, help="adapter seed = seed + 10*question + passage")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    configure_stdout()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.use_deterministic_algorithms(True, warn_only=True)
    rows = read_jsonl(args.data)[: args.questions]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("q*"):  # a rebuild replaces the adapters, nothing else in the folder
        if old.is_dir():
            shutil.rmtree(old)

    t0 = time.perf_counter()
    try:
        model, tok = load_model()
    except DemoModelError as e:
        raise SystemExit(str(e)) from e
    for p in model.parameters():
        p.requires_grad_(False)
    logger.info("loaded %s (%s) in %.1fs", MODEL_NAME, GGUF_FILE, time.perf_counter() - t0)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}

    plan = []
    for k, row in enumerate(rows):
        ranked = bm25_top_k(row["question"], row["passages"], args.top_k)
        plan.append((k, row, ranked))
    questions = []
    bar = tqdm(total=sum(len(r) for _, _, r in plan), desc="training adapters", unit="adapter")
    for k, row, ranked in plan:
        entries = []
        for i, (idx, score) in enumerate(ranked):
            text, title = row["passages"][idx], row["titles"][idx]
            pairs = derive_qa_pairs(text, max_pairs=args.qa_pairs)
            seed = args.seed + 10 * k + i
            t1 = time.perf_counter()
            adapter, stats = train_adapter(model, tok, text, pairs, seed=seed, epochs=args.epochs,
                                           max_passage_tokens=args.max_passage_tokens)
            stats["wall_seconds"] = round(time.perf_counter() - t1, 1)
            rel = f"q{k}/passage_{i}"
            adapter.config["base_model_name_or_path"] = MODEL_NAME
            adapter.save_pretrained(out / rel, dtype=torch.bfloat16)
            entries.append({"rank": i, "source_index": idx, "title": title, "text": text,
                            "supporting": title in row["supporting_titles"], "bm25_score": round(score, 4),
                            "adapter": rel, "qa_pairs": pairs, "training": stats})
            bar.set_postfix_str(f"{rel} loss {stats['loss_before']['passage']:.2f}->{stats['loss_after']['passage']:.2f}")
            bar.update(1)
        questions.append({"id": row["id"], "question": row["question"], "gold_answer": row["answer"],
                          "type": row.get("type"), "supporting_titles": row["supporting_titles"],
                          "passages": entries})
    bar.close()
    # A safety net for the recipe: training must never have written the base weights.
    changed = [n for n, v in model.state_dict().items() if not torch.equal(v, snapshot[n])]
    if changed:
        raise SystemExit(f"base model weights changed during training: {changed[:3]}")

    manifest = {
        "description": "Demo passage adapters for fcprag-plugin: one LoRA per retrieved passage (PRAG recipe).",
        "model": {"name": MODEL_NAME, "package": MODEL_PACKAGE.replace("_", "-"), "gguf_file": GGUF_FILE,
                  "weights": "GGUF Q4_1 dequantized to float32 by transformers"},
        "data": {"file": "data/hotpotqa_sample.jsonl.gz",
                 "selection": f"the first {len(rows)} questions of the file"},
        "retrieval": dict(BM25, top_k=args.top_k),
        "training": {
            "recipe": "PRAG: one LoRA per passage, causal-LM loss on the passage and on QA pairs derived from it",
            "lora": LORA, "learning_rate": LEARNING_RATE, "optimizer": "AdamW (weight_decay 0)",
            "epochs": args.epochs, "steps_per_epoch": "2 (the passage, then the batch of its QA pairs)",
            "max_passage_tokens": args.max_passage_tokens, "qa_pairs_per_passage": args.qa_pairs,
            "qa_derivation": "examples/build_demo_adapters.py:derive_qa_pairs (overview + cloze, from the passage "
                             "only; the question and gold answer are never training targets)",
            "qa_loss": "answer tokens only, chat template with demo_common.SYSTEM_PROMPT / USER_TEMPLATE",
            "base_seed": args.seed, "seed_rule": "seed + 10*question_index + passage_rank",
            "saved_dtype": "bfloat16", "device": "cpu", "torch_threads": torch.get_num_threads(),
            "build_seconds": round(time.perf_counter() - t0, 1),
        },
        "versions": library_versions(),
        "questions": questions,
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    logger.info("wrote %d adapters + %s to %s (%.2f MB) in %.0fs", sum(len(q["passages"]) for q in questions),
                MANIFEST_NAME, out, size / 1e6, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
