"""Scoring jobs (see :mod:`batch_scorer`) for the study: which weightings of which passages each question is
scored with (``scoring.score_jobs`` scores them).

- :func:`label_job`: per training question, with the ``param`` prompt, every N = 3 subset of its BM25 top-6 (20)
  and every pair (15) with PRAG's weights: the leave-one-out labels of every subset (:func:`label_records`).
- :func:`fixed_rows`: the fixed methods' grid points on a question's passages, tuned on the training split:
  total scale ``kappa`` (``w~ = kappa * 1``), fixed cosine ``(g, tau)`` (``FusionController.fixed``) and fixed
  BM25 (``w~ = N softmax(z / tau)``, ``z`` the question's standardised BM25 scores).
- :func:`test_jobs`: per test question, condition (``clean`` top-3; ``replace`` one passage swapped for another
  test question's top passage; ``repeat`` one passage listed twice; ``alt`` a second, seeded subset of 3 of the
  top-6) and prompt mode (``param``, ``combine``): every method's row, the ``loo:i`` rows and the oracle pass.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import torch

from common import rng
from methods import controller_weights, fixed_controller

KAPPAS = (0.0, 0.25, 0.5, 0.75, 1.25, 1.5, 2.0, 3.0)
GRID_G = (0.25, 0.5, 1.0)  # a coarser fixed-cosine grid than methods.FIXED_* (each point costs a row per question)
GRID_TAU = (0.1, 0.5, 2.0)
BM25_TAU = (0.25, 0.5, 1.0, 2.0, 4.0)
CONDITIONS = ("clean", "replace", "repeat", "alt")
MODES = ("param", "combine")


def bm25_weights(scores: Sequence[float], tau: float) -> torch.Tensor:
    s = torch.tensor(list(scores), dtype=torch.float32)
    z = (s - s.mean()) / s.std(unbiased=False).clamp_min(1e-6) if len(s) > 1 else torch.zeros_like(s)
    return len(s) * torch.softmax(z / tau, 0)


def fixed_rows(q_emb: torch.Tensor, p_embs: torch.Tensor, bm25: Sequence[float], enc_dim: int,
               enc_name: str) -> dict[str, list[float]]:
    """Every point of the fixed grids for one question's passages (weights per passage): ``kappa:k``,
    ``cos:g:tau``, ``bm25:tau``. ``q_emb [d]``, ``p_embs [n, d]``, ``bm25 [n]``."""
    rows: dict[str, list[float]] = {}
    n = len(bm25)
    for k in KAPPAS:
        rows[f"kappa:{k}"] = [k] * n
    for g, t in itertools.product(GRID_G, GRID_TAU):
        c = fixed_controller(g, t, enc_dim, enc_name)
        rows[f"cos:{g}:{t}"] = controller_weights(c, q_emb, p_embs)["w_tilde"].tolist()
    for t in BM25_TAU:
        rows[f"bm25:{t}"] = bm25_weights(bm25, t).tolist()
    return rows


def subset_name(idx: Sequence[int]) -> str:
    return "s:" + "".join(map(str, idx))


def label_rows(k: int = 6, n: int = 3) -> dict[str, list[float]]:
    """Every N = ``n`` subset of the top ``k`` and every subset of size ``n - 1`` (each subset's leave-one-out
    rows), as 0/1 weights over the ``k`` passages: 20 + 15 rows for k = 6, n = 3."""
    w: dict[str, list[float]] = {}
    for size in (n, n - 1):
        for idx in itertools.combinations(range(k), size):
            w[subset_name(idx)] = [1.0 if i in idx else 0.0 for i in range(k)]
    return w


def label_job(r: dict[str, Any], k: int = 6, n: int = 3) -> dict[str, Any] | None:
    """The label-scoring job of one training question (``param`` prompt), or None when it has fewer than ``n``
    passages or a repeated passage text (which would make subset labels ambiguous; none in the shared data)."""
    ps = r["passages"][:k]
    pids = list(dict.fromkeys(p["pid"] for p in ps))
    if len(pids) < len(ps) or len(ps) < n:
        return None
    return {"key": f"{r['dataset']}|{r['id']}|train|param", "question": r["question"], "answers": r["answer"],
            "passages": [p["text"] for p in ps], "mode": "param", "pids": pids, "rows": label_rows(len(ps), n),
            "generate": False, "partition": "train"}


def label_records(r: dict[str, Any], results: dict[str, float], n: int = 3) -> list[dict[str, Any]]:
    """The leave-one-out label records (``docs/label-format.md``) of one training question from its scored
    subset rows ``{subset name: gold log-lik.}``: one record per N = ``n`` subset, ``metric_all`` = the subset's
    log-lik., ``metric_without[i]`` = that of the subset without its i-th passage, ``group`` = the question (so
    no question is ever split across folds or splits), plus the side fields (BM25 rank and score)."""
    ps = r["passages"]
    group = f"{r['dataset']}:{r['id']}"
    out = []
    for idx in itertools.combinations(range(len(ps)), n):
        full = results[subset_name(idx)]
        without = [results[subset_name([x for x in idx if x != i])] for i in idx]
        out.append({"id": f"{group}:{subset_name(idx)}", "query": r["question"],
                    "passages": [ps[i]["text"] for i in idx], "metric": "answer_logprob", "metric_all": full,
                    "metric_without": without, "deltas": [round(full - w, 6) for w in without], "group": group,
                    "answer": r["answer"], "pids": [ps[i]["pid"] for i in idx],
                    "retrieval_ranks": [ps[i]["rank"] for i in idx],
                    "retrieval_scores": [ps[i]["bm25"] for i in idx],
                    "supporting": [bool(ps[i]["supporting"]) for i in idx]})
    return out


def condition_passages(r: dict[str, Any], condition: str, donors: list[dict[str, Any]], n: int = 3
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The passages (by position) of one test question under ``condition`` and what was changed."""
    ps = [dict(p) for p in r["passages"][:n]]
    if condition == "clean":
        return ps, {}
    if condition == "alt":
        pool = list(itertools.combinations(range(len(r["passages"])), n))[1:]  # every subset but the top-n
        idx = rng("alt", r["id"]).choice(pool)
        return [dict(r["passages"][i]) for i in idx], {"subset": list(idx)}
    from evaluate import perturb  # replace-one / repeat-one as in the earlier study (same seeds)

    return perturb(dict(r, passages=ps), condition, donors)


WeightFn = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, list[float]]]


def test_jobs(rows: list[dict[str, Any]], methods: WeightFn, generate_conditions: Sequence[str] = ("clean",),
              conditions: Sequence[str] = CONDITIONS, modes: Sequence[str] = MODES, top: int = 3
              ) -> tuple[list[dict], list[dict]]:
    """Jobs + one metadata line per job (positions, supporting flags, per-method weights per position).

    ``methods(question_row, passages)`` gives ``{name: w~ per position}``; ``prag_sum``, ``average`` and the
    ``loo:i`` rows are added here, and every job asks for the oracle pass.
    """
    tests = [r for r in rows if r["split"] == "test"]
    jobs, meta = [], []
    for r in tests:
        donors = [d for d in tests if d["dataset"] == r["dataset"]]
        for cond in conditions:
            ps, info = condition_passages(r, cond, donors, top)
            n = len(ps)
            positions = [p["pid"] for p in ps]
            pids = list(dict.fromkeys(positions))
            per_pos: dict[str, list[float]] = {"prag_sum": [1.0] * n, "average": [1.0 / n] * n}
            per_pos.update(methods(r, ps))
            for i in range(n):
                per_pos[f"loo:{i}"] = [0.0 if k == i else 1.0 for k in range(n)]
            rows_w = {}
            for name, w in per_pos.items():
                if len(w) != n or not all(math.isfinite(float(x)) for x in w):
                    raise ValueError(f"{r['id']} {cond}: method {name} gave {w} for {n} passages")
                agg = [0.0] * len(pids)
                for p, x in zip(positions, w):
                    agg[pids.index(p)] += float(x)
                rows_w[name] = agg
            for mode in modes:
                key = f"{r['dataset']}|{r['id']}|{cond}|{mode}"
                jobs.append({"key": key, "question": r["question"], "answers": r["answer"],
                             "passages": [p["text"] for p in ps], "mode": mode, "pids": pids, "rows": rows_w,
                             "generate": cond in generate_conditions, "partition": "test",
                             "oracle": True, "positions": positions})
            meta.append({"dataset": r["dataset"], "id": r["id"], "condition": cond, "positions": positions,
                         "supporting": [bool(p["supporting"]) for p in ps], "rank": [p.get("rank") for p in ps],
                         "weights": {k: [round(float(x), 5) for x in v] for k, v in per_pos.items()}, **info})
    return jobs, meta
