"""A finished study run again: only the rows it lacks are scored (then the report is rebuilt); with none
lacking, the recorded summary answers without a model."""

from __future__ import annotations

import json

import pytest

from fcprag_tools.lm import model_io
from fcprag_tools.study import StudyOptions, scoring
from fcprag_tools.study.pipeline import study
from helpers import hash_encoder

FAST = dict(top_k=2, max_new_tokens=3, aug_max_new_tokens=6, progress=False, test_fraction=0.5, group=2, chunk=1,
            epochs=2)


def _opts(t, **kw):
    return StudyOptions.of(questions=t["questions"], model=t["model"], out=str(t["root"] / "out"),
                           encoder=hash_encoder(), **{**FAST, **kw})


def _no_model(*a, **k):
    raise AssertionError("a study with nothing to add loaded a model")


def test_a_rerun_scores_only_the_rows_it_lacks_and_keeps_the_old_ones(tiny_study, monkeypatch):
    first, complete = study(_opts(tiny_study, scales=(2.0,), arrow=False))
    assert not complete and "scale:3" not in first["methods"] and first["settings"]["arrow"] == "--no-arrow"
    out = tiny_study["root"] / "out"
    before = (out / "eval.jsonl").read_bytes()
    test = [json.loads(x)["id"] for x in (out / "questions.jsonl").read_text().splitlines()
            if json.loads(x)["split"] == "test"]
    calls: list[list[str]] = []
    for name in ("score", "score_arrow_rows"):
        real = getattr(scoring, name)

        def counted(*a, _real=real, **k):
            res = _real(*a, **k)
            calls.append([r["id"] for r in res])
            return res
        monkeypatch.setattr(scoring, name, counted)

    again, complete = study(_opts(tiny_study, scales=(2.0, 3.0), arrow=True))  # a new scale and the Arrow row
    after = (out / "eval.jsonl").read_bytes()
    assert not complete and after.startswith(before)  # the old rows byte for byte
    added = [json.loads(x)["id"] for x in after[len(before):].decode().splitlines()]
    lacking = sorted(f"{q}|{n}" for q in test for n in ("scale:3", "arrow"))
    assert sorted(added) == lacking and sorted(i for c in calls for i in c) == lacking
    assert {"scale:2", "scale:3", "arrow"} <= set(again["methods"]) and again["settings"]["arrow"] == "scored"
    assert again["methods"]["prag_sum"] == first["methods"]["prag_sum"]
    assert json.loads((out / "summary.json").read_text()) == again

    monkeypatch.setattr(model_io, "load_model", _no_model)
    for kw in (dict(scales=(2.0, 3.0), arrow=True), dict(scales=(3.0,), arrow=False)):  # nothing to add
        res, complete = study(_opts(tiny_study, **kw))
        assert complete and res == again, kw
    assert (out / "eval.jsonl").read_bytes() == after


def test_another_scale_is_refused_while_the_study_still_makes_labels(tiny_study, monkeypatch):
    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.study.stages import controllers

    def stop(*a, **k):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(controllers, "train", stop)
        with pytest.raises(KeyboardInterrupt):
            study(_opts(tiny_study, scales=(2.0,)))
    with pytest.raises(FcpragError, match=r"scales=\[2\.0\], not \[2\.0, 3\.0\]"):
        study(_opts(tiny_study, scales=(2.0, 3.0)))
