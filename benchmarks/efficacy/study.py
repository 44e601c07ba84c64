"""The two-dataset study's driver: every stage on the CPU, resumable, one thread in the background.

    benchmarks/efficacy/start_background.sh           # the whole pipeline (below) in the background; resumes
    python benchmarks/efficacy/study.py prepare       # split + BM25 top-6, deterministic augmentation, embeddings
    python benchmarks/efficacy/study.py bench-adapters  # adapters/s one at a time vs batched -> cache/timings.jsonl
    python benchmarks/efficacy/study.py adapters      # every passage adapter, priority order (adapters.study_order)
    python benchmarks/efficacy/study.py labels        # 35 subset rows per training question -> labels_train.jsonl
    python benchmarks/efficacy/study.py pipeline      # the stages in PIPELINE order, each resumable

Committed caches: ``cache/<ds>/retrieval.jsonl``, ``augment.jsonl``, ``adapters.jsonl`` (steps, losses, norms,
wall-clock per adapter group), ``results_train.jsonl`` (every scored label row), ``labels_train.jsonl``;
``cache/timings.jsonl`` (stages over both datasets). Not committed: ``work/`` (adapters, embeddings, log, pid).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common import DATASETS, HERE, append_jsonl, cache_dir, read_jsonl, setup_logging, write_json, write_jsonl

TEST_FRACTION = 0.4
TOP_K = 6
WORK = HERE / "work"
STUDY_TIMINGS = HERE / "cache" / "timings.jsonl"  # stages that span both datasets
SCOPE = HERE / "cache" / "scope.json"  # the registered reduction of the study ('freeze'), when made


def _timed(ds: str, stage: str, seconds: float, **info: Any) -> None:
    import time

    append_jsonl(cache_dir(ds) / "timings.jsonl", [{"stage": stage, "seconds": round(seconds, 1),
                                                     "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}])


def all_rows() -> list[dict[str, Any]]:
    return [r for ds in DATASETS for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl")]


def load_emb() -> dict[str, Any]:
    import prepare

    WORK.mkdir(exist_ok=True)
    return prepare.embeddings(all_rows(), WORK / "embeddings.safetensors")


def cmd_prepare(a: argparse.Namespace) -> None:
    import time

    import prepare

    for ds, path in DATASETS.items():
        t0 = time.perf_counter()
        rows = prepare.retrieval(path, cache_dir(ds) / "retrieval.jsonl", TEST_FRACTION, TOP_K, dataset=ds)
        write_json(cache_dir(ds) / "retrieval_summary.json", prepare.retrieval_summary(rows, TOP_K))
        _timed(ds, "retrieve", time.perf_counter() - t0, device="cpu", questions=len(rows))
        t0 = time.perf_counter()
        aug = prepare.augmentation(rows, cache_dir(ds) / "augment.jsonl")
        _timed(ds, "augment (deterministic)", time.perf_counter() - t0, device="cpu", passages=len(aug))
    t0 = time.perf_counter()
    load_emb()
    _timed("hotpotqa", "embeddings (both datasets)", time.perf_counter() - t0, device="cpu")


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def scope() -> dict[str, Any] | None:
    """The frozen scope (``cache/scope.json``, written by 'freeze'), or None while the study has its full scope."""
    return json.loads(SCOPE.read_text()) if SCOPE.exists() else None


def _in_scope(r: dict[str, Any], sc: dict[str, Any] | None) -> bool:
    return sc is None or r["split"] != "train" or r["id"] in sc["train_ids"][r["dataset"]]


def adapter_plan() -> tuple[list[tuple[str, str]], dict[str, dict[str, dict[str, Any]]]]:
    """Every adapter the study needs in priority order (``adapters.study_order``) and the augmentations; under a
    frozen scope only the test top-3 and the frozen training questions' passages."""
    import adapters

    retrieval = {ds: read_jsonl(cache_dir(ds) / "retrieval.jsonl") for ds in DATASETS}
    augs = adapters.load_augs(list(DATASETS))
    order = adapters.study_order(retrieval, top=3)
    sc = scope()
    if sc is not None:
        keep = {(ds, p["pid"]) for ds, rows in retrieval.items() for r in rows if _in_scope(r, sc)
                for p in (r["passages"][:3] if r["split"] == "test" else r["passages"])}
        order = [it for it in order if it in keep]
    missing = [it for it in order if it[1] not in augs[it[0]]]
    if missing:
        raise SystemExit(f"{len(missing)} passages have no augmentation (e.g. {missing[0]}): run 'study.py prepare'")
    return order, augs


def cmd_adapters(a: argparse.Namespace) -> None:
    """Train every missing adapter, in priority order, one group at a time (resumable at group granularity)."""
    import time

    import adapters

    _threads(a.threads)
    order, augs = adapter_plan()
    done = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    todo = [it for it in order if it[1] not in done[it[0]]]
    n_done = len(order) - len(todo)
    if a.limit is not None:
        todo = todo[:a.limit]
    if a.group is None:  # the faster way measured by bench-adapters on this machine, else 12 together
        bench = [r for r in read_jsonl(STUDY_TIMINGS) if r["stage"] == "adapters-bench"] if STUDY_TIMINGS.exists() else []
        a.group = bench[-1]["best_group"] if bench else 12
    print(f"adapters: {len(order)} needed, {n_done} done, {len(todo)} to train now (group {a.group})", flush=True)
    if not todo:
        return
    t0 = time.perf_counter()
    adapters.build(todo, augs, a.group, a.block, 1, a.max_tokens)
    secs = time.perf_counter() - t0
    append_jsonl(STUDY_TIMINGS, [{"stage": "adapters", "seconds": round(secs, 1), "adapters": len(todo),
                                  "adapters_per_s": round(len(todo) / secs, 4), "group": a.group,
                                  "threads": a.threads, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}])


def cmd_bench_adapters(a: argparse.Namespace) -> None:
    """Adapters/s one at a time vs batched (multilora) on the same passages, side by side in one process; the
    projected wall-clock of the whole adapter stage at the faster rate -> ``cache/timings.jsonl``."""
    import os
    import time

    import adapters
    from common import load_model

    if not a.force and STUDY_TIMINGS.exists() and any(
            r["stage"] == "adapters-bench" for r in read_jsonl(STUDY_TIMINGS)):
        print("bench-adapters: already measured (cache/timings.jsonl); --force to measure again", flush=True)
        return
    _threads(a.threads)
    order, augs = adapter_plan()
    items = order[:a.n]
    model, tok = load_model(adapters.DTYPE)
    res, losses = [], {}
    for g in a.groups:
        t0 = time.perf_counter()
        rows = adapters.build(items, augs, g, len(items), 1, a.max_tokens, model=model, tok=tok, save=False)
        secs = time.perf_counter() - t0
        losses[g] = {r["pid"]: r["loss_after"]["passage"] for r in rows}
        res.append({"group": g, "seconds": round(secs, 2), "adapters_per_s": round(len(items) / secs, 4)})
        print(f"group {g}: {len(items)} adapters in {secs:.1f} s = {len(items) / secs:.3f} adapters/s", flush=True)
    ref = losses[a.groups[0]]
    agree = max(abs(losses[g][p] - ref[p]) for g in a.groups for p in ref)
    done = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    left = sum(it[1] not in done[it[0]] for it in order)
    best = max(res, key=lambda r: r["adapters_per_s"])
    row = {"stage": "adapters-bench", "adapters": len(items), "threads": a.threads, "dtype": adapters.DTYPE,
           "nice": os.nice(0), "runs": res,
           "max_abs_diff_loss_after_passage": round(agree, 4), "load_avg_1min": round(os.getloadavg()[0], 2),
           "needed_total": len(order), "left": left, "best_group": best["group"],
           "projected_hours_left": round(left / best["adapters_per_s"] / 3600, 2),
           "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    append_jsonl(STUDY_TIMINGS, [row])
    print(json.dumps(row), flush=True)


def train_questions_in_order() -> list[dict[str, Any]]:
    """The training questions of both datasets, taking turns question by question (the adapter stage's order)."""
    sc = scope()
    per_ds = [[r for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl") if r["split"] == "train" and _in_scope(r, sc)]
              for ds in DATASETS]
    return [r for i in range(max(map(len, per_ds))) for rows in per_ds if i < len(rows) for r in [rows[i]]]


def scored(path: Path) -> dict[str, dict[str, float]]:
    """``{job key: {row name: gold log-lik.}}`` of a results cache (empty when there is none)."""
    out: dict[str, dict[str, float]] = {}
    for r in read_jsonl(path) if path.exists() else []:
        out.setdefault(r["key"], {})[r["name"]] = r["logprob"]
    return out


def pending_label_jobs(questions: list[dict[str, Any]], done_results: dict[str, dict[str, dict[str, float]]],
                       done_adapters: dict[str, set[str]]) -> tuple[list[dict[str, Any]], int]:
    """The label jobs still to score (every row of a job scored = done) whose adapters all exist, in order, and
    how many questions wait for adapters."""
    from jobs import label_job

    todo, waiting = [], 0
    for r in questions:
        job = label_job(r)
        if job is None or set(job["rows"]) <= set(done_results[r["dataset"]].get(job["key"], {})):
            continue
        if not set(job["pids"]) <= done_adapters[r["dataset"]]:
            waiting += 1
            continue
        todo.append(job)
    return todo, waiting


def load_store(items: list[tuple[str, str]]) -> dict[str, Any]:
    from common import work_dir
    from fcprag_plugin import LoraAdapter

    return {pid: LoraAdapter.from_pretrained(work_dir(ds) / "adapters" / pid) for ds, pid in dict.fromkeys(items)}


def write_labels() -> dict[str, int]:
    """``cache/<ds>/labels_train.jsonl`` from the scored label rows (every finished training question)."""
    from jobs import label_records

    counts = {}
    for ds in DATASETS:
        res = scored(cache_dir(ds) / "results_train.jsonl")
        recs = []
        for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl"):
            key = f"{ds}|{r['id']}|train|param"
            if r["split"] == "train" and key in res:
                try:
                    recs += label_records(r, res[key])
                except KeyError:  # a question whose rows are not all scored yet
                    continue
        write_jsonl(cache_dir(ds) / "labels_train.jsonl", recs)
        counts[ds] = len(recs)
    return counts


def cmd_labels(a: argparse.Namespace) -> None:
    """Score every training question's 35 subset rows (``param`` prompt), ``--questions`` at a time; append each
    batch's results to ``cache/<ds>/results_train.jsonl`` at once; then write the label files."""
    import os
    import time

    import adapters
    import scoring

    _threads(a.threads)
    questions = train_questions_in_order()
    done_res = {ds: scored(cache_dir(ds) / "results_train.jsonl") for ds in DATASETS}
    done_ad = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    todo, waiting = pending_label_jobs(questions, done_res, done_ad)
    if a.limit is not None:
        todo = todo[:a.limit]
    print(f"labels: {len(questions)} training questions, {len(todo)} to score now, {waiting} wait for adapters "
          f"(scorer: {scoring.scorer_name()})", flush=True)
    t0 = time.perf_counter()
    n_rows = _score_and_append(todo, a.questions, lambda ds: cache_dir(ds) / "results_train.jsonl", "labels", a)
    if n_rows:
        secs = time.perf_counter() - t0
        append_jsonl(STUDY_TIMINGS, [{"stage": "labels", "seconds": round(secs, 1), "questions": len(todo),
                                      "rows": n_rows, "rows_per_s": round(n_rows / secs, 3), "threads": a.threads,
                                      "scorer": scoring.scorer_name(), "nice": os.nice(0),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}])
    print(f"labels: records written {write_labels()}", flush=True)


def cmd_freeze(a: argparse.Namespace) -> None:
    """Reduce the study to what fits its compute, before any test-split result exists: the training questions are
    those whose whole retrieved list has adapters now, and the ``alt`` condition (which needs the test questions'
    other passages) is dropped. Written once to ``cache/scope.json``; the adapter stage then has nothing left."""
    from datetime import datetime, timezone

    import adapters

    if SCOPE.exists():
        raise SystemExit(f"freeze: {SCOPE} exists (the scope is frozen once)")
    if any((cache_dir(ds) / "results_test.jsonl").exists() for ds in DATASETS):
        raise SystemExit("freeze: test-split results exist; a reduction must be made before any")
    done = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    train = {ds: [r["id"] for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl") if r["split"] == "train"
                  and all(p["pid"] in done[ds] for p in r["passages"])] for ds in DATASETS}
    totals = {ds: sum(r["split"] == "train" for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl")) for ds in DATASETS}
    write_json(SCOPE, {"frozen_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "reason": a.reason, "train_ids": train,
                       "train_questions": {ds: f"{len(train[ds])}/{totals[ds]}" for ds in DATASETS},
                       "conditions": ["clean", "replace", "repeat"]})
    print(f"freeze: training questions {({ds: len(v) for ds, v in train.items()})}; conditions clean, replace, repeat",
          flush=True)


def cmd_status(a: argparse.Namespace) -> None:
    """Progress of every stage, the measured rates and the projected time left (reads the caches only)."""
    import os
    from datetime import datetime, timezone

    import adapters

    order, _ = adapter_plan()
    done = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    tiers = {"test top-3": 0, "train top-6": 0, "test rest": 0}
    top = {(ds, p["pid"]) for ds in DATASETS for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl")
           if r["split"] == "test" for p in r["passages"][:3]}
    train = {(ds, p["pid"]) for ds in DATASETS for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl")
             if r["split"] == "train" for p in r["passages"]}
    need = dict.fromkeys(tiers, 0)
    for it in order:
        t = "test top-3" if it in top else "train top-6" if it in train else "test rest"
        need[t] += 1
        tiers[t] += it[1] in done[it[0]]
    logs = [r for ds in DATASETS for r in (read_jsonl(cache_dir(ds) / "adapters.jsonl")
                                            if (cache_dir(ds) / "adapters.jsonl").exists() else [])]
    groups: dict[tuple[str, float], int] = {}
    for r in logs:  # one row per adapter; a group's rows share 'finished' and 'group_seconds'
        groups[(r.get("finished", ""), r.get("group_seconds", 0.0))] = r.get("group_size", 1)
    recent = sorted(groups.items())[-20:]
    rate = sum(n for _, n in recent) / sum(k[1] for k, _ in recent) if recent else None
    left = len(order) - sum(tiers.values())
    pid_file = WORK / "pipeline.pid"
    alive = False
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 0)
            alive = True
        except (OSError, ValueError):
            pass
    questions = train_questions_in_order()
    res = {ds: scored(cache_dir(ds) / "results_train.jsonl") for ds in DATASETS}
    from jobs import label_rows
    n_rows = len(label_rows())
    labelled = sum(len(res[r["dataset"]].get(f"{r['dataset']}|{r['id']}|train|param", {})) >= n_rows for r in questions)
    snap = {
        "now_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "pipeline_running": alive, "pid": pid_file.read_text().strip() if pid_file.exists() else None,
        "adapters_done": {t: f"{tiers[t]}/{need[t]}" for t in tiers},
        "adapters_per_s_last_20_groups": round(rate, 4) if rate else None,
        "adapters_hours_left_at_that_rate": round(left / rate / 3600, 2) if rate else None,
        "labels_questions_done": f"{labelled}/{len(questions)}",
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(snap, indent=2))
    if a.record:  # a progress snapshot in the committed timings (rate and projection at this moment)
        append_jsonl(STUDY_TIMINGS, [{"stage": "progress", **snap}])


def _score_and_append(todo: list[dict[str, Any]], per: int, path_of: Any, label: str, a: argparse.Namespace,
                      oracle_positions: dict[str, list[str]] | None = None) -> int:
    """Score jobs ``per`` questions at a time (adapters loaded per chunk), append each chunk's results to
    ``path_of(dataset)`` at once (plus the oracle pass for jobs in ``oracle_positions``); rows scored."""
    import time

    import adapters
    import heldout
    import scoring
    from batch_scorer import Job
    from common import load_model

    if not todo:
        return 0
    model, tok = load_model(adapters.DTYPE)
    slot, n_rows = None, 0
    for s in range(0, len(todo), per):
        t0 = time.perf_counter()
        chunk = todo[s:s + per]
        jobs = [Job.from_dict(j).encode(tok) for j in chunk]
        store = load_store([(j["key"].split("|")[0], p) for j in chunk for p in j["pids"]])
        if slot is None:
            slot = scoring.make_slot(model, store, max_adapters=8 * per)
        res = scoring.score_jobs(model, tok, slot, jobs, store, batch_size=a.batch_size)
        if oracle_positions:
            by = heldout.per_question(res)
            orc = [heldout.oracle_job(j, oracle_positions[j.key], by[j.key]) for j in jobs
                   if j.key in oracle_positions and "prag_sum" in by.get(j.key, {})]
            res += scoring.score_jobs(model, tok, slot, orc, store, batch_size=a.batch_size)
        for ds in DATASETS:
            mine = [r for r in res if r["key"].startswith(ds + "|")]
            if mine:
                append_jsonl(path_of(ds), mine)
        n_rows += len(res)
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {label}: {s + len(chunk)}/{len(todo)} jobs, "
              f"{len(res) / (time.perf_counter() - t0):.2f} rows/s", flush=True)
    slot.remove()
    return n_rows


def grid_rows(r: dict[str, Any], ps: list[dict[str, Any]], emb: dict[str, Any], enc_dim: int, enc_name: str
              ) -> dict[str, list[float]]:
    """Every fixed-method grid point (``jobs.fixed_rows``) for one question's passages."""
    import torch

    from jobs import fixed_rows
    from prepare import text_key

    return fixed_rows(emb[text_key(r["question"])], torch.stack([emb[text_key(p["text"])] for p in ps]),
                      [p["bm25"] for p in ps], enc_dim, enc_name)


def _train_encoder() -> Any:
    from fcprag_plugin.encoding import TextEncoder

    return TextEncoder()


def _encoder_info() -> tuple[int, str]:
    from fcprag_plugin.encoding import TextEncoder

    enc = TextEncoder()
    return enc.dim, enc.name


def cmd_grids(a: argparse.Namespace) -> None:
    """The fixed methods' grids on every training question's BM25 top-3 (``param``): rows ``kappa:*``, ``cos:*``,
    ``bm25:*`` appended to ``cache/<ds>/results_train.jsonl`` (the best point of each is chosen there)."""
    import os
    import time

    import adapters

    _threads(a.threads)
    emb = load_emb()
    dim, name = _encoder_info()
    done_res = {ds: scored(cache_dir(ds) / "results_train.jsonl") for ds in DATASETS}
    done_ad = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    todo = []
    for r in train_questions_in_order():
        ps = r["passages"][:3]
        key = f"{r['dataset']}|{r['id']}|train|param"
        if not {p["pid"] for p in ps} <= done_ad[r["dataset"]]:
            continue
        rows = grid_rows(r, ps, emb, dim, name)
        if set(rows) <= set(done_res[r["dataset"]].get(key, {})):
            continue
        todo.append({"key": key, "question": r["question"], "answers": r["answer"], "passages": [], "mode": "param",
                     "pids": [p["pid"] for p in ps], "rows": rows})
    if a.limit is not None:
        todo = todo[:a.limit]
    print(f"grids: {len(todo)} training questions to score", flush=True)
    t0 = time.perf_counter()
    n = _score_and_append(todo, a.questions, lambda ds: cache_dir(ds) / "results_train.jsonl", "grids", a)
    if n:
        append_jsonl(STUDY_TIMINGS, [{"stage": "grids", "seconds": round(time.perf_counter() - t0, 1),
                                      "questions": len(todo), "rows": n, "threads": a.threads, "nice": os.nice(0),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}])


def best_fixed(prefixes: tuple[str, ...] = ("kappa:", "cos:", "bm25:")) -> dict[str, str]:
    """Per fixed family, the grid point with the highest mean training gold log-lik. (both datasets pooled,
    over the training questions that have every point)."""
    tables = [v for ds in DATASETS for v in scored(cache_dir(ds) / "results_train.jsonl").values()]
    out = {}
    for pre in prefixes:
        names = sorted({n for t in tables for n in t if n.startswith(pre)})
        full = [t for t in tables if names and all(n in t for n in names)]
        if full:
            out[pre.rstrip(":")] = max(names, key=lambda n: (sum(t[n] for t in full) / len(full), n))
    return out


def learned_dirs() -> dict[str, Path]:
    """``{learned:<config>:s<seed>: folder}`` for every trained controller under ``work/controllers/``."""
    root = WORK / "controllers"
    return {f"learned:{d.parent.name}:{d.name}": d for d in sorted(root.glob("*/s*")) if (d / "config.json").is_file()}


class _AdapterStore(dict):
    """``{pid: LoraAdapter}`` loaded on first use from ``work/<ds>/adapters/`` (side-feature controllers read their
    adapter statistics from the adapters themselves)."""

    def __init__(self, where: dict[str, str]) -> None:
        super().__init__()
        self.where = where

    def __missing__(self, pid: str) -> Any:
        from common import work_dir
        from fcprag_plugin import LoraAdapter

        self[pid] = LoraAdapter.from_pretrained(work_dir(self.where[pid]) / "adapters" / pid)
        return self[pid]


def test_methods(emb: dict[str, Any]) -> Any:
    """The weight function of every method available now: random controller, the best fixed points (once the
    grids are scored) and every trained controller (``prag_sum``, ``average``, ``loo:i`` come from jobs.py)."""
    import torch

    import heldout
    from fcprag_plugin import FusionController
    from fcprag_plugin.encoding import TextEncoder
    from methods import controller_weights
    from prepare import text_key

    dim, name = _encoder_info()
    # the controllers embed through the cached embeddings (same model, same vectors, no encoder load)
    cached = TextEncoder.from_function(lambda texts: torch.stack([emb[text_key(t)] for t in texts]), dim, name)
    best = best_fixed()
    random_ctrl = FusionController.random(embed_dim=dim, seed=0, embedding_model=name).eval()
    store = _AdapterStore({p["pid"]: r["dataset"] for r in all_rows() for p in r["passages"]})
    calibration: dict[tuple[str, tuple[str, ...]], dict[str, list[float]]] = {}
    learned = [heldout.controller_method(n, FusionController.from_pretrained(d).eval(), cached, store, calibration)
               for n, d in learned_dirs().items()]

    def fn(r: dict[str, Any], ps: list[dict[str, Any]]) -> dict[str, list[float]]:
        q, P = emb[text_key(r["question"])], torch.stack([emb[text_key(p["text"])] for p in ps])
        out = {"random": controller_weights(random_ctrl, q, P)["w_tilde"].tolist()}
        if best:
            grid = grid_rows(r, ps, emb, dim, name)
            out.update({f"best_{fam}": grid[point] for fam, point in best.items()})
        for f in learned:
            out.update(f(r, ps))
        return out
    fn.calibration = calibration  # type: ignore[attr-defined]  # (g, tau, scale) of every learned call
    return fn


def chosen_candidate() -> str | None:
    """The configuration the registered selection picks from the training CV alone (``analysis.select``), or
    None before any controller is trained."""
    import analysis

    cv = analysis.cv_gains(cache_dir("controllers"))
    return analysis.select(cv) if cv else None


def eval_passes(chosen: str | None, conditions: list[str]) -> list[tuple[tuple[str, ...], tuple[str, ...], Any]]:
    """The evaluation's passes in priority order, each ``(conditions, modes, keep(row name))``: the primary
    comparison's rows first (``param``/clean: PRAG's sum, the average, the random and fixed baselines, the chosen
    configuration's seeds, leave-one-out and the oracle); the perturbations (``param``); every other method on
    ``param``/clean; the ``combine`` prompt (the longest prompts, last). The perturbations and ``combine`` score
    PRAG's sum, the average and the chosen configuration only (the registered secondary comparisons need no more)."""
    mine = f"learned:{chosen}:" if chosen else None

    def core(name: str) -> bool:
        return name in ("prag_sum", "average") or bool(mine and name.startswith(mine))

    def primary(name: str) -> bool:
        return core(name) or name == "random" or name.startswith(("best_", "loo:"))

    pert = tuple(c for c in ("replace", "repeat", "alt") if c in conditions)
    return ([(("clean",), ("param",), primary)] + ([(pert, ("param",), core)] if pert else [])
            + [(("clean",), ("param",), lambda name: True), (("clean",), ("combine",), core)])


def cmd_eval(a: argparse.Namespace) -> None:
    """The methods on the test questions, pass by pass (``eval_passes``); rows already scored are skipped,
    results -> ``cache/<ds>/results_test.jsonl``; one metadata line per question, condition and new set of
    methods (weights per position; ``calibration``: ``[g, tau, total scale]`` per learned controller) ->
    ``cache/<ds>/test_meta.jsonl`` (readers merge a question's lines)."""
    import os
    import time

    import adapters
    from jobs import CONDITIONS, test_jobs

    _threads(a.threads)
    emb = load_emb()
    rows = all_rows()
    fn = test_methods(emb)
    sc = scope()
    conditions = sc["conditions"] if sc else list(CONDITIONS)
    chosen = chosen_candidate()
    done_ad = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    t0 = time.perf_counter()
    n = 0
    for conds, modes, keep in eval_passes(chosen, conditions):
        jobs, meta = test_jobs(rows, fn, generate_conditions=(), conditions=conds, modes=modes)
        for ds in DATASETS:
            path = cache_dir(ds) / "test_meta.jsonl"
            have: dict[tuple[str, str], set[str]] = {}
            for m in read_jsonl(path) if path.exists() else []:
                have.setdefault((m["id"], m["condition"]), set()).update(m["weights"])
            new = [dict(m, weights={k: v for k, v in m["weights"].items() if keep(k)},
                        calibration={k: v for k, v in fn.calibration.get((m["id"], tuple(m["positions"])), {}).items()
                                     if keep(k)})
                   for m in meta if m["dataset"] == ds]
            new = [m for m in new if not set(m["weights"]) <= have.get((m["id"], m["condition"]), set())]
            if new:
                append_jsonl(path, new)
        done = {ds: scored(cache_dir(ds) / "results_test.jsonl") for ds in DATASETS}
        oracle = conds == ("clean",) and modes == ("param",)
        todo = []
        positions = {}
        for j in jobs:
            ds = j["key"].split("|")[0]
            if not set(j["pids"]) <= done_ad[ds]:
                continue
            have_rows = done[ds].get(j["key"], {})
            missing = {k: v for k, v in j["rows"].items() if keep(k) and k not in have_rows}
            if oracle and "oracle" not in have_rows:  # the oracle pass needs its loo rows in the same call
                missing.update({k: v for k, v in j["rows"].items() if k == "prag_sum" or k.startswith("loo:")})
                positions[j["key"]] = j["positions"]
            if missing:
                todo.append(dict(j, rows=missing))
        if a.limit is not None:
            todo = todo[:a.limit]
        print(f"eval {conds} {modes}: {len(todo)} jobs to score (chosen: {chosen})", flush=True)
        n += _score_and_append(todo, a.questions, lambda ds: cache_dir(ds) / "results_test.jsonl", "eval", a,
                               oracle_positions=positions)
    if n:
        append_jsonl(STUDY_TIMINGS, [{"stage": "eval", "seconds": round(time.perf_counter() - t0, 1), "rows": n,
                                      "chosen": chosen, "methods_available": sorted(learned_dirs()),
                                      "threads": a.threads, "nice": os.nice(0),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}])


SIDE = ["retrieval_rank", "retrieval_score", "adapter_stats"]
# The registered candidates (docs/results/efficacy-plan.md): objective x features x scale; the per-query scale
# head exists for the risk objective only.
CANDIDATES: dict[str, dict[str, Any]] = {}
for _obj in ("kl", "risk"):
    for _feat, _side in (("paper", []), ("side", SIDE)):
        for _scale in ("k1", "kappa", "query"):
            if _scale == "query" and _obj != "risk":
                continue
            CANDIDATES[f"{_obj}-{_feat}-{_scale}"] = {
                "objective": _obj, "side_features": _side, "kappa": "auto" if _scale == "kappa" else 1.0,
                # the first study's registered features include the BM25 score, which its evaluation supplies
                **({"allow_retrieval_score": True} if _side else {}),
                **({"controller": {"query_scale": True}} if _scale == "query" else {})}
SEEDS = (0, 1, 2)
EPOCHS = 3  # the most epochs each CV fold may train (plan change 2: the best epoch was 1 in every earlier setting)


def pooled_labels(path: Path, with_stats: bool) -> int:
    """Both datasets' label records in one file (the controller is trained on both), with ``adapter_stats`` per
    passage when asked (computed once per adapter from its factors, cached in ``work/adapter_stats.json``)."""
    import json as _json

    recs = [x for ds in DATASETS for x in read_jsonl(cache_dir(ds) / "labels_train.jsonl")]
    if with_stats:
        from common import work_dir
        from fcprag_plugin import LoraAdapter
        from fcprag_plugin.features import adapter_stats

        cache_path = WORK / "adapter_stats.json"
        stats = _json.loads(cache_path.read_text()) if cache_path.exists() else {}
        for x in recs:
            ds = x["group"].split(":")[0]
            for pid in x["pids"]:
                if pid not in stats:
                    stats[pid] = adapter_stats(LoraAdapter.from_pretrained(work_dir(ds) / "adapters" / pid))
            x["adapter_stats"] = [stats[p] for p in x["pids"]]
        cache_path.write_text(_json.dumps(stats))
    write_jsonl(path, recs)
    return len(recs)


def cmd_train(a: argparse.Namespace) -> None:
    """Seed 0 of every candidate on the pooled training labels (grouped 5-fold CV inside the trainer), then the
    other seeds of the configuration those CV results choose (plan change 2), into
    ``work/controllers/<candidate>/s<seed>/`` (skipped when there); each run's metrics (CV gain, CI, verdict,
    timing) -> ``cache/controllers/<candidate>-s<seed>.json``."""
    import shutil
    import time

    from fcprag_plugin.training import train_controller

    _threads(a.threads)
    out_dir = cache_dir("controllers")
    WORK.mkdir(exist_ok=True)
    n_groups = len({x["group"] for ds in DATASETS if (cache_dir(ds) / "labels_train.jsonl").exists()
                    for x in read_jsonl(cache_dir(ds) / "labels_train.jsonl")})
    if n_groups < 2:
        print(f"train: {n_groups} labelled training questions; nothing trained", flush=True)
        return
    files = {}
    for side in (False, True):
        files[side] = WORK / f"labels_train_pooled{'_side' if side else ''}.jsonl"
        pooled_labels(files[side], side)
    enc = _train_encoder()

    def run(name: str, seed: int) -> None:
        opts = CANDIDATES[name]
        dst = WORK / "controllers" / name / f"s{seed}"
        if (dst / "config.json").is_file():
            return
        if dst.exists():  # a run that was stopped: start it again
            shutil.rmtree(dst)
        t0 = time.perf_counter()
        res = train_controller(str(files[bool(opts["side_features"])]), str(dst), encoder=enc,
                               epochs=a.epochs, cv_folds=min(5, n_groups), seed=seed, val_fraction=0.0,
                               threads=a.threads, progress=False, cache_dir=str(WORK / "embeddings"), **opts)
        m = dict(res.metrics)
        write_json(out_dir / f"{name}-s{seed}.json", {
            "candidate": name, "seed": seed, "options": opts, "epochs_max": a.epochs, "questions": n_groups,
            "seconds": round(time.perf_counter() - t0, 1), "cv": m.get("cv"),
            "metrics": {k: v for k, v in m.items() if k != "cv"}})
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} train: {name} seed {seed}: cv {m.get('cv', {}).get('gain')}",
              flush=True)

    for name in CANDIDATES:
        if not a.only or name in a.only:
            run(name, 0)
    chosen = chosen_candidate()
    for seed in a.seeds:
        if seed != 0 and chosen is not None:
            run(chosen, seed)


CURVE_SIZES = (16, 32, 64)  # training questions of the learning curve (plus all of them: the train stage's run)


def cmd_curve(a: argparse.Namespace) -> None:
    """Learning curve of the chosen configuration: trained (seed 0, the same grouped 5-fold CV) on the first
    ``n`` training questions of the adapter stage's order, for each ``n`` in ``CURVE_SIZES`` -> the CV result in
    ``cache/curve/<n>-s0.json``; the full set's point is the train stage's own run (copied there)."""
    import time

    chosen = chosen_candidate()
    if chosen is None:
        print("curve: no trained candidate yet; nothing to do", flush=True)
        return
    from fcprag_plugin.training import train_controller

    _threads(a.threads)
    opts = CANDIDATES[chosen]
    out_dir = cache_dir("curve")
    order = [f"{r['dataset']}:{r['id']}" for r in train_questions_in_order()]
    full = json.loads((cache_dir("controllers") / f"{chosen}-s0.json").read_text())
    write_json(out_dir / f"{full['questions']}-s0.json", {"questions": full["questions"], "seed": 0,
                                                          "candidate": chosen, "cv": full["cv"],
                                                          "seconds": full["seconds"]})
    src = WORK / f"labels_train_pooled{'_side' if opts['side_features'] else ''}.jsonl"
    recs = read_jsonl(src)
    enc = _train_encoder()
    for n in CURVE_SIZES:
        if n >= len(order) or (out_dir / f"{n}-s0.json").exists():
            continue
        keep = set(order[:n])
        path = WORK / f"curve_{n}.jsonl"
        write_jsonl(path, [x for x in recs if x["group"] in keep])
        dst = WORK / "curve" / str(n)
        if dst.exists():
            import shutil

            shutil.rmtree(dst)
        t0 = time.perf_counter()
        res = train_controller(str(path), str(dst), encoder=enc, epochs=a.epochs, cv_folds=5, seed=0,
                               val_fraction=0.0, threads=a.threads, progress=False,
                               cache_dir=str(WORK / "embeddings"), **opts)
        write_json(out_dir / f"{n}-s0.json", {"questions": n, "seed": 0, "candidate": chosen,
                                               "cv": res.metrics.get("cv"),
                                               "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} curve: {n} questions: cv {res.metrics.get('cv', {}).get('gain')}",
              flush=True)


def cmd_report(a: argparse.Namespace) -> None:
    """``docs/results/efficacy.md`` from the committed caches (``report.py``)."""
    import report

    report.main([])


def cmd_analysis(a: argparse.Namespace) -> None:
    """The registered analysis (``analysis.py``) -> ``cache/analysis.json``."""
    import analysis

    analysis.main()


PIPELINE = ("bench-adapters", "adapters", "labels", "grids", "train", "eval", "analysis", "curve", "report")  # stages run by 'pipeline', in order (later stages are added as they are written)


def cmd_pipeline(a: argparse.Namespace) -> None:
    """The next stage after ``--after`` (default: the first), as a fresh subprocess, then this command again as a
    fresh process (``os.execv``), so stages and stage lists written after the launch are picked up from the code on
    disk. Every stage is resumable; stops at the first failure."""
    import os
    import subprocess
    import time

    start = PIPELINE.index(a.after) + 1 if a.after in PIPELINE else 0
    if start >= len(PIPELINE):
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pipeline: done", flush=True)
        return
    stage = PIPELINE[start]
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pipeline: stage {stage}", flush=True)
    rc = subprocess.run([sys.executable, str(HERE / "study.py"), stage, "--threads", str(a.threads)]).returncode
    if rc:
        raise SystemExit(f"pipeline: stage {stage} failed (exit {rc}); rerun to resume")
    os.execv(sys.executable, [sys.executable, str(HERE / "study.py"), "pipeline", "--threads", str(a.threads),
                              "--after", stage])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    sub.add_parser("freeze").add_argument("--reason", required=True, help="why (recorded in cache/scope.json)")
    s = sub.add_parser("pipeline")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--after", default=None, help="continue after this stage (default: from the first)")
    sub.add_parser("status").add_argument("--record", action="store_true",
                                          help="also append this snapshot to cache/timings.jsonl")
    sub.add_parser("analysis").add_argument("--threads", type=int, default=1)
    sub.add_parser("report").add_argument("--threads", type=int, default=1)
    s = sub.add_parser("curve")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--epochs", type=int, default=EPOCHS, help="the most epochs; the trainer's CV picks 0..epochs")
    s = sub.add_parser("train")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--epochs", type=int, default=EPOCHS, help="the most epochs; the trainer's CV picks 0..epochs")
    s.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds of the chosen configuration")
    s.add_argument("--only", nargs="*", default=None, help="only these candidates")
    for name in ("labels", "grids", "eval"):
        s = sub.add_parser(name)
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--questions", type=int, default=4, help="questions per scoring call")
        s.add_argument("--batch-size", type=int, default=16, help="sequences per forward (library scorer)")
        s.add_argument("--limit", type=int, default=None)
    for name in ("adapters", "bench-adapters"):
        s = sub.add_parser(name)
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--max-tokens", type=int, default=128, help="passage tokens per training sample")
        if name == "adapters":
            s.add_argument("--group", type=int, default=None,
                           help="adapters trained together (default: the faster way bench-adapters measured)")
            s.add_argument("--block", type=int, default=96, help="items sorted by length within blocks of this size")
            s.add_argument("--limit", type=int, default=None)
        else:
            s.add_argument("--n", type=int, default=12)
            s.add_argument("--groups", type=int, nargs="+", default=[1, 12])
            s.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    setup_logging()
    {"prepare": cmd_prepare, "freeze": cmd_freeze, "adapters": cmd_adapters,
     "bench-adapters": cmd_bench_adapters,
     "pipeline": cmd_pipeline, "labels": cmd_labels, "status": cmd_status,
     "grids": cmd_grids, "eval": cmd_eval, "train": cmd_train, "analysis": cmd_analysis,
     "curve": cmd_curve, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
