"""Passage embeddings as DyPRAG reads them, and the passages' generated updates with their cost.

DyPRAG embeds a passage by running the base model on the passage alone, tokenized by the tokenizer's own call
(``tokenizer(passage, truncation=True, max_length=3000)``: its special tokens, e.g. Llama-3's BOS, and no chat
template) and taking the last layer's hidden state after the final norm at the last token
(``hidden_states[-1][:, -1]``). Here many passages run in one forward, left-padded with explicit position ids, so
each passage's embedding equals its own one-passage forward up to float rounding. The model must run without any
update switched on (DyPRAG removes the last question's update before embedding the next question's passages).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch

from fcprag_plugin.adapter import LoraAdapter
from ..lm.batched import left_pad
from ..lm.metrics import model_device
from ..lm.oom import halving
from .network import Translator, TranslatorError, generated_adapters

MAX_TOKENS = 3000  # DyPRAG's max_length for a passage


def passage_ids(tok: Any, texts: Sequence[str], max_tokens: int = MAX_TOKENS, names: Sequence[str] | None = None
                ) -> list[list[int]]:
    """Each passage tokenized alone as DyPRAG does; a passage with no token is a one-line error naming it."""
    out = []
    for j, text in enumerate(texts):
        ids = list(tok(text, truncation=True, max_length=max_tokens)["input_ids"])
        if not ids:
            raise TranslatorError(f"passage {names[j] if names else j!r} tokenizes to no tokens; the translator "
                                  "embeds a passage at its last token")
        out.append(ids)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def embed_ids(model: Any, ids: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """``[N, H]`` float32: the final-norm hidden state at each row's last token, rows left-padded in one forward."""
    x, mask, pos = left_pad(ids, pad_id, model_device(model))
    hidden = model.get_decoder()(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False)
    return hidden.last_hidden_state[:, -1].float()


def passage_embeddings(model: Any, tok: Any, texts: Sequence[str], *, batch_size: int = 16,
                       max_tokens: int = MAX_TOKENS) -> torch.Tensor:
    """``[N, H]`` float32 on the model's device: DyPRAG's embedding of each passage (module docstring),
    ``batch_size`` passages of similar lengths per forward (halved on a device out-of-memory error)."""
    ids = passage_ids(tok, texts, max_tokens)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = torch.zeros(len(ids), model.config.hidden_size, device=model_device(model))
    for batch, h in halving(by_length(ids), batch_size, lambda b: embed_ids(model, [ids[i] for i in b], pad),
                            what="passage embeddings"):
        out[batch] = h
    return out


def by_length(ids: Sequence[Sequence[int]]) -> list[int]:
    """The rows' indices, shortest first: a batch pads to rows of about its own length."""
    return sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))


@torch.no_grad()
def generate_adapters(model: Any, tok: Any, translator: Translator, passages: Mapping[str, str], *,
                      batch_size: int = 16, max_tokens: int = MAX_TOKENS,
                      cache: dict[str, LoraAdapter] | None = None) -> tuple[dict[str, LoraAdapter], dict[str, float]]:
    """Each passage's generated update (``{pid: text}`` in; a :class:`LoraAdapter` per pid out, scaling 1,
    float32 on the CPU) and what it cost: per pid the seconds of its batch's embedding forward and translator
    call (passages of similar lengths together) divided by the batch's passages (the same split as PRAG's
    ``group_seconds / group``; on a GPU the device is synchronised before each clock read). ``cache``: updates
    kept from before (``{pid: adapter}``, filled in place); its pids are not generated again and get no seconds."""
    cache = {} if cache is None else cache
    todo = [p for p in passages if p not in cache]
    ids = passage_ids(tok, [passages[p] for p in todo], max_tokens, todo)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    device = model_device(model)
    seconds: dict[str, float] = {}

    def run(batch: list[int]) -> tuple[list[LoraAdapter], float]:
        _sync(device)
        t0 = time.perf_counter()
        h = embed_ids(model, [ids[i] for i in batch], pad).to(next(translator.parameters()).device)
        factors = translator(h)
        _sync(device)
        secs = time.perf_counter() - t0
        return generated_adapters(factors, [todo[i] for i in batch]), secs

    for batch, (ads, secs) in halving(by_length(ids), batch_size, run, what="translator generation"):
        for i, a in zip(batch, ads):
            cache[todo[i]], seconds[todo[i]] = a, secs / len(batch)
    return {p: cache[p] for p in passages}, seconds
