"""Writes a question file in the ../shared/data schema from id files (JSON ``{"ids": [...]}``), in their order.
By default the remade controller's: the first study's 126 training questions, then 60 of `run_all`'s held-out
questions (30 HotpotQA, 30 2Wiki; `test_ids.json`).

    python benchmarks/efficacy/remake/make_questions.py ../shared/data OUT.jsonl [IDS.json ...]
"""

import json
import sys
from pathlib import Path

here = Path(__file__).parent
data, out = Path(sys.argv[1]), Path(sys.argv[2])
files = [Path(f) for f in sys.argv[3:]] or [here / "train_ids.json", here / "test_ids.json"]
rows = {}
for name in ("hotpotqa_dev_sample", "2wiki_dev_sample"):
    for line in (data / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
        rows[json.loads(line)["id"]] = line
ids = [i for f in files for i in json.loads(f.read_text())["ids"]]
out.write_text("".join(rows[i] + "\n" for i in ids), encoding="utf-8")
print(f"{out}: {len(ids)} questions")
