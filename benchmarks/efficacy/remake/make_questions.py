"""Writes the remade controller's question file: the first study's 126 training questions, then 60 of
`run_all`'s held-out questions (30 HotpotQA, 30 2Wiki; `test_ids.json`), in the ../shared/data schema.

    python benchmarks/efficacy/remake/make_questions.py ../shared/data OUT.jsonl
"""

import json
import sys
from pathlib import Path

here = Path(__file__).parent
data, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = {}
for name in ("hotpotqa_dev_sample", "2wiki_dev_sample"):
    for line in (data / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
        rows[json.loads(line)["id"]] = line
ids = [i for f in ("train_ids.json", "test_ids.json") for i in json.loads((here / f).read_text())["ids"]]
out.write_text("".join(rows[i] + "\n" for i in ids), encoding="utf-8")
print(f"{out}: {len(ids)} questions")
