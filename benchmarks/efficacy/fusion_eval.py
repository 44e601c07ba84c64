"""Scoring fused adapters on one prompt: many weightings of the same passages in one mixed batch.

Every row of a batch is the same prompt with its own merge weights ``w~`` over the question's adapters
(``FusedSlot.mixed``: one slot, per-sample mixtures, PRAG's exact ``cat`` sum). One prefill
pass serves both the gold-answer log-likelihood (teacher forcing on a copy of the KV cache) and greedy
decoding, so each row costs what the label builder's two passes cost, and all rows of a question run together.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from fcprag_plugin import LoraAdapter
from fcprag_plugin.slot import FusedSlot
from fcprag_tools.label_builder.metrics import exact_match, extract_answer, f1_score
from fcprag_tools.label_builder.prompts import PromptTemplate, answer_ids, render_prompt

TEMPLATE = PromptTemplate()  # the label builder's default prompt, so labels and evaluation ask the same way


@dataclass
class RowResult:
    logprob: float
    prediction: str
    f1: float
    em: float


class AdapterCache:
    def __init__(self, root: Any) -> None:
        self.root, self._cache = root, {}

    def get(self, pid: str) -> LoraAdapter:
        if pid not in self._cache:
            self._cache[pid] = LoraAdapter.from_pretrained(self.root / pid)
        return self._cache[pid]


class FusionScorer:
    """Score ``[R, n]`` merge-weight rows for one question's passages (see the module docstring)."""

    def __init__(self, model: Any, tok: Any, template_adapter: LoraAdapter, max_adapters: int = 4,
                 max_new_tokens: int = 16) -> None:
        self.model, self.tok, self.max_new_tokens = model, tok, max_new_tokens
        self.slot = FusedSlot(model, template_adapter, max_adapters=max_adapters, max_rank=2)
        stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.stops = {s for s in stops if isinstance(s, int) and s >= 0}

    def prompt(self, question: str, passages: Sequence[str], prompt_mode: str) -> Any:
        return render_prompt(self.tok, TEMPLATE, question, passages if prompt_mode == "combine" else None,
                             prompt_mode)

    @torch.no_grad()
    def score(self, question: str, passages: Sequence[str], answers: Sequence[str], prompt_mode: str,
              adapters: Sequence[LoraAdapter], weights: torch.Tensor, *, generate: bool = True) -> list[RowResult]:
        """``weights [R, K]`` over the (distinct) ``adapters`` -> one :class:`RowResult` per row."""
        prompt = self.prompt(question, passages, prompt_mode)
        R = weights.shape[0]
        ids = torch.tensor([prompt.ids] * R)
        gold = [answer_ids(self.tok, prompt, a) for a in answers]
        with self.slot.mixed(list(adapters), weights, mode="cat", mask=torch.ones_like(weights, dtype=torch.bool)):
            out = self.model(input_ids=ids, use_cache=True)
            last = out.logits[:, -1].float()  # [R, V]: the next-token distribution after the prompt
            cache = out.past_key_values
            best = torch.full((R,), -float("inf"))
            for g in gold:  # max over gold aliases, as the label builder does
                c2 = copy.deepcopy(cache) if (generate or len(gold) > 1) else cache
                a = torch.tensor([g] * R)
                o2 = self.model(input_ids=a, past_key_values=c2, use_cache=True)
                logits = torch.cat([last[:, None], o2.logits[:, :-1].float()], 1)  # [R, T, V]
                lp = torch.log_softmax(logits, -1).gather(2, a[:, :, None])[:, :, 0].mean(1)
                best = torch.maximum(best, lp)
            preds = [""] * R
            if generate:
                tokens: list[list[int]] = [[] for _ in range(R)]
                done = torch.zeros(R, dtype=torch.bool)
                nxt = last.argmax(-1)
                for step in range(self.max_new_tokens):
                    for r in range(R):
                        if not done[r]:
                            if int(nxt[r]) in self.stops:
                                done[r] = True
                            else:
                                tokens[r].append(int(nxt[r]))
                    if bool(done.all()) or step == self.max_new_tokens - 1:
                        break
                    o = self.model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
                    cache = o.past_key_values  # old transformers return a new (legacy tuple) cache each step
                    nxt = o.logits[:, -1].argmax(-1)
                preds = [self.tok.decode(t, skip_special_tokens=True) for t in tokens]
        results = []
        for r in range(R):
            pred = extract_answer(preds[r], False) if generate else ""
            results.append(RowResult(float(best[r]), pred, f1_score(pred, answers) if generate else float("nan"),
                                     exact_match(pred, answers) if generate else float("nan")))
        return results


def distinct(pids: Sequence[str], w_tilde: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """Per-passage weights ``[R, n]`` -> distinct adapters and ``[R, K]`` (a repeated passage's weights add up:
    for PRAG's ``cat`` sum that is exactly the same update)."""
    order = list(dict.fromkeys(pids))
    W = torch.zeros(w_tilde.shape[0], len(order))
    for i, pid in enumerate(pids):
        W[:, order.index(pid)] += w_tilde[:, i]
    return order, W
