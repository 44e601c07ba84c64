"""Held-out evaluation shared by ``run_all.py`` and the study: methods' merge weights over each question's
passages -> scored rows (``scoring.score_jobs``) -> one value per question and method -> a paired summary.

- :func:`controller_method`: a saved controller as a method ``(question row, passages) -> w~ per position``,
  giving it the side features it was trained with (BM25 rank and score from the retrieval, adapter statistics
  from the adapters themselves).
- :func:`weights_method`: the same through the library's one per-query entry point
  (``fcprag_plugin.controller.query_weights``), plus the ``<name>_same_total`` row for a controller that
  reweights (``run_all.py``).
- :func:`oracle_job`: the leave-one-out oracle's row of a scored job (``w~ = n softmax(delta / 0.1)`` from the
  job's own ``prag_sum`` and ``loo:i`` results; it reads the answer, so it is a reference, not a method).
- :func:`summarise`: mean gold log-lik. per method and, per method against ``prag_sum``, the mean paired
  difference with a 95% paired bootstrap CI over questions (``analysis.paired_bootstrap``, 2,000 resamples);
  the same for the generation metrics (``f1``, ``em``, ``acc``) when their tables are given.
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


def weights_method(name: str, ctrl: Any, encoder: Any, store: dict[str, Any],
                   same_total: bool | None = None) -> WeightFn:
    """``{name: w~ per position}`` from any saved controller (learned, fixed, uniform or scale-only) through
    ``query_weights``, with the side features it was trained with (``side_inputs``: BM25 rank and score
    of each position, its adapter from ``store``). ``same_total`` (default: when the controller is not
    uniform / scale-only, ``is_uniform``) adds ``{name}_same_total``: every position at the mean of ``w~``, the
    controller's total scale without its reweighting between passages (separates "how much" from "which")."""
    from fcprag_plugin.controller import query_weights
    from fcprag_plugin.weights import is_uniform, side_inputs

    uniform = is_uniform(ctrl)
    same = (not uniform) if same_total is None else same_total

    def fn(r: dict[str, Any], ps: list[dict[str, Any]]) -> dict[str, list[float]]:
        side = side_inputs(ctrl, adapters=lambda: [store[p["pid"]] for p in ps],
                           retrieval_ranks=[float(p["rank"]) for p in ps],
                           retrieval_scores=[float(p["bm25"]) for p in ps])
        with torch.no_grad():
            fw = query_weights(ctrl, r["question"], [p["text"] for p in ps], None if uniform else encoder, side)
        w = [float(x) for x in fw.merge_weights]
        out = {name: w}
        if same:
            out[f"{name}_same_total"] = [sum(w) / len(w)] * len(w)
        return out
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


GEN_METRICS = ("f1", "em", "acc")


def summarise(table: dict[str, dict[str, float]], baseline: str = "prag_sum", seed: str = "heldout",
              gen: dict[str, dict[str, dict[str, float]]] | None = None) -> dict[str, Any]:
    """Means over the questions that have every method, and paired differences against ``baseline``.

    ``table``: ``{question key: {method: gold log-lik.}}`` (``loo:*`` rows are ignored). ``gen``: optional
    ``{metric: table of that metric}`` (``f1``, ``em``, ``acc``); then only questions with every method in every
    table count, ``methods[m]`` gains each metric's mean and ``paired[m]`` ``delta_<metric>`` and
    ``ci95_<metric>``. Returns ``{"n_questions", "methods": {m: {"gold_loglik"[, metric...]}}, "paired": {m:
    {"delta_loglik", "ci95", "against"[, "delta_<metric>", "ci95_<metric>"...]}}}``."""
    from analysis import paired_bootstrap

    gen = gen or {}
    methods = sorted({m for v in table.values() for m in v if not m.startswith("loo:")})
    keys = sorted(k for k, v in table.items() if all(m in v for m in methods)
                  and all(m in t.get(k, {}) for t in gen.values() for m in methods))
    out: dict[str, Any] = {"n_questions": len(keys), "methods": {}, "paired": {}}
    for m in methods:
        out["methods"][m] = {"gold_loglik": sum(table[k][m] for k in keys) / len(keys) if keys else None}
        for metric, t in gen.items():
            out["methods"][m][metric] = sum(t[k][m] for k in keys) / len(keys) if keys else None
    if not keys or baseline not in methods:
        return out
    for m in methods:
        if m == baseline:
            continue
        diffs = [table[k][m] - table[k][baseline] for k in keys]
        point, lo, hi = paired_bootstrap({"all": diffs}, f"{seed}:{m}", n=2000)
        out["paired"][m] = {"delta_loglik": point, "ci95": [lo, hi], "against": baseline}
        for metric, t in gen.items():
            diffs = [t[k][m] - t[k][baseline] for k in keys]
            point, lo, hi = paired_bootstrap({"all": diffs}, f"{seed}:{m}:{metric}", n=2000)
            out["paired"][m][f"delta_{metric}"] = point
            out["paired"][m][f"ci95_{metric}"] = [lo, hi]
    return out
