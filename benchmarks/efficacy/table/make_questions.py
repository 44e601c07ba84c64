"""Writes the paper-table study's two question files (``hotpotqa.jsonl``, ``2wiki.jsonl``, the ../shared/data
schema) and ``ids.json``: 100 questions from each dataset that no earlier study of the project trained on.

Left out: every id in a committed training set (the first study's label files, the v1 200-question study's
training manifest, both committed controllers' ``train_question_ids.json``, the remake's ``train_ids.json``) and
the two 48-question CPU studies of docs/results/study-cpu-smollm2.md (drawn with ``random.Random(35)`` and
``random.Random(36)``; every plausible reading of that draw is left out). From the rest, per dataset,
``random.Random(39).sample`` of the ids sorted ascending.

    python benchmarks/efficacy/table/make_questions.py ../shared/data OUTDIR
"""

import argparse
import json
import random
import re
from pathlib import Path

here = Path(__file__).parent
eff = here.parent
TRAINED = [eff / "cache/trained_ids.json", eff / "controller/train_question_ids.json", eff / "remake/train_ids.json"]
FILES = {"hotpotqa": "hotpotqa_dev_sample", "2wiki": "2wiki_dev_sample"}
PER_DATASET = 100

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("data", type=Path, help="the folder of hotpotqa_dev_sample.jsonl and 2wiki_dev_sample.jsonl")
p.add_argument("out", type=Path, help="folder to write hotpotqa.jsonl and 2wiki.jsonl into")
a = p.parse_args()

lines = {k: [ln for ln in (a.data / f"{f}.jsonl").read_text(encoding="utf-8").splitlines() if ln.strip()]
         for k, f in FILES.items()}
ids = {k: [json.loads(ln)["id"] for ln in v] for k, v in lines.items()}
every = {i for v in ids.values() for i in v}
out_ids = set()
for f in TRAINED:
    out_ids |= set(re.findall(r"[0-9a-f]{32}|[0-9a-f]{24}", f.read_text(encoding="utf-8"))) & every
for seed in (35, 36):  # the CPU studies: 32 HotpotQA + 16 2Wiki, one generator or one per file, rows or ids
    for shared in (True, False):
        rng = random.Random(seed)
        for k, n in (("hotpotqa", 32), ("2wiki", 16)):
            rng = rng if shared else random.Random(seed)
            state = rng.getstate()
            for pool in (ids[k], sorted(ids[k])):
                rng.setstate(state)
                out_ids |= set(rng.sample(pool, n))
chosen = {}
for k in FILES:
    pool = sorted(i for i in ids[k] if i not in out_ids)
    chosen[k] = random.Random(39).sample(pool, PER_DATASET)
    keep = set(chosen[k])
    a.out.mkdir(parents=True, exist_ok=True)
    rows = {json.loads(ln)["id"]: ln for ln in lines[k]}
    (a.out / f"{k}.jsonl").write_text("".join(rows[i] + "\n" for i in chosen[k]), encoding="utf-8")
    print(f"{a.out / (k + '.jsonl')}: {len(keep)} of {len(pool)} questions never trained on")
(here / "ids.json").write_text(json.dumps({"left_out": len(out_ids), "ids": chosen}, indent=1) + "\n")
