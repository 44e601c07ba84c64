"""Writes a question file in the ../shared/data schema from id files (JSON ``{"ids": [...]}``), in their order.
By default the remade controller's: the first study's 126 training questions, then 60 of `run_all`'s held-out
questions (30 HotpotQA, 30 2Wiki; `test_ids.json`).

    python benchmarks/efficacy/remake/make_questions.py ../shared/data OUT.jsonl [IDS.json ...]
"""

import argparse
import json
from pathlib import Path

here = Path(__file__).parent
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("data", type=Path, help="the folder of hotpotqa_dev_sample.jsonl and 2wiki_dev_sample.jsonl")
p.add_argument("out", type=Path, help="question file to write")
p.add_argument("ids", type=Path, nargs="*", default=[here / "train_ids.json", here / "test_ids.json"])
a = p.parse_args()
rows = {}
for name in ("hotpotqa_dev_sample", "2wiki_dev_sample"):
    for line in (a.data / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
        rows[json.loads(line)["id"]] = line
ids = [i for f in a.ids for i in json.loads(f.read_text())["ids"]]
a.out.write_text("".join(rows[i] + "\n" for i in ids), encoding="utf-8")
print(f"{a.out}: {len(ids)} questions")
