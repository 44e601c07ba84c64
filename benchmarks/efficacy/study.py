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


def cmd_train_jobs(a: argparse.Namespace) -> None:
    from fcprag_plugin.encoding import TextEncoder

    from jobs import train_jobs

    emb = load_emb()
    enc = TextEncoder()
    jobs = train_jobs(all_rows(), emb, enc.dim, enc.name)
    write_jsonl(Path(a.out), jobs)
    print(f"{len(jobs)} train jobs, {sum(len(j['rows']) for j in jobs)} rows -> {a.out}")


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def adapter_plan() -> tuple[list[tuple[str, str]], dict[str, dict[str, dict[str, Any]]]]:
    """Every adapter the study needs in priority order (``adapters.study_order``) and the augmentations."""
    import adapters

    retrieval = {ds: read_jsonl(cache_dir(ds) / "retrieval.jsonl") for ds in DATASETS}
    augs = adapters.load_augs(list(DATASETS))
    order = adapters.study_order(retrieval, top=3)
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
    per_ds = [[r for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl") if r["split"] == "train"] for ds in DATASETS]
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
    from batch_scorer import Job
    from common import load_model

    _threads(a.threads)
    questions = train_questions_in_order()
    done_res = {ds: scored(cache_dir(ds) / "results_train.jsonl") for ds in DATASETS}
    done_ad = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    todo, waiting = pending_label_jobs(questions, done_res, done_ad)
    if a.limit is not None:
        todo = todo[:a.limit]
    print(f"labels: {len(questions)} training questions, {len(todo)} to score now, {waiting} wait for adapters "
          f"(scorer: {scoring.scorer_name()})", flush=True)
    if todo:
        model, tok = load_model(adapters.DTYPE)
        t_all, n_rows = time.perf_counter(), 0
        slot = None
        for s in range(0, len(todo), a.questions):
            t0 = time.perf_counter()
            chunk = todo[s:s + a.questions]
            jobs = [Job.from_dict(j).encode(tok) for j in chunk]
            store = load_store([(j["key"].split("|")[0], p) for j in chunk for p in j["pids"]])
            if slot is None:
                slot = scoring.make_slot(model, store, max_adapters=6 * a.questions)
            res = scoring.score_jobs(model, tok, slot, jobs, store, batch_size=a.batch_size)
            for ds in DATASETS:
                mine = [r for r in res if r["key"].startswith(ds + "|")]
                if mine:
                    append_jsonl(cache_dir(ds) / "results_train.jsonl", mine)
            n_rows += len(res)
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} labels: {s + len(chunk)}/{len(todo)} questions, "
                  f"{len(res) / (time.perf_counter() - t0):.2f} rows/s", flush=True)
        secs = time.perf_counter() - t_all
        append_jsonl(STUDY_TIMINGS, [{"stage": "labels", "seconds": round(secs, 1), "questions": len(todo),
                                      "rows": n_rows, "rows_per_s": round(n_rows / secs, 3), "threads": a.threads,
                                      "scorer": scoring.scorer_name(), "nice": os.nice(0),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}])
    print(f"labels: records written {write_labels()}", flush=True)


def cmd_status(a: argparse.Namespace) -> None:
    """Progress of every stage, the measured rates and the projected time left (reads the caches only)."""
    import os
    from datetime import datetime, timezone

    import adapters

    order, _ = adapter_plan()
    done = {ds: adapters.done_adapters(ds) for ds in DATASETS}
    tiers = {"test top-3": 0, "train top-6": 0, "test rest": 0}
    top = {(ds, p["pid"]): r["split"] == "test" and p["rank"] < 3
           for ds in DATASETS for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl") for p in r["passages"]}
    train = {(ds, p["pid"]) for ds in DATASETS for r in read_jsonl(cache_dir(ds) / "retrieval.jsonl")
             if r["split"] == "train" for p in r["passages"]}
    need = dict.fromkeys(tiers, 0)
    for it in order:
        t = "test top-3" if top[it] else "train top-6" if it in train else "test rest"
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
    print(json.dumps({
        "now_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "pipeline_running": alive, "pid": pid_file.read_text().strip() if pid_file.exists() else None,
        "adapters_done": {t: f"{tiers[t]}/{need[t]}" for t in tiers},
        "adapters_per_s_last_20_groups": round(rate, 4) if rate else None,
        "adapters_hours_left_at_that_rate": round(left / rate / 3600, 2) if rate else None,
        "labels_questions_done": f"{labelled}/{len(questions)}",
    }, indent=2))


PIPELINE = ("bench-adapters", "adapters", "labels")  # stages run by 'pipeline', in order (later stages are added as they are written)


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
    s = sub.add_parser("train-jobs")
    s.add_argument("--out", default=str(WORK / "jobs_train.jsonl"))
    s = sub.add_parser("pipeline")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--after", default=None, help="continue after this stage (default: from the first)")
    sub.add_parser("status")
    s = sub.add_parser("labels")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--questions", type=int, default=4, help="training questions per scoring call")
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
    {"prepare": cmd_prepare, "train-jobs": cmd_train_jobs, "adapters": cmd_adapters,
     "bench-adapters": cmd_bench_adapters,
     "pipeline": cmd_pipeline, "labels": cmd_labels, "status": cmd_status}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
