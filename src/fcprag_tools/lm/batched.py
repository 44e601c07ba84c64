"""Batched scoring: many rows in one forward / one ``generate``, each row under its own adapter mixture.

Rows are left-padded with explicit ``position_ids`` (each row's real tokens at positions ``0 .. n-1``, as when it
runs alone), so every row's logits equal its unbatched logits up to float rounding.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence

import torch

from fcprag_plugin.compat import kv_cache_argument_name, logits_to_keep_argument
from fcprag_plugin.errors import FcpragError, MergeError
from .mixed import adapter_key
from .metrics import model_device
from .oom import halving
from ..progress import progress_bar


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
    """Mean log-probability of each row's answer tokens ``[T_b]`` after its prompt ``[P_b]`` (both non-empty), in
    one forward: :func:`~fcprag_plugin.labels.metrics.answer_logprob` batched. Only the last ``T_max + 1`` positions
    go through the output projection when the model accepts ``logits_to_keep``."""
    if any(not p or not a for p, a in rows):
        raise ValueError("batched_answer_logprobs needs a non-empty prompt and answer in every row")
    ids, mask, pos = left_pad([list(p) + list(a) for p, a in rows], pad_id, model_device(model))
    t_max = max(len(a) for _, a in rows)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    keep = logits_to_keep_argument(model)
    if keep is not None:
        kwargs[keep] = t_max + 1
    logits = model(**kwargs).logits[:, -(t_max + 1):-1]  # [B, T_max, V]: position j predicts token j + 1
    logp = torch.log_softmax(logits.float(), dim=-1)
    tok = logp.gather(2, ids[:, -t_max:].unsqueeze(-1)).squeeze(-1)  # [B, T_max]
    return [float(tok[b, t_max - len(a):].mean()) for b, (_, a) in enumerate(rows)]


def eos_ids(model: Any) -> set[int]:
    """The token ids ``generate`` stops at: the generation config's EOS (none without one)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


@torch.no_grad()
def batched_greedy(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   stop_ids: Iterable[int] | None = None) -> list[str]:
    """Greedy continuation of each prompt (left-padded, one ``generate``), decoded without special tokens; a row's
    text runs through its first ``stop_ids`` token (default :func:`eos_ids`, where a one-row ``generate`` stops)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = pad if pad is not None else 0
    ids, mask, _ = left_pad(prompts, pad, model_device(model))
    stops = eos_ids(model) if stop_ids is None else {int(t) for t in stop_ids}
    extra: dict[str, Any] = {} if stop_ids is None else {"eos_token_id": sorted(stops) or None}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         num_beams=1, pad_token_id=pad, **extra)
    texts = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))  # through the first EOS, like 1 row
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return texts


# ----------------------------------------------------------------------------- one read of each prompt
def _forward(model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any,
             keep: int | None = None) -> torch.Tensor:
    """Logits ``[B, T or keep, V]`` of ``ids [B, T]`` after ``cache`` (extended in place); ``mask`` covers the
    cache and ``ids``."""
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                              kv_cache_argument_name(model): cache, "use_cache": True}
    name = logits_to_keep_argument(model) if keep is not None else None
    if name is not None:
        kwargs[name] = keep
    return model(**kwargs).logits


def _gold_logprobs(model: Any, cache: Any, mask: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor,
                   golds: Sequence[Sequence[Sequence[int]]], pad_id: int) -> list[list[float]]:
    """Each row's mean gold log-probability per alias, read after the prompt's ``cache``: one forward per alias
    index (row ``b``'s ``a``-th alias, right-padded), the cache cropped back to the prompt after each.
    ``first [B, V]``: the log-probabilities after the prompt's last token, which predict each alias's first."""
    out: list[list[float]] = [[] for _ in golds]
    dev = mask.device
    for a in range(max(len(g) for g in golds)):
        seqs = [list(g[a]) if a < len(g) else [] for g in golds]
        T = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), T), int(pad_id), dtype=torch.long)
        m = torch.zeros((len(seqs), T), dtype=mask.dtype)
        for b, x in enumerate(seqs):
            ids[b, :len(x)], m[b, :len(x)] = torch.as_tensor(x, dtype=torch.long), 1
        ids, m = ids.to(dev), m.to(dev)
        pos = lengths.unsqueeze(1) + torch.arange(T, device=dev)
        logits = _forward(model, ids, torch.cat([mask, m], 1), pos, cache)  # position t predicts token t + 1
        cache.crop(-T)  # back to the prompt (a negative length: "remove T", on every transformers version)
        rest = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        tok = torch.cat([first.gather(1, ids[:, :1]), rest], 1)  # [B, T]
        for b, x in enumerate(seqs):
            if x:
                out[b].append(float(tok[b, :len(x)].mean()))
    return out


class _Live:
    """The sequences still being generated: their batch rows, mask ``[B, L]``, next positions ``[B]``, the next
    token ``[B]``, the cache, and the mixture context they run under (entered again whenever rows leave)."""

    def __init__(self, cache: Any, mask: torch.Tensor, lengths: torch.Tensor, nxt: torch.Tensor,
                 context: Callable[[Sequence[int]], ContextManager[Any]], stack: contextlib.ExitStack) -> None:
        self.rows, self.cache, self.mask, self.lengths, self.nxt = list(range(len(nxt))), cache, mask, lengths, nxt
        self.context, self.stack = context, stack

    def drop(self, ended: set[int]) -> None:
        """Rows ``ended`` (indices into :attr:`rows`) stop: they leave the cache, the batch and the context."""
        keep = [j for j in range(len(self.rows)) if j not in ended]
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[j] for j in keep]
        self.mask, self.lengths, self.nxt = self.mask[idx], self.lengths[idx], self.nxt[idx]
        self.stack.close()
        if self.rows:
            self.cache.batch_select_indices(idx)
            self.stack.enter_context(self.context(self.rows))

    def step(self, model: Any) -> None:
        """Feed each live row's next token; the next tokens become the greedy ones after it."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], 1)
        logits = _forward(model, self.nxt.unsqueeze(1), self.mask, self.lengths.unsqueeze(1), self.cache)
        self.lengths = self.lengths + 1
        self.nxt = logits[:, -1].argmax(-1)


def _decode(model: Any, tokenizer: Any, live: _Live, max_new_tokens: int, stops: set[int],
            until_cut: bool) -> list[str]:
    """Greedy tokens of every row until its first ``stops`` token (kept), ``max_new_tokens``, or, with
    ``until_cut``, the first token whose decoded continuation reaches the short answer's cut
    (:func:`~fcprag_tools.lm.metrics.reaches_cut`); decoded without special tokens."""
    from .metrics import reaches_cut

    toks: list[list[int]] = [[] for _ in live.rows]
    while live.rows:
        ended = set()
        for j, (b, t) in enumerate(zip(live.rows, live.nxt.tolist())):
            toks[b].append(int(t))
            if (t in stops or len(toks[b]) >= max_new_tokens
                    or (until_cut and reaches_cut(tokenizer.decode(toks[b], skip_special_tokens=True)))):
                ended.add(j)
        if ended:
            live.drop(ended)
        if live.rows:
            live.step(model)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in toks]


@torch.no_grad()
def read_prompts(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]],
                 golds: Sequence[Sequence[Sequence[int]]] | None = None, *, max_new_tokens: int = 0,
                 stop_ids: Iterable[int] | None = None, until_cut: bool = False,
                 context: Callable[[Sequence[int]], ContextManager[Any]] | None = None
                 ) -> tuple[list[list[float]] | None, list[str] | None]:
    """Each prompt ``[P_b]`` read once (left-padded, one forward, its KV cache kept) for both: each gold alias's
    mean log-probability after it (``golds[b]``: row ``b``'s aliases, :func:`batched_answer_logprobs`'
    numbers up to float rounding) and, with ``max_new_tokens > 0``, its greedy continuation (:func:`batched_greedy`'
    text, through its first ``stop_ids`` token, default :func:`eos_ids`). ``until_cut``: a row also ends at the
    first token whose decoded continuation reaches the short answer's cut, so its short answer
    (:func:`~fcprag_tools.lm.metrics.extract_answer`, no chain-of-thought) equals that of its full-length
    continuation; the batch ends when every row has ended, and ended rows leave the batch.

    ``context(batch rows)``: the context each forward runs under for those rows (their adapters), entered again
    with the remaining rows when rows end. Returns ``(alias log-probabilities or None, texts or None)``."""
    from transformers import DynamicCache

    if golds is not None and (len(golds) != len(prompts) or any(not g or not all(len(x) for x in g) for g in golds)):
        raise FcpragError("read_prompts needs at least one non-empty gold alias for every prompt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask, pos = left_pad(prompts, pad, model_device(model))
    lengths = mask.sum(1)
    stops = eos_ids(model) if stop_ids is None else {int(t) for t in stop_ids}
    context = context or (lambda rows: contextlib.nullcontext())
    with contextlib.ExitStack() as stack:  # holds the live rows' context (closed and entered again as rows end)
        stack.enter_context(context(list(range(len(prompts)))))
        cache = DynamicCache()
        last = _forward(model, ids, mask, pos, cache, keep=1)[:, -1]  # [B, V]
        lps = None
        if golds is not None:
            lps = _gold_logprobs(model, cache, mask, lengths, torch.log_softmax(last.float(), -1), golds, pad)
        if max_new_tokens <= 0:
            return lps, None
        live = _Live(cache, mask, lengths, last.argmax(-1), context, stack)
        return lps, _decode(model, tokenizer, live, max_new_tokens, stops, until_cut)


# ----------------------------------------------------------------------------- the public scorer
@dataclass
class ScoreRow:
    """One thing to score: ``prompt_ids [P]`` and its non-empty gold aliases ``gold_ids`` under this row's
    ``adapters`` (packed, ``LoraAdapter`` s or directories; empty: the base model) with ``weights`` ``w~`` (default
    1.0 each: PRAG's sum); ``gen_prompt_ids``: also greedy-generate from this prompt.
    """

    prompt_ids: Sequence[int]
    gold_ids: Sequence[Sequence[int]]
    adapters: Sequence[Any] = ()
    weights: Sequence[float] | None = None
    gen_prompt_ids: Sequence[int] | None = None


@dataclass
class RowScore:
    """``logprob``: the best alias's mean gold log-probability; ``alias_logprobs``: per alias (``gold_ids`` order);
    ``generation``: the raw greedy text (``None`` without ``gen_prompt_ids``)."""

    logprob: float
    alias_logprobs: list[float]
    generation: str | None = None


def _check_rows(rows: Sequence[ScoreRow], batch_size: int, max_tokens: int | None) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise FcpragError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if max_tokens is not None and max_tokens < 1:
        raise FcpragError(f"max_tokens must be >= 1, got {max_tokens!r}")
    for i, r in enumerate(rows):
        if not len(r.prompt_ids) or not len(r.gold_ids) or any(not len(g) for g in r.gold_ids):
            raise FcpragError(f"score row {i}: needs a non-empty prompt and at least one non-empty gold alias")
        if r.weights is not None and len(r.weights) != len(r.adapters):
            raise MergeError(f"score row {i}: {len(r.adapters)} adapters but {len(r.weights)} weights")
        if r.gen_prompt_ids is not None and not len(r.gen_prompt_ids):
            raise FcpragError(f"score row {i}: empty generation prompt")


def _pack(rows: Sequence[ScoreRow], order: Sequence[int], cost: Any, batch_size: int, max_tokens: int | None,
          max_adapters: int) -> Iterator[list[int]]:
    """Consecutive rows (indices) per forward: <= ``batch_size`` sequences, <= ``max_tokens`` padded tokens,
    <= ``max_adapters`` distinct adapters; a row is never split (a row too big alone gets a forward alone)."""
    cur: list[int] = []
    n_seq = width = 0
    keys: set = set()
    for i in order:
        seqs, length = cost(rows[i])
        row_keys = {adapter_key(a) for a in rows[i].adapters}
        fits = (n_seq + seqs <= batch_size and len(keys | row_keys) <= max_adapters
                and (max_tokens is None or (n_seq + seqs) * max(width, length) <= max_tokens))
        if cur and not fits:
            yield cur
            cur, n_seq, width, keys = [], 0, 0, set()
        cur.append(i)
        n_seq, width, keys = n_seq + seqs, max(width, length), keys | row_keys
    if cur:
        yield cur


def _costs(max_new_tokens: int) -> tuple[Callable[[ScoreRow], tuple[int, int]], ...]:
    """A row's ``(sequences, tokens per sequence)`` in a teacher-forced forward (one per alias), a generation, and
    one read of its prompt for both (:func:`read_prompts`)."""
    return (lambda r: (len(r.gold_ids), len(r.prompt_ids) + max(len(g) for g in r.gold_ids)),
            lambda r: (1, len(r.gen_prompt_ids) + max_new_tokens),
            lambda r: (1, len(r.prompt_ids) + max(max_new_tokens, *map(len, r.gold_ids))))


@contextlib.contextmanager
def _mixture(slot: Any, rows: Sequence[ScoreRow], seq_rows: Sequence[int], mode: str) -> Iterator[None]:
    """Per-sequence mixtures for one forward: sequence ``s`` runs under row ``seq_rows[s]``'s adapters and weights."""
    from .mixed import union_weights

    used = [s for s, r in enumerate(seq_rows) if len(rows[r].adapters)]
    if not used:  # base model for every sequence of this forward
        yield
        return
    if slot is None:
        raise FcpragError("score_rows: rows with adapters need a FusedSlot (slot=None only scores the base model)")
    mixed = [rows[seq_rows[s]] for s in used]
    union, Wu, Mu = union_weights([r.adapters for r in mixed],
                                  [r.weights if r.weights is not None else [1.0] * len(r.adapters) for r in mixed])
    W = torch.zeros(len(seq_rows), len(union))
    M = torch.zeros(len(seq_rows), len(union), dtype=torch.bool)
    W[used], M[used] = Wu, Mu
    if mode == "separate":  # a base-model row uses no adapter; give it a weight-0 mask entry so N_b > 0
        M[sorted(set(range(len(seq_rows))) - set(used)), 0] = True
    with slot.mixed(union, W, mode, mask=M):
        yield


@torch.no_grad()
def score_rows(model: Any, tokenizer: Any, slot: Any, rows: Sequence[ScoreRow], *, mode: str = "cat",
               batch_size: int = 16, max_tokens: int | None = None, max_new_tokens: int = 32,
               stop_ids: Iterable[int] | None = None, progress: bool = False,
               mixture: Callable[[Sequence[Sequence[Any]]], ContextManager[Any]] | None = None,
               on_progress: Callable[[float], None] | None = None, until_cut: bool = False,
               share_prompt: bool = True) -> list[RowScore]:
    """Score ``rows`` in batched forwards, each row under its own adapter mixture; one :class:`RowScore` per row.

    Rows are packed in order into forwards of at most ``batch_size`` sequences (teacher forcing: one per gold
    alias; generation, or both from one read: one per row), ``max_tokens`` padded tokens (``B x L_max``, optional)
    and ``slot.max_adapters`` distinct adapters; a row is never split. Per forward the union of its rows' adapters
    is written once into ``slot`` (:meth:`FusedSlot.mixed` in ``mode``), so a row only ever sees its own adapters;
    ``slot`` may be None when no row has adapters, and is inactive again on return.

    ``mixture``: another way to put each sequence under its row's adapters: ``mixture(per-sequence adapter lists)``
    is the context of one forward (e.g. :func:`fcprag_tools.lm.arrow.arrow_routing`); ``slot`` and ``weights`` are
    then unused and a forward's adapters are not limited. A forward that runs out of device memory is run again in
    halves (:func:`fcprag_tools.lm.oom.halving`, one log line), down to one row. ``on_progress(share)``: after
    every forward, the share of this call's work it did (the shares sum to 1). ``share_prompt``: a row whose
    generation prompt is its prompt is read once for its aliases and its answer (:func:`read_prompts`);
    ``until_cut``: greedy answers end at the short answer's cut (:func:`read_prompts`)."""
    _check_rows(rows, batch_size, max_tokens)
    k_max = (slot.max_adapters if slot is not None else 0) if mixture is None else sys.maxsize
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    has_gen = [r.gen_prompt_ids is not None for r in rows]
    shared = [i for i, r in enumerate(rows)
              if share_prompt and has_gen[i] and list(r.gen_prompt_ids) == list(r.prompt_ids)]
    tf_order = sorted(set(range(len(rows))) - set(shared))
    gen_order = [i for i in tf_order if has_gen[i]]
    tf_cost, gen_cost, both_cost = _costs(max_new_tokens)
    greedy = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids, until_cut=until_cut)

    def context(seq_rows: Sequence[int]) -> ContextManager[Any]:
        if mixture is None:
            return _mixture(slot, rows, seq_rows, mode)
        return mixture([rows[i].adapters for i in seq_rows])

    def take(cost: Any) -> Callable[[Sequence[int], int], int]:
        return lambda rest, size: len(next(_pack(rows, rest, cost, size, max_tokens, k_max)))

    def teacher_forced(chunk: list[int]) -> list[tuple[int, float]]:
        seq_rows = [i for i in chunk for _ in rows[i].gold_ids]
        with context(seq_rows):
            vals = batched_answer_logprobs(model, [(rows[i].prompt_ids, g) for i in chunk for g in rows[i].gold_ids],
                                           pad)
        return list(zip(seq_rows, vals))

    def read(chunk: list[int], gold: bool) -> tuple[list[list[float]] | None, list[str] | None]:
        # gold: the prompts, read once for the aliases and the answer; else the generation prompts, for the answer
        return read_prompts(model, tokenizer, [rows[i].prompt_ids if gold else rows[i].gen_prompt_ids for i in chunk],
                            [rows[i].gold_ids for i in chunk] if gold else None,
                            context=lambda live: context([chunk[j] for j in live]), **greedy)

    alias_lps: list[list[float]] = [[] for _ in rows]
    gens: list[str | None] = [None] * len(rows)
    units = len(rows) + sum(has_gen)  # a row's teacher-forced pass, and its generation

    def moved(bar: Any, n: int) -> None:
        bar.update(n)
        if on_progress is not None:
            on_progress(n / units)

    with progress_bar("scoring", units, unit="row", enabled=progress) as bar:
        for chunk, (lps, texts) in halving(shared, batch_size, lambda c: read(c, True), what="scoring forwards",
                                           take=take(both_cost)):
            for i, lp, t in zip(chunk, lps, texts):
                alias_lps[i], gens[i] = lp, t
            moved(bar, 2 * len(chunk))
        for chunk, vals in halving(tf_order, batch_size, teacher_forced, what="scoring forwards",
                                   take=take(tf_cost), measure=lambda c: sum(len(rows[i].gold_ids) for i in c)):
            for i, v in vals:
                alias_lps[i].append(v)
            moved(bar, len(chunk))
        for chunk, (_, texts) in halving(gen_order, batch_size, lambda c: read(c, False), what="scoring generation",
                                         take=take(gen_cost)):
            for i, t in zip(chunk, texts):
                gens[i] = t
            moved(bar, len(chunk))
    return [RowScore(max(lps), lps, g) for lps, g in zip(alias_lps, gens)]
