"""Measured scales for the training labels: each training question's BM25 top-3, merged as PRAG's sum times s.

    python benchmarks/efficacy/scales.py measure [--grid 0.5,1.5,2,3,4,6,8]   # gold log-lik. per (question, s)
    python benchmarks/efficacy/scales.py attach LABELS                          # add scales to LABELS in place

``measure`` scores, for each of the study's 126 training questions (``cache/scope.json``), the top-3 triple
(``s:012``) at scale 1 and at every grid scale (every ``w~_i = s``) with the study's scorer, on the adapters in
``work/train3/<dataset>/adapters/`` (PRAG's recipe, seeded by the passage: the same adapters the labels were made
with; rebuilt by the study's adapter stage), and appends ``{key, name, logprob}`` rows to
``cache/<dataset>/scales_train.jsonl`` (resumable). ``attach`` adds ``scales`` / ``metric_at_scales``
(``docs/label-format.md``) to the ``s:012`` records of a label file: ``metric_at_scales[j] = metric_all +
(m(s_j) - m(1))``, the gains measured on the rebuilt adapters added to the record's own ``metric_all`` (the
difference between the record's ``metric_all`` and the rebuilt adapters' ``m(1)`` is reported: the adapters'
reproducibility).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import HERE as ROOT, append_jsonl, read_jsonl, setup_logging  # noqa: E402

GRID = (0.5, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
DATASETS = ("hotpotqa", "2wiki")


def training_rows(ds: str) -> list[dict]:
    scope = json.loads((ROOT / "cache" / "scope.json").read_text(encoding="utf-8"))
    ids = set(scope["train_ids"][ds])
    return [r for r in read_jsonl(ROOT / "cache" / ds / "retrieval.jsonl") if r["id"] in ids]


def measure(grid: tuple[float, ...], questions: int = 8) -> None:
    import torch

    import adapters
    import scoring
    from batch_scorer import Job
    from common import load_model
    from fcprag_plugin import LoraAdapter

    torch.set_num_threads(1)
    model, tok = load_model(adapters.DTYPE)
    for ds in DATASETS:
        out = ROOT / "cache" / ds / "scales_train.jsonl"
        done = {(r["key"], r["name"]) for r in read_jsonl(out)} if out.exists() else set()
        root = ROOT / "work" / "train3" / ds / "adapters"
        jobs = []
        for r in training_rows(ds):
            top = r["passages"][:3]
            rows = {"scale:1": [1.0] * 3, **{f"scale:{s:g}": [s] * 3 for s in grid}}
            key = f"{ds}|{r['id']}|train|param"
            rows = {k: v for k, v in rows.items() if (key, k) not in done}
            if rows:
                jobs.append(Job(key, r["question"], r["answer"], [], "param", [p["pid"] for p in top], rows))
        store = {pid: LoraAdapter.from_pretrained(root / pid) for j in jobs for pid in j.pids}
        if not jobs:
            continue
        slot = scoring.make_slot(model, store, max_adapters=3 * questions)
        for s in range(0, len(jobs), questions):
            chunk = [j.encode(tok) for j in jobs[s:s + questions]]
            append_jsonl(out, scoring.score_jobs(model, tok, slot, chunk, store))
            print(f"{ds}: {min(s + questions, len(jobs))}/{len(jobs)} questions", flush=True)
        slot.remove()


def attach(labels: Path, grid: tuple[float, ...]) -> None:
    measured: dict[tuple[str, str], dict[str, float]] = {}
    for ds in DATASETS:
        for r in read_jsonl(ROOT / "cache" / ds / "scales_train.jsonl"):
            _, qid, _, _ = r["key"].split("|")
            measured.setdefault((ds, qid), {})[r["name"]] = r["logprob"]
    lines, drift = [], []
    for rec in read_jsonl(labels):
        ds, qid, *subset = rec["id"].split(":")
        m = measured.get((ds, qid))
        if ":".join(subset) == "s:012" and m is not None:
            rec["scales"] = list(grid)
            rec["metric_at_scales"] = [round(rec["metric_all"] + m[f"scale:{s:g}"] - m["scale:1"], 5) for s in grid]
            drift.append(abs(rec["metric_all"] - m["scale:1"]))
        lines.append(json.dumps(rec, ensure_ascii=False))
    labels.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{labels}: scales added to {len(drift)} records; |metric_all - m(1) of the rebuilt adapters| max "
          f"{max(drift):.2e}, mean {sum(drift) / len(drift):.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("measure", "attach"))
    p.add_argument("labels", nargs="?", help="attach: the label file to add scales to (in place)")
    p.add_argument("--grid", default=",".join(f"{s:g}" for s in GRID))
    a = p.parse_args()
    grid = tuple(float(x) for x in a.grid.split(","))
    setup_logging()
    if a.command == "measure":
        measure(grid)
    else:
        if not a.labels:
            p.error("attach needs LABELS")
        attach(Path(a.labels), grid)


if __name__ == "__main__":
    main()
