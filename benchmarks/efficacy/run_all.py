"""Evaluate a controller on any question file in the ``../shared/data`` schema, end to end, on the CPU.

    python benchmarks/efficacy/run_all.py --data FILE --controller DIR --out WORKDIR [--limit N]

Questions the controller was trained on (``<controller>/train_question_ids.json``, ``{"ids": [...]}``) are left
out before ``--limit`` counts, so the evaluation is held out; ``--keep-trained`` keeps them.

Stages (each resumable: what WORKDIR already holds is kept; wall-clock per stage in ``WORKDIR/timings.jsonl``):
1. BM25 top-``--top-k`` of each question over its own passages (``prepare.retrieval``; every question is held out)
   -> ``retrieval.jsonl``;
2. the documented deterministic augmentation (``prepare.augmentation``) -> ``augment.jsonl``;
3. one PRAG-recipe adapter per retrieved passage (``adapters.build``: LoRA r 2, alpha 32, gate/up/down_proj,
   AdamW lr 3e-4, 1 epoch) -> ``adapters/<pid>/`` and ``adapters.jsonl`` (steps, losses);
4. per question, ``--prompt`` (``param``, the default, or ``combine``), gold answer's mean token log-likelihood
   with the BM25 top-k merged by: ``prag_sum`` (w~ = 1), ``average`` (1/N), ``learned`` (the controller),
   ``learned_same_total`` (every passage at the mean of the learned weights: its scale without its reweighting),
   the ``loo:i`` rows and the leave-one-out ``oracle`` (reads the answer: a reference) -> ``eval.jsonl``
   (appended per batch of questions; adapters and rows already scored are reused across prompts);
5. ``summary.json`` (``summary_combine.json`` for ``--prompt combine``): ``{"n_questions", "methods": {name:
   {"gold_loglik"}}, "paired": {name: {"delta_loglik", "ci95", "against": "prag_sum"}}, "settings"}``
   (paired bootstrap over questions, 2,000 resamples).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import append_jsonl, read_jsonl, setup_logging, write_json  # noqa: E402


def _fail(msg: str) -> None:
    print(f"run_all.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _timed(out: Path, stage: str, t0: float, **info: Any) -> None:
    append_jsonl(out / "timings.jsonl", [{"stage": stage, "seconds": round(time.perf_counter() - t0, 1),
                                          "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}])


def _trained_ids(ctrl_dir: Path) -> frozenset[str]:
    """The controller's training question ids (empty when the folder does not record them)."""
    path = ctrl_dir / "train_question_ids.json"
    if not path.is_file():
        return frozenset()
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))["ids"]
    except (ValueError, KeyError, TypeError) as e:
        _fail(f"{path}: cannot read it ({type(e).__name__}: {e}); expected {{\"ids\": [question id, ...]}}")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        _fail(f"{path}: 'ids' must be a list of question id strings")
    return frozenset(ids)


def _with_same_total(method: Any) -> Any:
    """Adds ``learned_same_total``: every passage at the learned weights' mean, i.e. the controller's total scale
    without its reweighting between passages (separates "how much" from "which")."""
    def fn(r: dict[str, Any], ps: list[dict[str, Any]]) -> dict[str, list[float]]:
        w = method(r, ps)["learned"]
        return {"learned": w, "learned_same_total": [sum(w) / len(w)] * len(w)}
    return fn


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    import adapters
    import heldout
    import prepare
    import scoring
    from batch_scorer import Job
    from jobs import test_jobs

    data, ctrl_dir, out = Path(a.data), Path(a.controller), Path(a.out)
    if not data.is_file():
        _fail(f"--data {data}: file not found; expected a JSON Lines question file in the ../shared/data schema")
    if not (ctrl_dir / "config.json").is_file():
        _fail(f"--controller {ctrl_dir}: no config.json there; expected a saved controller folder")
    if a.limit is not None and a.limit < 1:
        _fail(f"--limit {a.limit}: expected a positive number of questions")
    trained = frozenset() if a.keep_trained else _trained_ids(ctrl_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    name = data.stem

    t0 = time.perf_counter()
    left_out = sum(r.get("id") in trained for r in read_jsonl(data)) if trained else 0
    if left_out:
        print(f"run_all.py: leaving out {left_out} question(s) of {data} that the controller was trained on "
              f"(--keep-trained keeps them)", file=sys.stderr)
    rows = prepare.retrieval(data, out / "retrieval.jsonl", 1.0, a.top_k, limit=a.limit, dataset=name,
                             exclude=trained)
    for r in rows:
        r["split"] = "test"  # every question of the file is held out
    _timed(out, "retrieve", t0, questions=len(rows), top_k=a.top_k)
    t0 = time.perf_counter()
    augs = {name: {x["pid"]: x for x in prepare.augmentation(rows, out / "augment.jsonl")}}
    _timed(out, "augment (deterministic)", t0, passages=len(augs[name]))

    from common import load_model

    t0 = time.perf_counter()
    model, tok = load_model(adapters.DTYPE)
    _timed(out, "load model", t0, dtype=adapters.DTYPE)
    done = adapters.done_adapters(name, out)
    todo = [(name, pid) for pid in dict.fromkeys(p["pid"] for r in rows for p in r["passages"]) if pid not in done]
    if todo:
        t0 = time.perf_counter()
        adapters.build(todo, augs, a.group, len(todo), 1, a.max_tokens, model=model, tok=tok, root=out)
        _timed(out, "adapters", t0, adapters=len(todo), group=a.group, max_tokens=a.max_tokens)

    from fcprag_plugin import FusionController, LoraAdapter
    from fcprag_plugin.encoding import TextEncoder
    from fcprag_plugin.errors import FcpragError

    store = {pid: LoraAdapter.from_pretrained(out / "adapters" / pid) for pid in augs[name]}
    try:
        ctrl = FusionController.from_pretrained(ctrl_dir).eval()
        enc = TextEncoder()
        method = _with_same_total(heldout.controller_method("learned", ctrl, enc, store))
        jobs, meta = test_jobs(rows, method, generate_conditions=(), conditions=("clean",), modes=(a.prompt,),
                               top=a.top_k)
    except FcpragError as e:
        _fail(f"--controller {ctrl_dir}: {e}")
    res_path = out / "eval.jsonl"
    have = heldout.per_question(read_jsonl(res_path)) if res_path.exists() else {}
    todo_jobs = [j for j in jobs if not set(j["rows"]) <= set(have.get(j["key"], {}))]
    t0 = time.perf_counter()
    slot = scoring.make_slot(model, store, max_adapters=a.top_k * a.questions)
    meta_by = {f"{m['dataset']}|{m['id']}|{m['condition']}|{a.prompt}": m for m in meta}
    for s in range(0, len(todo_jobs), a.questions):
        chunk = [Job.from_dict(j).encode(tok) for j in todo_jobs[s:s + a.questions]]
        res = scoring.score_jobs(model, tok, slot, chunk, store)
        by = heldout.per_question(res)
        oracle = [heldout.oracle_job(j, meta_by[j.key]["positions"], by[j.key]) for j in chunk]
        res += scoring.score_jobs(model, tok, slot, oracle, store)
        append_jsonl(res_path, res)
    slot.remove()
    if todo_jobs:
        _timed(out, "evaluate", t0, questions=len(todo_jobs), scorer=scoring.scorer_name())
    table = heldout.per_question(read_jsonl(res_path))
    keys = {j["key"] for j in jobs}
    summary = heldout.summarise({k: v for k, v in table.items() if k in keys})
    summary["settings"] = {"data": str(data), "controller": str(ctrl_dir), "limit": a.limit, "top_k": a.top_k,
                           "prompt": a.prompt, "condition": "clean", "max_tokens": a.max_tokens,
                           "adapter_dtype": adapters.DTYPE, "scorer": scoring.scorer_name(),
                           "threads": a.threads, "left_out_trained": left_out}
    write_json(out / ("summary.json" if a.prompt == "param" else f"summary_{a.prompt}.json"), summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="question file (JSON Lines, ../shared/data schema)")
    p.add_argument("--controller", required=True, help="saved controller folder (config.json + weights)")
    p.add_argument("--out", required=True, help="work folder (created; reused to resume)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N questions (counted after leaving out trained ones)")
    p.add_argument("--keep-trained", action="store_true",
                   help="keep the questions listed in <controller>/train_question_ids.json")
    p.add_argument("--prompt", choices=("param", "combine"), default="param",
                   help="param: the question alone; combine: the passages in the prompt as well "
                        "(writes summary_combine.json)")
    p.add_argument("--top-k", type=int, default=3, help="passages merged per question (BM25 top-k)")
    p.add_argument("--max-tokens", type=int, default=128, help="passage tokens per adapter training sample")
    p.add_argument("--group", type=int, default=12, help="adapters trained together")
    p.add_argument("--questions", type=int, default=8, help="questions per scoring call")
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    a = p.parse_args(argv)
    setup_logging()
    summary = run(a)
    print(json.dumps({k: summary[k] for k in ("n_questions", "methods", "paired")}, indent=2))


if __name__ == "__main__":
    main()
