"""Score many questions' weightings in one mixed forward (the study's one scoring path for labels and evaluation).

A *job* is one question asked one way: its prompt (``param``: question only; ``combine``: passages too), its
gold answer(s), its distinct adapters ``pids [K]`` and named weight rows ``{name: [K]}`` (``w~`` per adapter,
PRAG's ``cat`` sum). Many jobs run together: their adapters' union goes into one
:class:`~fcprag_plugin.fast.FusedSlot` and every row gets its own mixture (``fcprag_plugin.fast.fused_mixed``,
block-diagonal weights, so a row only ever sees its own question's adapters). Prompts are left-padded with an
attention mask and explicit position ids, so a row's result does not depend on its batch neighbours beyond
float rounding (``benchmarks/efficacy/tests/test_batch_scorer.py`` checks it against
:class:`fusion_eval.FusionScorer`).

Per row: the gold answer's mean token log-likelihood under teacher forcing (max over gold aliases, as the
label builder does), and optionally the greedy answer (``max_new_tokens``) with F1 / EM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from fcprag_plugin.fast import fused_mixed
from fcprag_plugin.labels.metrics import exact_match, extract_answer, f1_score
from fcprag_plugin.labels.prompts import answer_ids, render_prompt
from fusion_eval import TEMPLATE


@dataclass
class Job:
    key: str
    question: str
    answers: list[str]
    passages: list[str]
    mode: str
    pids: list[str]
    rows: dict[str, list[float]]
    generate: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    gold: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        return cls(d["key"], d["question"], list(d["answers"]), list(d.get("passages") or []), d["mode"],
                   list(d["pids"]), {k: list(v) for k, v in d["rows"].items()}, bool(d.get("generate", False)))

    def encode(self, tok: Any) -> "Job":
        prompt = render_prompt(tok, TEMPLATE, self.question, self.passages if self.mode == "combine" else None,
                               self.mode)
        self.prompt_ids = list(prompt.ids)
        self.gold = [answer_ids(tok, prompt, a) for a in self.answers]
        return self

    def cost(self) -> int:
        """Tokens this job puts through the model (rows x aliases x length)."""
        return len(self.rows) * sum(len(self.prompt_ids) + len(g) for g in self.gold)


def _left_pad(seqs: Sequence[Sequence[int]], pad: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(list(s))
        mask[i, width - len(s):] = 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def batches(jobs: Sequence[Job], max_tokens: int, max_adapters: int) -> Iterable[list[Job]]:
    """Greedy packing of encoded jobs (in the given order) under a token and an adapter budget."""
    cur: list[Job] = []
    tokens, pids = 0, set()
    for j in jobs:
        new = pids | set(j.pids)
        if cur and (tokens + j.cost() > max_tokens or len(new) > max_adapters):
            yield cur
            cur, tokens, new = [], 0, set(j.pids)
        cur.append(j)
        tokens += j.cost()
        pids = new
    if cur:
        yield cur


class BatchScorer:
    def __init__(self, model: Any, tok: Any, slot: Any, adapters: dict[str, Any], max_new_tokens: int = 16,
                 logit_chunk: int = 4096) -> None:
        self.model, self.tok, self.slot, self.adapters = model, tok, slot, adapters
        self.max_new_tokens, self.logit_chunk = max_new_tokens, logit_chunk
        self.device = next(model.parameters()).device
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.stops = {s for s in stops if isinstance(s, int) and s >= 0}

    def _union(self, jobs: Sequence[Job]) -> tuple[list[str], list[tuple[int, str, torch.Tensor]]]:
        order: list[str] = list(dict.fromkeys(p for j in jobs for p in j.pids))
        col = {p: i for i, p in enumerate(order)}
        rows = []
        for ji, j in enumerate(jobs):
            for name, w in j.rows.items():
                full = torch.zeros(len(order))
                for p, x in zip(j.pids, w):
                    full[col[p]] += float(x)
                rows.append((ji, name, full))
        return order, rows

    @torch.no_grad()
    def score(self, jobs: Sequence[Job]) -> list[dict[str, Any]]:
        """One result dict per (job, row): ``{"key", "name", "logprob"[, "prediction", "f1", "em"]}``."""
        order, rows = self._union(jobs)
        ads = [self.adapters[p] for p in order]
        dec, head = self.model.get_decoder(), self.model.get_output_embeddings()
        # teacher forcing: one sequence per (row, gold alias)
        seqs, Wg, owner, glen = [], [], [], []
        for r, (ji, _, w) in enumerate(rows):
            for g in jobs[ji].gold:
                seqs.append(jobs[ji].prompt_ids + g)
                Wg.append(w)
                owner.append(r)
                glen.append(len(g))
        ids, mask, pos = _left_pad(seqs, self.pad, self.device)
        W = torch.stack(Wg)
        with fused_mixed(self.slot, ads, W, mode="cat", mask=torch.ones_like(W, dtype=torch.bool)):
            hidden = dec(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        L = ids.shape[1]
        sel_rows, sel_pos, tgt = [], [], []
        for s, gl in enumerate(glen):  # positions L-gl-1 .. L-2 predict the gold tokens L-gl .. L-1
            sel_rows += [s] * gl
            sel_pos += list(range(L - gl - 1, L - 1))
            tgt += seqs[s][-gl:]
        sel_rows_t = torch.tensor(sel_rows, device=self.device)
        h = hidden[sel_rows_t, torch.tensor(sel_pos, device=self.device)]
        tgt_t = torch.tensor(tgt, device=self.device)
        lp = torch.empty(len(tgt), device=self.device)
        for c in range(0, len(tgt), self.logit_chunk):
            lg = head(h[c:c + self.logit_chunk]).float()
            lp[c:c + self.logit_chunk] = torch.log_softmax(lg, -1).gather(1, tgt_t[c:c + self.logit_chunk, None])[:, 0]
        del hidden, h
        per_seq = torch.zeros(len(seqs), device=self.device).index_add_(0, sel_rows_t, lp).cpu()
        best = torch.full((len(rows),), -float("inf"))
        for s, r in enumerate(owner):
            best[r] = max(best[r], per_seq[s] / glen[s])
        preds: list[str | None] = [None] * len(rows)
        gen_rows = [r for r, (ji, _, _) in enumerate(rows) if jobs[ji].generate]
        if gen_rows:
            texts = self._generate([jobs[rows[r][0]].prompt_ids for r in gen_rows],
                                   torch.stack([rows[r][2] for r in gen_rows]), ads)
            for r, t in zip(gen_rows, texts):
                preds[r] = t
        out = []
        for r, (ji, name, _) in enumerate(rows):
            res: dict[str, Any] = {"key": jobs[ji].key, "name": name, "logprob": round(float(best[r]), 5)}
            if preds[r] is not None:
                pred = extract_answer(preds[r], False)
                res.update(prediction=pred, f1=round(f1_score(pred, jobs[ji].answers), 5),
                           em=exact_match(pred, jobs[ji].answers))
            out.append(res)
        return out

    def _generate(self, prompts: list[list[int]], W: torch.Tensor, ads: list[Any]) -> list[str]:
        from transformers import DynamicCache

        dec, head = self.model.get_decoder(), self.model.get_output_embeddings()
        ids, mask, pos = _left_pad(prompts, self.pad, self.device)
        R = ids.shape[0]
        tokens: list[list[int]] = [[] for _ in range(R)]
        done = [False] * R
        with fused_mixed(self.slot, ads, W, mode="cat", mask=torch.ones_like(W, dtype=torch.bool)):
            cache = DynamicCache()
            o = dec(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            nxt = head(o.last_hidden_state[:, -1]).float().argmax(-1)
            last_pos = pos[:, -1]
            for step in range(self.max_new_tokens):
                nl = nxt.tolist()
                for r in range(R):
                    if not done[r]:
                        if nl[r] in self.stops:
                            done[r] = True
                        else:
                            tokens[r].append(nl[r])
                if all(done) or step == self.max_new_tokens - 1:
                    break
                mask = torch.cat([mask, torch.ones((R, 1), dtype=mask.dtype, device=self.device)], 1)
                last_pos = last_pos + 1
                o = dec(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                        past_key_values=o.past_key_values, use_cache=True)
                nxt = head(o.last_hidden_state[:, -1]).float().argmax(-1)
        return [self.tok.decode(t, skip_special_tokens=True) for t in tokens]
