"""Writes this study's questions and seeds its folder from the committed table study (README's deviation 1).

Per dataset, the first ``PER`` training and the first ``PER`` held-out questions of ``../table/questions.jsonl.gz``
(file order; position only, chosen before any result), their split kept: ``OUT/{hotpotqa,2wiki}.jsonl`` (the lines
of ``make_questions.py``'s files, in their order) and ``OUT/train_ids.json`` for ``--train-ids``. With ``--seed-eval
STUDY``: the table study's ``eval.jsonl`` rows of these questions are written to ``STUDY/eval.jsonl`` (a folder the
study has started, so that it holds its ``settings.json``), but for the ``prag_sum`` rows of the first 5 held-out
questions of each dataset, written to ``STUDY/heldback_prag_sum.jsonl`` for the reproducibility check.

    python benchmarks/efficacy/dyprag/select_questions.py runs/table-q runs/dyq [--seed-eval runs/dyprag-table]
"""

import argparse
import gzip
import json
from pathlib import Path

PER, HELD_BACK = 20, 5
TABLE = Path(__file__).parent.parent / "table"
DATASETS = ("hotpotqa", "2wiki")

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("table_q", type=Path, help="the folder make_questions.py wrote (hotpotqa.jsonl, 2wiki.jsonl)")
p.add_argument("out", type=Path, help="folder for this study's question files and train_ids.json")
p.add_argument("--seed-eval", type=Path, help="a started study's folder: copy the table study's rows into it")
a = p.parse_args()

table = [json.loads(ln) for ln in gzip.open(TABLE / "questions.jsonl.gz", "rt", encoding="utf-8")]
first = {(ds, sp): [q["id"] for q in table if q["dataset"] == ds and q["split"] == sp][:PER]
         for ds in DATASETS for sp in ("train", "test")}
pick = {i for ids in first.values() for i in ids}
a.out.mkdir(parents=True, exist_ok=True)
for ds in DATASETS:
    lines = [ln for ln in (a.table_q / f"{ds}.jsonl").read_text(encoding="utf-8").splitlines()
             if ln.strip() and json.loads(ln)["id"] in pick]
    (a.out / f"{ds}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
train = sorted(i for ds in DATASETS for i in first[(ds, "train")])
(a.out / "train_ids.json").write_text(json.dumps({"ids": train}, indent=1) + "\n", encoding="utf-8")
print(f"{a.out}: {len(pick)} questions, {len(train)} training")
if a.seed_eval:
    held = {i for ds in DATASETS for i in first[(ds, "test")][:HELD_BACK]}
    seed, back = [], []
    for ln in gzip.open(TABLE / "eval.jsonl.gz", "rt", encoding="utf-8"):
        qid, name = json.loads(ln)["id"].split("|", 1)
        if qid in pick:
            (back if qid in held and name == "prag_sum" else seed).append(ln.rstrip("\n") + "\n")
    (a.seed_eval / "eval.jsonl").write_text("".join(seed), encoding="utf-8")
    (a.seed_eval / "heldback_prag_sum.jsonl").write_text("".join(back), encoding="utf-8")
    print(f"{a.seed_eval}: {len(seed)} rows seeded, {len(back)} held back")
