"""The study's one scoring entry point for labels and evaluation: named weight rows of many questions -> results.

    score_jobs(model, tok, jobs, store, batch_size=16, max_new_tokens=16) -> [{"key", "name", "logprob"[, ...]}]

A job (:class:`batch_scorer.Job`) is one question asked one way (prompt mode, gold aliases, its distinct adapters
``pids`` and named rows ``{name: w~ per pid}``). Every row becomes one scored sequence: the gold answer's mean
token log-likelihood under teacher forcing (max over aliases) with the row's adapters merged by PRAG's ``cat``
sum weighted by ``w~``, plus, for jobs with ``generate``, the greedy answer (from the same prompt) scored by PRAG's
rules: the short answer is the generation cut at its first ``.``, newline or ``,`` (``extract_answer(...,
scoring="prag")``), F1 (HotpotQA's yes/no/noanswer rule) and EM after SQuAD normalisation, best over the gold
aliases; plus ``acc``, answer presence: 1 when a normalised gold alias occurs as whole words anywhere in the
normalised full generation (``metrics.answer_in_text``).

Scoring is the library's batched scorer (``fcprag_tools.label_builder.batched.score_rows``), the code path of
``fcprag labels build``: one code path for labels and evaluation. Each result names the scorer that made it
(``"scorer": "library"``; caches written by the study's earlier own scorer say ``"study"``).
"""

from __future__ import annotations

from typing import Any, Sequence


from batch_scorer import Job
from fcprag_tools.label_builder.batched import ScoreRow, score_rows
from fcprag_tools.label_builder.metrics import answer_in_text, exact_match, extract_answer, f1_score

MAX_RANK = 2


def scorer_name() -> str:
    return "library"


def stop_ids(model: Any, tok: Any) -> set[int]:
    """eos, ``<|im_end|>`` (when the vocabulary has it) and the generation config's eos: where a greedy answer
    stops."""
    stops = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():  # else convert_tokens_to_ids gives the unknown token's id
        stops.add(tok.convert_tokens_to_ids("<|im_end|>"))
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return {s for s in stops if isinstance(s, int) and s >= 0}


def make_slot(model: Any, store: dict[str, Any], max_adapters: int) -> Any:
    from fcprag_plugin.slot import FusedSlot

    return FusedSlot(model, next(iter(store.values())), max_adapters=max_adapters, max_rank=MAX_RANK)


def finish(job: Job, name: str, logprob: float, generation: str | None, scorer: str | None = None
           ) -> dict[str, Any]:
    """One result row: ``{"key", "name", "logprob", "scorer"}`` and, with a generation, ``"generation"`` (raw),
    ``"prediction"`` (PRAG's extracted answer), ``"f1"``, ``"em"``, ``"acc"`` (module docstring)."""
    res: dict[str, Any] = {"key": job.key, "name": name, "logprob": round(float(logprob), 5),
                           "scorer": scorer or scorer_name()}
    if generation is not None:
        pred = extract_answer(generation, False, scoring="prag")
        res.update(generation=generation, prediction=pred, f1=round(f1_score(pred, job.answers), 5),
                   em=exact_match(pred, job.answers), acc=answer_in_text(generation, job.answers))
    return res


def score_jobs(model: Any, tok: Any, slot: Any, jobs: Sequence[Job], store: dict[str, Any], *, batch_size: int = 16,
               max_new_tokens: int = 16, max_tokens: int = 6000) -> list[dict[str, Any]]:
    """One result per (job, row), jobs in order, rows in each job's order. Jobs must be encoded
    (``Job.encode(tok)``); ``store`` maps every pid to its adapter (``LoraAdapter``); ``slot`` holds at least the
    largest union of one forward's adapters (``make_slot``)."""
    rows, owners = [], []
    for job in jobs:
        for name, w in job.rows.items():
            keep = [(store[p], float(x)) for p, x in zip(job.pids, w) if float(x) != 0.0]  # 0 adds nothing
            rows.append(ScoreRow(prompt_ids=job.prompt_ids, gold_ids=job.gold,
                                 adapters=[a for a, _ in keep], weights=[x for _, x in keep],
                                 gen_prompt_ids=job.prompt_ids if job.generate else None))
            owners.append((job, name))
    out = score_rows(model, tok, slot, rows, mode="cat", batch_size=batch_size, max_tokens=max_tokens,
                     max_new_tokens=max_new_tokens, stop_ids=sorted(stop_ids(model, tok)))
    return [finish(job, name, r.logprob, r.generation) for (job, name), r in zip(owners, out)]
