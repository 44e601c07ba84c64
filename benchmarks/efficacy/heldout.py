"""Held-out evaluation shared by ``run_all.py`` and the study: methods' merge weights over each question's
passages -> scored rows (``scoring.score_jobs``) -> one value per question and method -> a paired summary.

- :func:`controller_method`: a saved controller as a method ``(question row, passages) -> w~ per position``,
  giving it the side features it was trained with (BM25 rank and score from the retrieval, adapter statistics
  from the adapters themselves).
- :func:`oracle_job`: the leave-one-out oracle's row of a scored job (``w~ = n softmax(delta / 0.1)`` from the
  job's own ``prag_sum`` and ``loo:i`` results; it reads the answer, so it is a reference, not a method).
- :func:`summarise`: mean gold log-lik. per method and, per method against ``prag_sum``, the mean paired
  difference with a 95% paired bootstrap CI over questions (``analysis.paired_bootstrap``, 2,000 resamples).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from batch_scorer import Job
from methods import oracle_weights

WeightFn = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, list[float]]]


def controller_method(name: str, ctrl: Any, encoder: Any, store: dict[str, Any],
                      record: dict[tuple[str, tuple[str, ...]], dict[str, list[float]]] | None = None) -> WeightFn:
    """``{name: w~ per position}`` from a :class:`~fcprag_plugin.FusionController` (eval mode); with ``record``,
    also ``record[(question id, pids by position)][name] = [g, tau, total scale]`` for every call."""
    side = list(getattr(ctrl.config, "side_features", None) or [])

    def fn(r: dict[str, Any], ps: list[dict[str, Any]]) -> dict[str, list[float]]:
        texts = [p["text"] for p in ps]
        with torch.no_grad():
            if side:  # the controller checks that it gets every side feature it was trained with
                out = ctrl.predict(r["question"], texts, encoder=encoder,
                                   retrieval_ranks=[float(p["rank"]) for p in ps],
                                   retrieval_scores=[float(p["bm25"]) for p in ps],
                                   adapter_stats=[store[p["pid"]] for p in ps])
            else:
                out = ctrl.predict(r["question"], texts, encoder)
        if record is not None:
            scale = 1.0 if out.scale is None else float(out.scale[0])
            record.setdefault((r["id"], tuple(p["pid"] for p in ps)), {})[name] = [
                round(float(out.g[0]), 5), round(float(out.tau[0]), 5), round(scale, 5)]
        return {name: [float(x) for x in out.merge_weights[0]]}
    return fn


def combine(*fns: WeightFn) -> WeightFn:
    def fn(r: dict[str, Any], ps: list[dict[str, Any]]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for f in fns:
            out.update(f(r, ps))
        return out
    return fn


def oracle_job(job: Job, positions: Sequence[str], res: dict[str, float]) -> Job:
    """The oracle row of one scored job from its own ``prag_sum`` and ``loo:i`` (per position) results."""
    n = len(positions)
    deltas = torch.tensor([res["prag_sum"] - res[f"loo:{i}"] for i in range(n)])
    w = oracle_weights(deltas)
    per_pid = [0.0] * len(job.pids)
    for i, p in enumerate(positions):
        per_pid[job.pids.index(p)] += float(w[i])
    j = Job(job.key, job.question, job.answers, job.passages, job.mode, job.pids, {"oracle": per_pid}, job.generate)
    j.prompt_ids, j.gold = job.prompt_ids, job.gold
    return j


def per_question(results: list[dict[str, Any]], metric: str = "logprob") -> dict[str, dict[str, float]]:
    """``{job key: {method: value}}`` (the last result wins when a row was scored twice)."""
    out: dict[str, dict[str, float]] = {}
    for r in results:
        if metric in r:
            out.setdefault(r["key"], {})[r["name"]] = float(r[metric])
    return out


def summarise(table: dict[str, dict[str, float]], baseline: str = "prag_sum", seed: str = "heldout"
              ) -> dict[str, Any]:
    """Means over the questions that have every method, and paired differences against ``baseline``."""
    from analysis import paired_bootstrap

    methods = sorted({m for v in table.values() for m in v if not m.startswith("loo:")})
    keys = sorted(k for k, v in table.items() if all(m in v for m in methods))
    out: dict[str, Any] = {"n_questions": len(keys), "methods": {}, "paired": {}}
    for m in methods:
        out["methods"][m] = {"gold_loglik": sum(table[k][m] for k in keys) / len(keys) if keys else None}
    if not keys or baseline not in methods:
        return out
    for m in methods:
        if m == baseline:
            continue
        diffs = [table[k][m] - table[k][baseline] for k in keys]
        point, lo, hi = paired_bootstrap({"all": diffs}, f"{seed}:{m}", n=2000)
        out["paired"][m] = {"delta_loglik": point, "ci95": [lo, hi], "against": baseline}
    return out
