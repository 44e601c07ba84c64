"""Rows of one question whose passages, prompt and weights equal another row's are scored once and recorded under
both names; the copies equal the rows scored on their own."""

from __future__ import annotations

import json

import pytest

from fcprag_plugin.slot import FusedSlot
from fcprag_tools.study import StudyOptions, scoring
from fcprag_tools.study import adapters as ad
from fcprag_tools.study.pipeline import study
from fcprag_tools.study.run import StudyRun
from fcprag_tools.study.stages.evaluation import share
from fcprag_tools.study.stages.translator import DypragSource
from helpers import hash_encoder

from .conftest import REAL_SCORE


def _row(qid, name, w, prompt="param"):
    return scoring.Row(qid, name, ["p0", "p1"], w, prompt)


def test_share_pairs_rows_equal_to_the_last_bit_only():
    done = {"q|prag_sum": {"id": "q|prag_sum", "prompt": "param", "pids": ["p0", "p1"], "w": [1.0, 1.0]},
            "q|learned": {"id": "q|learned", "prompt": "param", "pids": ["p0", "p1"], "w": [0.333333, 1.666667]}}
    third = 1 / 3
    rows = [_row("q", "random_controller", [1.0, 1.0]), _row("q", "prag_sum_combine", [1.0, 1.0], "combine"),
            _row("q", "a", [third, 2 - third]), _row("q", "b", [third, 2 - third]),
            _row("q", "c", [third + 1e-16, 2 - third]), _row("r", "prag_sum", [1.0, 1.0])]
    todo, copies = share(rows, done)
    # 1/3 is not its recorded rounding: it shares no record, but an equal row of the same call
    assert [r.name for r in todo] == ["prag_sum_combine", "a", "c", "prag_sum"]
    assert [(r.name, o) for r, o in copies] == [("random_controller", "prag_sum"), ("b", "a")]


def test_equal_rows_are_scored_once_and_equal_their_separate_scoring(tiny_study, scored_rows):
    scored, real = scored_rows, REAL_SCORE
    opts = StudyOptions.of(questions=tiny_study["questions"], model=tiny_study["model"],
                           out=str(tiny_study["root"] / "o"), encoder=hash_encoder(), top_k=2, scales=(0.5, 2.0),
                           max_new_tokens=3, aug_max_new_tokens=6, progress=False, test_fraction=0.5, group=2, chunk=2,
                           arrow=False, epochs=2)
    s, _ = study(opts)  # two passages: the average's weights are scale 0.5's
    out = tiny_study["root"] / "o"
    ev = {json.loads(x)["id"]: json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()}
    qs = {json.loads(x)["id"]: json.loads(x) for x in (out / "questions.jsonl").read_text().splitlines()}
    test = [q for q in qs if qs[q]["split"] == "test"]
    copies = {i: r for i, r in ev.items() if "shared_with" in r}
    assert all(copies[f"{q}|scale:0.5"]["shared_with"] == "average" for q in test)
    assert len(scored) == len(set(scored)) == len(ev) - len(copies) and not set(scored) & set(copies)
    assert s["shared_rows"]["scale:0.5"] == {"average": len(test)}
    assert s["shared_rows"] == {n: {o: sum(1 for i, r in copies.items() if i.endswith(f"|{n}")
                                           and r["shared_with"] == o)} for n, o in
                                {(i.split("|")[1], r["shared_with"]) for i, r in copies.items()}}

    run = StudyRun(out, progress=False, lm=opts.model)
    run.load_model()
    translator = json.loads((out / "translator" / "translator.json").read_text())
    source = DypragSource(run, qs, out / translator["export"], translator["sha256"])
    assert {copies[f"{q}|dyprag_recommended"]["shared_with"] for q in test} == {"dyprag"}  # PRAG's sum ships
    for rid, rec in copies.items():
        qid, name = rid.split("|", 1)
        assert {k: ev[f"{qid}|{rec['shared_with']}"][k] for k in ("prompt", "pids", "w", "translator")
                if k in rec} == {k: rec[k] for k in ("prompt", "pids", "w", "translator") if k in rec}
        assert name.startswith("dyprag") == rec["shared_with"].startswith("dyprag")  # never across the hosts
        slot = FusedSlot.for_model(run.model, run.adapter(rec["pids"][0]), max_adapters=2, max_rank=ad.LORA["r"])
        update = source.composite(rec["pids"], rec["w"]) if name.startswith("dyprag") else None
        try:
            alone = real(run.model, run.tok, slot, [scoring.Row(qid, name, rec["pids"], rec["w"], rec["prompt"],
                                                                update)],
                         qs, run.adapter, max_new_tokens=3, batch_size=1)[0]
        finally:
            slot.remove()
        assert alone["logprob"] == pytest.approx(rec["logprob"], abs=1e-4), rid
        assert {k: alone[k] for k in ("generation", "prediction", "f1", "em", "acc")} == \
            {k: rec[k] for k in ("generation", "prediction", "f1", "em", "acc")}, rid
    # fcprag report on the folder counts the copies as the study's own summary does: the same summary.json
    from fcprag_tools.cli import main

    assert main(["report", str(out)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["shared_rows"] == s["shared_rows"] != {}
    assert {k: v for k, v in again.items() if k != "stage_seconds"} == \
        {k: v for k, v in s.items() if k != "stage_seconds"}
