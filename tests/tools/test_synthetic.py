"""``write_labels``: records written as a label file read back as the same records."""

import json

from fcprag_plugin.labels import load_labels
from fcprag_tools.synthetic import write_labels


def test_write_labels_round_trip(tmp_path):
    objs = [{"id": "q0", "query": "question 0?", "passages": ["passage 0 a", "passage 0 b"], "deltas": [0.5, -0.25],
             "group": 7},
            {"id": "q1", "query": "question 1?", "passages": ["passage 1 a", "passage 1 b"], "metric_all": 1.0,
             "metric_without": [0.0, 1.0]}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    ls = load_labels(tmp_path / "a.jsonl")
    back = load_labels(write_labels(ls.records, tmp_path / "b.jsonl"))
    assert [(r.id, r.deltas, r.group, r.metric_all) for r in back] == \
           [(r.id, r.deltas, r.group, r.metric_all) for r in ls]
