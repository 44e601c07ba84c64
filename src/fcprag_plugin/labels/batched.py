"""Batched scoring for the label builder: many (prompt, answer) rows or prompts in one forward / one ``generate``.

Rows are left-padded with explicit ``position_ids`` (each row's real tokens sit at positions ``0 .. n-1``, as when
it runs alone), so every row's logits equal its unbatched logits up to float rounding. The per-row adapter
mixture is the caller's business (:func:`fcprag_plugin.fast.fused_mixed` around these calls); these functions
only batch the model calls.

- :func:`batched_answer_logprobs`: the mean answer log-probability of each row (teacher forcing), the same
  quantity as :func:`~fcprag_plugin.labels.metrics.answer_logprob`. Only the last ``T_max + 1`` positions go
  through the output projection when the model accepts ``logits_to_keep`` (transformers >= 4.45).
- :func:`batched_greedy`: greedy continuations; generation stops per row at its first end-of-sequence token
  (later tokens of a finished row are dropped), as a single-row ``generate`` would stop there.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from ..errors import FcpragError

_KEEP_ARG: dict[type, str | None] = {}


def _keep_arg(model: Any) -> str | None:
    """The name of the model's "compute logits for the last k positions only" argument, if it has one."""
    cls = type(model)
    if cls not in _KEEP_ARG:
        params = inspect.signature(model.forward).parameters
        _KEEP_ARG[cls] = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
    return _KEEP_ARG[cls]


def _device(model: Any) -> torch.device:
    dev = getattr(model, "device", None)
    return dev if isinstance(dev, torch.device) else next(model.parameters()).device


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, L]`` ids, attention mask and position ids of left-padded rows (positions count real tokens only)."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise FcpragError("batched scoring needs at least one row and no empty row")
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, L - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, L - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp_(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


@torch.no_grad()
def batched_answer_logprobs(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                            pad_id: int) -> list[float]:
    """Mean log-probability of each row's answer tokens ``[T_b]`` after its prompt ``[P_b]``, one forward.

    ``rows``: ``(prompt_ids, answer_ids)`` pairs, both non-empty. Log-softmax in float32 (as the unbatched scorer).
    """
    if any(not p or not a for p, a in rows):
        raise ValueError("batched_answer_logprobs needs a non-empty prompt and answer in every row")
    ids, mask, pos = left_pad([list(p) + list(a) for p, a in rows], pad_id, _device(model))
    t_max = max(len(a) for _, a in rows)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    keep = _keep_arg(model)
    if keep is not None:
        kwargs[keep] = t_max + 1
    logits = model(**kwargs).logits[:, -(t_max + 1):-1]  # [B, T_max, V]: position j predicts token j + 1
    logp = torch.log_softmax(logits.float(), dim=-1)
    tok = logp.gather(2, ids[:, -t_max:].unsqueeze(-1)).squeeze(-1)  # [B, T_max]
    return [float(tok[b, t_max - len(a):].mean()) for b, (_, a) in enumerate(rows)]


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids ``generate`` stops at: the generation config's, else the tokenizer's EOS."""
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


@torch.no_grad()
def batched_greedy(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[str]:
    """Greedy continuation of each prompt (left-padded, one ``generate``), decoded without special tokens."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = pad if pad is not None else 0
    ids, mask, _ = left_pad(prompts, pad, _device(model))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         num_beams=1, pad_token_id=pad)
    stops = eos_ids(model, tokenizer)
    texts = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))  # through the first EOS, like 1 row
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return texts
