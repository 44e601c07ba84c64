"""DyPRAG's rows in the verdict and the report (issue 51, part 3), against hand computations on synthetic study
folders: the plan's three comparisons and their level, the cosine summary, the cost's break-even, the fusion and the
ceiling over DyPRAG's LoRAs, DyPRAG's rows as candidates of what to run, its next step (DyPRAG's own script with the
study's exported translator), incomplete DyPRAG rows, the schema check, and the committed studies without DyPRAG
rows reported byte for byte as before."""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from fcprag_plugin.errors import FcpragError
from fcprag_tools.cli import build_parser, main
from fcprag_tools.study import dyprag as dy
from fcprag_tools.study import summary
from fcprag_tools.study.adapters import EPOCHS, LEARNING_RATE
from fcprag_tools.study.options import Policy
from fcprag_tools.study.verdict import dyprag_report, markdown, plot, words
from fcprag_tools.study.verdict.dyprag_section import cost, diversity, primary
from fcprag_tools.study.verdict.records import Comparison, ScoredRows
from fcprag_tools.study.verdict.schema import check_summary

from .test_summary import CV, SETTINGS_JSON, _ctrls, _cv, synthetic

ROOT = Path(__file__).resolve().parents[3]
SHA = "5e" * 32
EXPORT = "translator/projector/fcprag_hidden32/epoch_0.pt"
FLAGS = {"projector_path": "fcprag_hidden32", "inference_epoch": 1, "projector_p": 32, "lora_rank": 2,
         "lora_alpha": 32}
OWN = {"dyprag": "param", "dyprag_combine": "combine"}
FUSION = {"dyprag_recommended": "param", "dyprag_recommended_combine": "combine"}
GOLD = {"dyprag_gold_passages": "param", "dyprag_gold_passages_combine": "combine"}
# DyPRAG's src/inference_dyprag.py (its public argparse, read 2026-12-02): the flags it requires, and --lora_rank /
# --lora_alpha, which it asserts are given; their types as it parses them
DYPRAG_FLAGS = {"--model_name": str, "--max_new_tokens": int, "--dataset": str, "--num_train_epochs": int,
                "--inference_method": str, "--projector_p": int, "--inference_epoch": int, "--projector_path": str,
                "--lora_rank": int, "--lora_alpha": int}


def dyprag_parse(words_):
    p = argparse.ArgumentParser()
    for flag, kind in DYPRAG_FLAGS.items():
        p.add_argument(flag, type=kind, required=True)
    p.add_argument("--learning_rate", type=float, default=3e-4)
    return p.parse_args(words_)


def with_dyprag(qs, res, plant=None):
    """The synthetic study with DyPRAG's rows on every question (held out also the ceiling's twins), each a copy of
    PRAG's sum of its setting, then ``plant(res)`` edits them; passage ids on every question."""
    res = copy.deepcopy(res)
    for q, x in qs.items():
        x["passages"] = [{"pid": f"{q}p{j}"} for j in range(3)]
        names = {**OWN, **FUSION, **(GOLD if x["split"] == "test" else {})}
        for name, setting in names.items():
            host = "prag_sum" + ("" if setting == "param" else "_combine")
            res[f"{q}|{name}"] = {**res[f"{q}|{host}"], "id": f"{q}|{name}", "translator": SHA, "update": "dyprag"}
    if plant:
        plant(res)
    return qs, res


def write_folder(out, qs, *, source="trained", train_seconds=120.0, gen=None, prag=None, augment=((30.0, 200),),
                 cosines=None):
    """A study folder's DyPRAG files: ``gen`` / ``prag``: per held-out passage its generation / PRAG adapter seconds
    (default 0.05 / 2.0), ``augment``: the augmentation stage's ``(seconds, passages)`` lines, ``cosines``: per
    held-out question ``(dyprag, prag)`` (default 0.95 + i/1000, 0.1 + i/100)."""
    out.mkdir(parents=True, exist_ok=True)
    test = [q for q, x in qs.items() if x["split"] == "test"]
    held = [p["pid"] for q in test for p in qs[q]["passages"]]

    def lines(name, rows):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    lines("questions.jsonl", [{"id": q, **x} for q, x in qs.items()])
    (out / "translator").mkdir(exist_ok=True)
    training = {"seconds": train_seconds, "passages": 72, "steps": 72, "first_loss": 9.5, "last_loss": 3.25,
                "epoch_losses": [4.0]}
    (out / "translator" / "translator.json").write_text(json.dumps(
        {"source": source, "file": "/data/t.pt" if source == "given" else "translator/train/translator.pt",
         "sha256": SHA, "export": EXPORT, "dyprag_flags": FLAGS, "shape": {"rank": 2, "width": 32},
         "options": {"epochs": 1, "learning_rate": 1e-5, "width": 32} if source == "trained" else None,
         "training": training if source == "trained" else None}))
    gen = gen or {p: 0.05 for p in held}
    prag = prag or {p: 2.0 for p in held}
    lines("dyprag_generated.jsonl", [{"id": p, "seconds": s, "tokens": 12, "sha256": SHA} for p, s in gen.items()])
    lines("adapters.jsonl", [{"id": p, "group_seconds": 2 * s, "group": 2} for p, s in prag.items()])
    cosines = cosines or {q: (0.95 + i / 1000, 0.1 + i / 100) for i, q in enumerate(test)}
    lines("dyprag_cosine.jsonl", [{"id": q, "dyprag": c[0], "prag": c[1], "sha256": SHA} for q, c in cosines.items()])
    lines("timings.jsonl", [{"stage": "augment", "seconds": s, "passages": n} for s, n in augment])
    return out


def finish(out, qs, res, ctrls=None):
    """The summary stage on the folder ``out`` (its DyPRAG files as they are)."""
    return summary.finish(ScoredRows.from_dicts(qs, res), ctrls or _ctrls(CV), given=False, stage_seconds={},
                          out=out, policy=Policy(), settings={**SETTINGS_JSON, "out": str(out)})


def report(out, qs, res, ctrls=None, **folder):
    write_folder(out, qs, **folder)
    return finish(out, qs, res, ctrls)


def _test(qs):
    return [q for q, x in qs.items() if x["split"] == "test"]


def z(level, power=0.8):
    nd = statistics.NormalDist()
    return nd.inv_cdf(1 - (1 - level) / 2) + nd.inv_cdf(power)


def test_the_plans_three_comparisons_and_their_level_match_a_hand_computation(tmp_path):
    qs, res = synthetic()
    test = _test(qs)
    wave = {q: (0.3 if i % 2 == 0 else -0.1) for i, q in enumerate(test)}

    def plant(r):
        for q in test:  # dyprag: prag_sum + 0.1 F1 everywhere; vanilla: dyprag - 0.3 / + 0.1; Combine: a tie
            r[f"{q}|dyprag"]["f1"] = r[f"{q}|prag_sum"]["f1"] + 0.1
            r[f"{q}|vanilla"]["f1"] = r[f"{q}|dyprag"]["f1"] - wave[q]
            r[f"{q}|dyprag_combine"]["f1"] = r[f"{q}|standard_rag"]["f1"]
            r[f"{q}|dyprag"]["logprob"] = r[f"{q}|prag_sum"]["logprob"] - 0.2

    qs, res = with_dyprag(qs, res, plant)
    s = report(tmp_path, qs, res)
    p = s["dyprag"]["primary"]
    level = 1 - 0.05 / 3
    assert (p["n"], p["n_comparisons"], p["not_made"]) == (40, 3, {}) and p["level"] == pytest.approx(level)
    vs_sum, vs_none, vs_rag = p["comparisons"]
    assert [(c["row"], c["against"]) for c in p["comparisons"]] == [
        ("dyprag", "prag_sum"), ("dyprag", "vanilla"), ("dyprag_combine", "standard_rag")]
    # a constant lead: every resample's mean is +0.1, and so is each end of the interval
    assert vs_sum["delta_f1"] == pytest.approx(0.1) and vs_sum["ci_f1"] == pytest.approx([0.1, 0.1])
    assert vs_sum["reading"] == "better" and vs_sum["mde_f1"] == pytest.approx(0, abs=1e-9)  # no spread
    assert vs_sum["delta_logprob"] == pytest.approx(-0.2) and vs_sum["ci_logprob"] == pytest.approx([-0.2, -0.2])
    # +0.3 / -0.1 alternately: mean 0.1; the 98.33% percentile interval is about the normal one (an independent
    # reference), and the smallest detectable difference the paired normal formula at that level
    d = list(wave.values())
    half = statistics.NormalDist().inv_cdf(1 - 0.05 / 6) * statistics.pstdev(d) / math.sqrt(40)
    assert vs_none["delta_f1"] == pytest.approx(0.1) and vs_none["ci_f1"] == pytest.approx([0.1 - half, 0.1 + half],
                                                                                          abs=0.015)
    assert vs_none["mde_f1"] == pytest.approx(z(level) * statistics.stdev(d) / math.sqrt(40))
    assert vs_none["n_needed"] == math.ceil((z(level) * statistics.stdev(d) / 0.03) ** 2)
    assert vs_rag["reading"] == "tie" and vs_rag["n_nonzero"] == 0
    text = (tmp_path / "report.md").read_text()
    assert "98.33% intervals: 0.05 split (Bonferroni) over the 3 comparisons made" in text
    assert "`dyprag` against `prag_sum` +10.0 [+10.0, +10.0]: better, shown; gold log-lik. -0.2000 [-0.2000, " \
           "-0.2000]" in text
    assert vs_none["reading"] == "better" and (  # about [+2.4, +17.6]: above 0
        f"`dyprag` against `vanilla` +10.0 [{words.pts(vs_none['ci_f1'][0])}, {words.pts(vs_none['ci_f1'][1])}]: "
        "better, shown;") in text
    assert "`dyprag_combine` against `standard_rag` the same F1 on every one of the 40 questions (a tie)" in text
    # the minimum detectable effect the right way round where nothing is shown
    qs2, res2 = with_dyprag(*synthetic(seed=4))
    s2 = report(tmp_path / "b", qs2, res2)
    c = s2["dyprag"]["primary"]["comparisons"][1]
    assert c["reading"] == "not_shown"
    assert (f"only a true difference of about {100 * c['mde_f1']:.1f} points or more would have been detected with "
            "80% power") in (tmp_path / "b" / "report.md").read_text()


def test_a_comparison_shown_worse_is_shown_with_its_direction_in_words(tmp_path):
    """``shown``: the interval excludes 0 on either side; which side is the reading (``better`` / ``worse``)."""
    qs, res = synthetic()
    test = _test(qs)

    def plant(r):
        for q in test:  # dyprag: prag_sum - 0.1 F1 everywhere, vanilla + 0.1 over dyprag
            r[f"{q}|dyprag"]["f1"] = r[f"{q}|prag_sum"]["f1"] - 0.1
            r[f"{q}|vanilla"]["f1"] = r[f"{q}|dyprag"]["f1"] + 0.1

    s = report(tmp_path, *with_dyprag(qs, res, plant))
    vs_sum, vs_none, _ = s["dyprag"]["primary"]["comparisons"]
    for c in (vs_sum, vs_none):
        assert c["ci_f1"] == pytest.approx([-0.1, -0.1]) and c["reading"] == "worse" and c["shown"] is True
    text = (tmp_path / "report.md").read_text()
    assert "`dyprag` against `prag_sum` -10.0 [-10.0, -10.0]: worse, shown;" in text
    assert "`dyprag` against `vanilla` -10.0 [-10.0, -10.0]: worse, shown;" in text
    for reading, ci in (("better", [0.01, 0.2]), ("worse", [-0.2, -0.01]), ("tie", [0.0, 0.0]),
                        ("equivalent", [-0.01, 0.01]), ("not_shown", [-0.1, 0.2])):
        c = Comparison("prag_sum", reading, sum(ci) / 2, ci).to_json()
        assert c["shown"] is (reading in ("better", "worse")), reading


def test_the_level_counts_only_the_comparisons_made():
    qs, res = with_dyprag(*synthetic())
    rows = ScoredRows.from_dicts(qs, res)
    test = rows.test
    names = ["vanilla", "standard_rag", "prag_sum", "prag_sum_combine", "dyprag"]  # no dyprag_combine in the table
    p = primary(rows, test, names, Policy())
    assert p.n_comparisons == 2 and p.level == pytest.approx(1 - 0.05 / 2)
    assert [c.key for c in p.comparisons] == ["dyprag_vs_prag_sum", "dyprag_vs_vanilla"]
    assert p.not_made == {"dyprag_combine_vs_standard_rag": "`dyprag_combine` not measured on every held-out question"}
    for r in res.values():
        r["f1"] = None
    p = primary(ScoredRows.from_dicts(qs, res), test, names + ["dyprag_combine"], Policy())
    assert p.n_comparisons == 0 and set(p.not_made) == {"dyprag_vs_prag_sum", "dyprag_vs_vanilla",
                                                        "dyprag_combine_vs_standard_rag"}
    assert "--no-generate" in p.not_made["dyprag_vs_vanilla"]


def test_the_cosine_summary_by_hand(tmp_path):
    qs, res = with_dyprag(*synthetic())
    test = _test(qs)
    cos = {q: (i / 39, 0.9 + i / 390) for i, q in enumerate(test)}  # 0 .. 1 evenly over 40 questions
    write_folder(tmp_path, qs, cosines=cos)
    with open(tmp_path / "dyprag_cosine.jsonl", "a") as f:  # a training question's cosine, and another translator's
        f.write(json.dumps({"id": [q for q in qs if q not in test][0], "dyprag": 5.0, "prag": 5.0, "sha256": SHA}) +
                "\n")
        f.write(json.dumps({"id": test[1], "dyprag": 5.0, "prag": 5.0, "sha256": "other"}) + "\n")  # the last wins
    s = finish(tmp_path, qs, res)
    v = s["dyprag"]["diversity"]
    # test[1]'s cosine is another translator's: left out; the other 39 of i/39, i = 0, 2..39, by hand
    xs = sorted(i / 39 for i in range(40) if i != 1)
    q1, q3 = xs[9] + 0.5 * (xs[10] - xs[9]), xs[28] + 0.5 * (xs[29] - xs[28])  # inclusive: positions 9.5, 28.5
    assert v["dyprag"] == {"n": 39, "mean": pytest.approx(sum(xs) / 39), "median": pytest.approx(xs[19]),
                           "q1": pytest.approx(q1), "q3": pytest.approx(q3)}
    assert v["questions"] == 39 and v["parallel"] is False
    assert v["prag"]["median"] == pytest.approx(0.9 + 20 / 390)
    text = (tmp_path / "report.md").read_text()
    assert (f"DyPRAG's generated updates mean {sum(xs) / 39:.3f}, median {xs[19]:.3f} (quartiles {q1:.3f} to "
            f"{q3:.3f}, 39 questions)") in text
    assert "any weighting of them is close to a global scale of one update: DyPRAG's are not" in text
    write_folder(tmp_path, qs, cosines={q: (0.97, 0.2) for q in test})
    v = diversity(dy.dyprag_record(tmp_path))
    assert v["parallel"] is True and v["dyprag"]["median"] == pytest.approx(0.97)
    assert "DyPRAG's are (median at least 0.9), so a reweighting of its LoRAs has little to work with beyond that " \
           "scale" in dyprag_report.diversity_lines({"diversity": v, "why": None})[0]


def test_the_cost_and_its_break_even_by_hand(tmp_path):
    qs, res = with_dyprag(*synthetic())
    held = [p["pid"] for q in _test(qs) for p in qs[q]["passages"]]
    gen = {p: 0.04 + 0.01 * (i % 3) for i, p in enumerate(held)}  # median 0.05
    prag = {p: 1.5 + (i % 5) * 0.25 for i, p in enumerate(held)}  # median 2.0
    s = report(tmp_path, qs, res, gen=gen, prag=prag, augment=((20.0, 100), (12.0, 60)))
    c = s["dyprag"]["cost"]
    aug = 32.0 / 160  # the stage's seconds over its passages, summed over the two invocations
    assert (c["generation_seconds"], c["prag_seconds"]) == (pytest.approx(0.05), pytest.approx(2.0))
    assert c["augment_seconds"] == pytest.approx(aug) and c["train_seconds"] == 120.0
    assert c["break_even"] == math.ceil(120 / (2.0 - 0.05)) == 62  # passages, each saving PRAG's adapter
    assert c["break_even_with_augmentation"] == math.ceil(120 / (2.0 + aug - 0.05)) == 56
    assert (c["passages_generated"], c["prag_adapters"]) == (120, 120)
    text = (tmp_path / "report.md").read_text()
    assert "paid for itself after about 62 passages against the adapter training alone (56 counting the " \
           "augmentation)" in text and "Training the translator took 120.0 s" in text
    # a given translator: its training is not known here, so no break-even (the pure function on the folder's record)
    write_folder(tmp_path, qs, source="given", gen=gen, prag=prag)
    c = asdict(cost(dy.dyprag_record(tmp_path)))
    assert c["train_seconds"] is None and c["break_even"] is None and c["generation_seconds"] == pytest.approx(0.05)
    text = "\n".join(dyprag_report.cost_lines({"cost": c, "why": None}))
    assert "its seconds are not known here" in text and "paid for itself" not in text
    # generation dearer than a PRAG adapter: only the augmentation it skips pays for it
    write_folder(tmp_path, qs, gen={p: 0.5 for p in held}, prag={p: 0.4 for p in held}, augment=((60.0, 100),))
    c = asdict(cost(dy.dyprag_record(tmp_path)))
    assert c["break_even"] is None and c["break_even_with_augmentation"] == math.ceil(120 / (0.4 + 0.6 - 0.5))
    assert "counting the augmentation, the translator has paid for itself after about 240 passages" in \
        " ".join(dyprag_report.cost_lines({"cost": c, "why": None}))


def test_the_cost_reads_only_the_generation_seconds_of_the_studys_translator(tmp_path):
    """Another translator's timings (and lines without a translator's sha256) appended after the study's own never
    enter its cost."""
    qs, res = with_dyprag(*synthetic())
    held = [p["pid"] for q in _test(qs) for p in qs[q]["passages"]]
    write_folder(tmp_path, qs)
    with (tmp_path / "dyprag_generated.jsonl").open("a") as f:
        for p in held:
            f.write(json.dumps({"id": p, "seconds": 9.0, "tokens": 12, "sha256": "0f" * 32}) + "\n")
            f.write(json.dumps({"id": p, "seconds": 7.0, "tokens": 12}) + "\n")
    c = asdict(cost(dy.dyprag_record(tmp_path)))
    assert c["generation_seconds"] == pytest.approx(0.05) and c["passages_generated"] == len(held) == 120
    assert c["break_even"] == math.ceil(120 / (2.0 - 0.05))
    (tmp_path / "dyprag_generated.jsonl").write_text("".join(json.dumps({"id": p, "seconds": 0.05}) + "\n"
                                                             for p in held))
    c = asdict(cost(dy.dyprag_record(tmp_path)))  # a file from before the sha256 was written: no line read
    assert c["generation_seconds"] is None and c["passages_generated"] == 0
    text = " ".join(dyprag_report.cost_lines({"cost": c, "why": None}))  # no figure, and no claim made on none
    assert "generation seconds are not known" in text and "2.00 s of a PRAG adapter" in text
    assert "pays for itself" not in text and "saves no time" not in text


def test_the_fusion_and_the_ceiling_over_dyprags_loras(tmp_path):
    def plant(r):
        for k, row in r.items():
            q, name = k.split("|")
            if name in ("dyprag_recommended", "dyprag_gold_passages"):
                row["logprob"] = r[f"{q}|dyprag"]["logprob"] + (0.1 if name == "dyprag_recommended" else 0.4)

    qs, res = with_dyprag(*synthetic(), plant)
    scale = {"param": _cv((0.0, -0.01, 0.01), (0.2, 0.1, 0.3)), "combine": CV["combine"]}  # param ships x2
    s = report(tmp_path, qs, res, ctrls=_ctrls(scale))
    assert s["verdict"]["settings"]["param"]["ship"] == "scale_only"
    f, g = s["dyprag"]["fusion"]["param"], s["dyprag"]["ceiling"]["param"]
    assert (f["row"], f["against"], f["ship"], f["kappa"], f["same"]) == ("dyprag_recommended", "dyprag", "scale_only",
                                                                          2.0, False)
    assert f["delta_logprob"] == pytest.approx(0.1) and g["delta_logprob"] == pytest.approx(0.4)
    assert g["share"] == pytest.approx(0.25) and s["dyprag"]["fusion"]["combine"]["same"] is True
    assert s["paired"]["dyprag_recommended"]["against"] == "dyprag" == s["paired"]["dyprag_gold_passages"]["against"]
    assert s["paired"]["dyprag"]["against"] == "prag_sum" and s["paired"]["dyprag_combine"]["against"] == \
        "prag_sum_combine" and s["paired"]["dyprag_gold_passages_combine"]["against"] == "dyprag_combine"
    text = (tmp_path / "report.md").read_text()
    ceiling = text[text.index("## Ceiling"):text.index("## Every row")]
    assert "what ships is PRAG's sum times 2, which on DyPRAG's separate averages multiplies its update by 4 (kappa " \
           "acts squared)" in ceiling and "the fusion reaches 25.0% of it" in ceiling
    assert "what ships here is PRAG's sum, so this fusion is DyPRAG's own row" in ceiling  # combine
    assert re.search(r"\| dyprag_recommended \|[^\n]*\| dyprag \| \+0\.1000 \[\+0\.1000, \+0\.1000\] \|", text)
    lost = copy.deepcopy(s)  # a fusion below DyPRAG's row reaches none of a ceiling above it
    lost["dyprag"]["fusion"]["param"]["delta_logprob"], lost["dyprag"]["ceiling"]["param"]["share"] = -0.1, -0.25
    assert "the fusion reaches none of it" in " ".join(dyprag_report.ceiling_lines(lost))
    lost["dyprag"]["ceiling"] = {}  # no supporting titles: no ceiling row, and no word of one
    assert "supporting" not in " ".join(dyprag_report.ceiling_lines(lost))


def test_dyprags_rows_are_candidates_where_scored_and_compared_as_their_host_says(tmp_path):
    qs, res = synthetic()
    (tmp_path / "a").mkdir()
    plain_ = finish(tmp_path / "a", qs, res)  # no DyPRAG rows: none of DyPRAG's candidates, no section
    assert "dyprag" not in plain_ and not any(r.startswith("dyprag") for r in plain_["verdict"]["what_to_run"][
        "choice_f1"])
    train = [q for q in qs if q not in _test(qs)]

    def best(row):
        def plant(r):
            for q in qs:
                r[f"{q}|{row}"]["f1"] = 1.0  # the best on every question, training and held out
        return plant

    qs, res = with_dyprag(qs, res, best("dyprag"))
    s = report(tmp_path / "b", qs, res)
    w = s["verdict"]["what_to_run"]
    # param ships a network (its fusion a candidate); combine PRAG's sum (its fusion is DyPRAG's own row: not one)
    assert list(w["choice_f1"]) == ["vanilla", "standard_rag", "prag_sum", "prag_sum_combine", "recommended",
                                    "dyprag", "dyprag_combine", "dyprag_recommended"]
    assert w["row"] == "dyprag" and w["choice_f1"]["dyprag"] == 1.0 and w["n_choice"] == len(train)
    made = [(k, w[k]["row"]) for k in ("vs_standard_rag", "vs_prag_sum", "vs_host", "vs_runner_up") if k in w]
    ru = w["runner_up"]["row"]
    assert made == [("vs_standard_rag", "standard_rag"), ("vs_prag_sum", "prag_sum")] + (
        [] if ru in ("standard_rag", "prag_sum") else [("vs_runner_up", ru)])  # no host row: DyPRAG is its own
    assert [c["row"] for c in w["cheaper"]] == ["vanilla", "standard_rag"]  # cheaper than DyPRAG: no adapter at all
    text = (tmp_path / "b" / "report.md").read_text()
    assert "(`recommended_combine`: PRAG's sum of its setting here, and `dyprag_recommended_combine` DyPRAG's own " \
           "row, not candidates of their own)" in text
    table = [x.split(" |")[0] for x in markdown.paper_table(s)[3:]]  # PRAG's rows first, then DyPRAG's
    assert table == ["| vanilla", "| standard_rag", "| prag_sum", "| prag_sum_combine", "| recommended",
                     "| recommended_combine", "| dyprag", "| dyprag_combine", "| dyprag_recommended",
                     "| dyprag_recommended_combine", "| random_controller", "| random_controller_combine"]
    qs, res = with_dyprag(*synthetic(), best("dyprag_recommended"))
    w = report(tmp_path / "c", qs, res)["verdict"]["what_to_run"]
    assert w["row"] == "dyprag_recommended" and w["vs_host"]["row"] == "dyprag"  # a fusion against its host's row
    assert [c["row"] for c in w["cheaper"]] == ["vanilla", "standard_rag", "dyprag", "dyprag_combine", "prag_sum",
                                                "prag_sum_combine"]  # DyPRAG's fusion before PRAG's


@pytest.mark.parametrize("row, method, controller", [
    ("dyprag", "dyprag", None), ("dyprag_combine", "dyprag_combine", None),
    ("dyprag_recommended", "dyprag", "OUT/controller"),
    ("dyprag_recommended_combine", "dyprag_combine", "OUT/controller_combine")])
def test_a_dyprag_rows_next_step_copies_the_translator_where_dyprags_script_loads_it(tmp_path, row, method,
                                                                                     controller):
    out = tmp_path / "OUT"
    (out / EXPORT).parent.mkdir(parents=True)
    (out / EXPORT).write_bytes(b"translator")
    s = {"settings": {"out": "OUT", "controller_trained": True, "model": "/m/Qwen", "max_new_tokens": 24,
                      "model_name": "Qwen/Qwen2.5-1.5B-Instruct"},
         "datasets": {"hotpotqa": {}, "2wiki_dev": {}},
         "dyprag": {"translator": {"export": EXPORT, "dyprag_flags": FLAGS, "sha256": SHA}},
         "verdict": {"what_to_run": {"row": row}, "what_to_run_by_dataset": {"2wiki_dev": {"row": row}},
                     "settings": {"param": {"ship": "network"}, "combine": {"ship": "network"}}}}
    lines = markdown.next_steps(s)
    blocks = [lines[i + 1].splitlines() for i, x in enumerate(lines) if x == "```bash"]
    assert len(blocks) == 2 and "ARGS" not in " ".join(lines)
    overall, wiki = blocks
    assert overall[1] == "for d in hotpotqa 2wikimultihopqa; do" and overall[-1] == "done"
    copy_line, run = wiki
    assert copy_line == overall[0] == "mkdir -p projector && cp -r OUT/translator/projector/fcprag_hidden32 projector/"
    checkout = tmp_path / "DyPRAG"  # the copy, run in a DyPRAG checkout, puts the export where the script loads it
    checkout.mkdir()
    subprocess.run(["bash", "-c", copy_line.replace("OUT/", f"{out}/")], cwd=checkout, check=True)
    words_ = shlex.split(run)
    head = ["fcprag", "run", "dyprag"] + (["--controller", controller, "--mode", "separate", "--log", "fusion.jsonl"]
                                          if controller else [])
    assert words_[:len(head) + 2] == head + ["--", "src/inference_dyprag.py"]
    args, rest = build_parser().parse_known_args(words_[1:])  # fcprag's own parser takes the line, as its main
    assert (args.host, args.controller, args.mode) == ("dyprag", controller, "separate" if controller else None)
    assert [w for w in rest if w != "--"][0] == "src/inference_dyprag.py"
    got = dyprag_parse(words_[len(head) + 2:])  # every flag DyPRAG requires, of the type it parses
    # DyPRAG joins ROOT_DIR (its src/root_dir_path.py), "projector", --projector_path, epoch_<E-1>.pt: the copy is
    # found when ROOT_DIR is the checkout the lines run in, which the note under the command says to set
    root_dir = str(checkout)
    loaded = Path(os.path.join(root_dir, "projector", got.projector_path, f"epoch_{got.inference_epoch - 1}.pt"))
    assert loaded.read_bytes() == b"translator" and not os.path.isabs(got.projector_path)
    assert (got.model_name, got.dataset, got.max_new_tokens, got.inference_method) == \
        ("qwen2.5-1.5b-instruct", "2wikimultihopqa", 24, method)  # DyPRAG's names, as PRAG's
    assert (got.projector_p, got.lora_rank, got.lora_alpha, got.num_train_epochs, got.learning_rate) == \
        (32, 2, 32, EPOCHS, LEARNING_RATE)
    said = lines[-2]
    assert said.count(". ") == 0 and "DyPRAG checkout" in said and "cannot know" in said
    assert "with `ROOT_DIR` in its `src/root_dir_path.py` set to that checkout's absolute path" in said, said
    assert "loads the translator from `ROOT_DIR/projector/<--projector_path>/epoch_<--inference_epoch - 1>.pt`, not " \
        "from the folder it runs in" in said and "`ROOT_DIR/data_aug/`" in said
    first = next(x for x in lines if "the first line copies" in x)
    assert "into `projector/` of the DyPRAG checkout the lines run in, which must be `ROOT_DIR`" in first, first
    assert "model table" in said and "`llama` or `qwen`" in said


def test_a_dyprag_command_without_a_recorded_translator_names_what_is_missing():
    s = {"settings": {"out": "OUT", "model": "m", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
         "datasets": {"hotpotqa": {}}, "dyprag": {"translator": None},
         "verdict": {"what_to_run": {"row": "dyprag"}, "what_to_run_by_dataset": {}, "settings": {}}}
    lines = markdown.next_steps(s)
    copy_line, run = lines[lines.index("```bash") + 1].splitlines()
    got = dict(zip(shlex.split(run)[5::2], shlex.split(run)[6::2]))  # placeholders where nothing is known
    assert set(DYPRAG_FLAGS) <= set(got) and got["--projector_path"] == "<your translator's folder under projector/>"
    assert got["--inference_epoch"] == "<its epochs>" and got["--lora_rank"] == "<the translator's LoRA rank>"
    assert got["--model_name"] == "<the Hugging Face name of SmolLM2-135M-Instruct>" and "no GGUF file" in lines[-2]
    assert copy_line == "mkdir -p projector && cp -r '<your translator folder, with its epoch_<E-1>.pt>' projector/"


def test_incomplete_dyprag_rows_are_left_out_and_said_or_one_line(tmp_path):
    qs, res = with_dyprag(*synthetic())
    test = _test(qs)
    part = {k: v for k, v in res.items() if not (k.split("|")[0] in test[:3] and k.endswith("|dyprag"))}
    s = report(tmp_path, qs, part)
    assert s["left_out"]["held_out"] == {"questions": 3, "of": 40, "rows": {"dyprag": 3}} and s["n_test"] == 37
    assert s["dyprag"]["primary"]["n"] == 37
    assert "3 of 40 held-out questions lack a row the summary needs (`dyprag` on 3)" in (tmp_path / "report.md"
                                                                                          ).read_text()
    none = {k: v for k, v in res.items() if not (k.split("|")[0] in test and k.endswith("|dyprag"))}
    with pytest.raises(FcpragError) as e:
        report(tmp_path, qs, none)
    assert str(e.value) == "dyprag missing on all 40 held-out questions"
    later = {k: v for k, v in res.items() if "dyprag_recommended" not in k}  # the fusions not scored yet: no fusion
    s = report(tmp_path, qs, later)
    assert s["dyprag"]["fusion"] == {} and s["dyprag"]["ceiling"]["param"]["share"] is None
    assert check_summary(s) == []


def test_rows_of_another_translator_are_counted_and_said(tmp_path):
    qs, res = with_dyprag(*synthetic())
    for q in _test(qs)[:2]:
        res[f"{q}|dyprag_combine"]["translator"] = "old"
    s = report(tmp_path, qs, res)
    n = sum(1 for k in res if k.split("|")[1].startswith("dyprag"))
    assert s["dyprag"]["other_translator"] == {"rows": 2, "of": n}
    assert f"**Rows of another translator**: 2 of the {n} DyPRAG rows" in (tmp_path / "report.md").read_text()


def test_the_schema_check_knows_the_section(tmp_path):
    qs, res = with_dyprag(*synthetic())
    good = report(tmp_path, qs, res)
    assert check_summary(good) == [] and good["dyprag"]["translator"]["sha256"] == SHA
    edits = [
        (lambda s: s.pop("dyprag"), "dyprag: expected DyPRAG's section"),
        (lambda s: s["dyprag"]["primary"].update(level=0.95), "dyprag.primary: expected level 1 - 0.05/3"),
        (lambda s: s["dyprag"]["primary"].update(n_comparisons=2), "dyprag.primary: expected comparisons"),
        (lambda s: s["dyprag"]["primary"]["comparisons"][0].update(against="dyprag"), "dyprag.primary"),
        (lambda s: s["dyprag"]["primary"]["comparisons"][1].update(reading="beats"), "dyprag.primary"),
        (lambda s: s["dyprag"]["primary"]["comparisons"][2].pop("ci_logprob"), "dyprag.primary"),
        (lambda s: s["dyprag"].update(translator=None), "dyprag.translator"),
        (lambda s: s["dyprag"].update(cost=3), "dyprag.cost"),
        (lambda s: s["dyprag"]["fusion"]["param"].update(against="prag_sum"), "dyprag.fusion"),
    ]
    for edit, needle in edits:
        s = copy.deepcopy(good)
        edit(s)
        assert any(needle in p for p in check_summary(s)), (needle, check_summary(s))


def test_every_figure_of_the_dyprag_section_comes_from_the_summary(tmp_path):
    qs, res = with_dyprag(*synthetic(seed=3))
    s = report(tmp_path, qs, res)
    text = (tmp_path / "report.md").read_text()
    text = text[text.index("## DyPRAG"):text.index("## What ships")] + text[text.index("- DyPRAG, param"):
                                                                            text.index("## Every row")]
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    sci = re.findall(r"\d(?:\.\d+)?e[+-]\d+", text)  # the learning rate as DyPRAG's flag writes it
    assert sci == ["1e-05"] and 1e-05 == s["dyprag"]["translator"]["options"]["learning_rate"]
    text = text.replace("1e-05", "")
    allowed = set()

    def walk(x):
        if isinstance(x, bool) or x is None:
            return
        if isinstance(x, (int, float)):
            for v in (x, 100 * x, x * x):
                allowed.update({f"{v:.4f}", f"{v:.1f}", f"{v:.2f}", f"{v:.3f}", f"{v:.3g}", f"{v:.4g}", f"{v:g}",
                                f"{v:.0f}", words.signed(v), words.signed(v, 1)})
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(s["dyprag"])
    c = s["dyprag"]["cost"]
    walk(c["prag_seconds"] / c["generation_seconds"])  # "N times as long"
    allowed.update({"0.05", "10,000", "10", "000", "1", "0", "80", "95"})  # stated levels and "1, the same direction"
    numbers = re.findall(r"(?<![\w.])[+-]?\d+(?:\.\d+)?", text)
    missing = [n for n in numbers if n not in allowed and n.lstrip("+") not in allowed]
    assert numbers and not missing, missing


def test_fcprag_report_reads_a_committed_style_dyprag_folder_as_the_study_wrote_it(tmp_path, capsys):
    qs, res = with_dyprag(*synthetic())
    s1 = report(tmp_path, qs, res)  # the summary stage, on the study's own files
    rows = {"questions": [{"id": q, **x} for q, x in qs.items()], "eval": list(res.values())}
    for name in ("questions", "dyprag_generated", "adapters", "dyprag_cosine"):
        path = tmp_path / f"{name}.jsonl"
        rows.setdefault(name, [json.loads(x) for x in path.read_text().splitlines()])
        path.unlink(missing_ok=True)
    for name, lines in rows.items():  # gzipped, as a committed study keeps them
        with gzip.open(tmp_path / f"{name}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    (tmp_path / "settings.json").write_text(json.dumps({**SETTINGS_JSON, "questions_sha256": "x"}))
    assert main(["report", str(tmp_path)]) == 0, capsys.readouterr().err
    s2 = json.loads((tmp_path / "summary.json").read_text())
    assert s2["dyprag"] == json.loads(json.dumps(s1["dyprag"])) and check_summary(s2) == []
    assert s2["dyprag"]["diversity"]["questions"] == 40 and s2["dyprag"]["cost"]["passages_generated"] == 120
    assert "## DyPRAG" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("folder", ["benchmarks/efficacy/table", "benchmarks/efficacy/table/controller-check"])
def test_committed_studies_without_dyprag_rows_report_byte_for_byte_as_before(tmp_path, monkeypatch, capsys, folder):
    shutil.copytree(ROOT / folder, tmp_path / folder)
    shutil.copytree(ROOT / "benchmarks/efficacy/controller", tmp_path / "benchmarks/efficacy/controller")
    monkeypatch.chdir(tmp_path)
    assert main(["report", folder]) == 0, capsys.readouterr().err
    for name in ("summary.json", "report.md"):
        assert (tmp_path / folder / name).read_bytes() == (ROOT / folder / name).read_bytes(), name
    assert "dyprag" not in json.loads((tmp_path / folder / "summary.json").read_text())


def _plotted(monkeypatch, s, path):
    """``{row: (bar colours, hatches)}`` of ``report.png`` as :func:`plot.write_plot` draws it for ``s``."""
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    assert plot.write_plot(s, path) == path.name
    (ax,) = figs[0].axes
    return {c.get_label(): ({p.get_facecolor() for p in c.patches}, {p.get_hatch() for p in c.patches})
            for c in ax.containers if c.get_label() in s["methods"]}


def test_report_png_draws_dyprags_rows_in_colours_of_their_own(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    qs, res = with_dyprag(*synthetic())
    s = report(tmp_path, qs, res)
    drawn = _plotted(monkeypatch, s, tmp_path / "a.png")
    dyprag_rows = [n for n in drawn if dy.is_dyprag(n)]
    assert len(dyprag_rows) == 4 and len(drawn) >= 8 and set(plot.COLOURS) == set(plot.PAPER_ROWS)
    assert all(len(c) == 1 for c, _ in drawn.values())  # one colour a row
    colour = {n: next(iter(c)) for n, (c, _) in drawn.items()}
    assert len(set(colour.values())) == len(colour)  # no two rows alike
    theirs = {colour[n] for n in dyprag_rows}
    assert not theirs & {colour[n] for n in drawn if n not in dyprag_rows}
    assert all(drawn[n][1] == {plot.DYPRAG_HATCH} for n in dyprag_rows)  # and hatched, as a family
    assert all(drawn[n][1] == {None} for n in drawn if n not in dyprag_rows)
    # a row's colour is its own, not its place: without PRAG's combine rows DyPRAG's keep theirs
    fewer = copy.deepcopy(s)
    for n in ("prag_sum_combine", "standard_rag"):
        fewer["methods"].pop(n)
    again = _plotted(monkeypatch, fewer, tmp_path / "b.png")
    assert {n: next(iter(c)) for n, (c, _) in again.items()} == {n: colour[n] for n in again}


def test_the_committed_dyprag_study_reports_byte_for_byte_with_its_translators_cost(tmp_path, monkeypatch, capsys):
    """benchmarks/efficacy/dyprag (issue 51's study on SmolLM2) re-reported from its committed rows: the same
    summary.json and report.md, its three planned comparisons at 1 - 0.05/3, its cost read from the generation lines
    of its own translator (the sha256 its translator.json records)."""
    folder = "benchmarks/efficacy/dyprag"
    shutil.copytree(ROOT / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    assert main(["report", folder]) == 0, capsys.readouterr().err
    for name in ("summary.json", "report.md"):
        assert (tmp_path / folder / name).read_bytes() == (ROOT / folder / name).read_bytes(), name
    d = json.loads((tmp_path / folder / "summary.json").read_text())["dyprag"]
    sha = json.loads((ROOT / folder / "translator/translator.json").read_text())["sha256"]
    with gzip.open(ROOT / folder / "dyprag_generated.jsonl.gz", "rt") as f:
        lines = [json.loads(x) for x in f]
    assert {x["sha256"] for x in lines} == {sha}
    assert [c["key"] for c in d["primary"]["comparisons"]] == \
        ["dyprag_vs_prag_sum", "dyprag_vs_vanilla", "dyprag_combine_vs_standard_rag"]
    assert d["primary"]["level"] == pytest.approx(1 - 0.05 / 3) and d["cost"]["passages_generated"] > 0
