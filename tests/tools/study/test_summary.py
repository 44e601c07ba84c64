"""The study's summary from scored rows: the checker, the verdict rule (what ships agrees with the measured parts),
"what to run" against an independent recomputation, the paper's table and every report figure read from
summary.json."""

from __future__ import annotations

import copy
import json
import random
import re
import statistics

import pytest

from fcprag_tools.study import stats, summary
from fcprag_tools.study.options import Policy
from fcprag_tools.study.verdict import markdown, tables, words
from fcprag_tools.study.verdict.choice import WHAT_TO_RUN_BOOT
from fcprag_tools.study.verdict.records import ControllerRecord, ScoredRows
from fcprag_tools.study.verdict.schema import check_summary
from fcprag_tools.study.verdict.ship import decide, part

ROWS = {"vanilla": "param", "standard_rag": "combine", "prag_sum": "param", "prag_sum_combine": "combine",
        "scale:2": "param", "random_controller": "param", "random_controller_combine": "combine",
        "learned": "param", "learned_same_total": "param"}


def _cv(rw=None, sc=None):
    """A trainer's cross-validation record with out-of-fold reweighting / scale ``(gain, lo, hi)``."""
    part = lambda g: None if g is None else {"gain": g[0], "ci95": [g[1], g[2]]}  # noqa: E731
    return {"gain": 0.0, "ci95": [0.0, 0.0], "reweighting": part(rw), "scale": part(sc)}


CV = {"param": _cv((0.05, 0.03, 0.07), (0.2, 0.1, 0.3)), "combine": _cv((0.0, -0.01, 0.01), (0.0, 0.0, 0.0))}


def _ctrls(cv, kappas=(("param", 2.0), ("combine", 1.0))):
    return {s: ControllerRecord(k, cv.get(s) or {}) for s, k in kappas}


def synthetic(seed=0, n_test=40, n_train=24):
    """Questions of two datasets and subtasks, every row scored with made-up metrics (the combine rows better on
    'hot', the parametric ones on 'wiki')."""
    r = random.Random(seed)
    qs, results = {}, {}
    for i in range(n_test + n_train):
        d = "hot" if i % 2 else "wiki"
        qs[f"q{i}"] = {"split": "test" if i < n_test else "train", "dataset": d,
                       "subtask": ("bridge", "comparison")[i % 4 // 2] if d == "hot" else "inference"}
        for name, setting in ROWS.items():
            good = (setting == "combine") == (d == "hot")
            f1 = min(1.0, max(0.0, r.random() * 0.6 + (0.3 if good else 0.0)))
            results[f"q{i}|{name}"] = {"id": f"q{i}|{name}", "logprob": -3 + r.random() + (0.2 if good else 0),
                                       "f1": f1, "em": float(f1 > 0.8), "acc": float(f1 > 0.5), "prompt": setting}
    return qs, results


SETTINGS_JSON = {"model": "/m/SmolLM2", "gguf_file": None, "device": "cpu", "dtype": "float32", "seed": 0,
                 "test_fraction": 0.5, "max_new_tokens": 16}


def build(tmp_path, given=False, cv=None, policy=None, qs_results=None, ctrls=None, **kw):
    qs, results = qs_results or synthetic(**kw)
    s = summary.finish(ScoredRows.from_dicts(qs, results), ctrls or _ctrls(CV if cv is None else cv), given=given,
                       stage_seconds={"evaluate": 1.5}, out=tmp_path, policy=policy or Policy(),
                       settings={**SETTINGS_JSON, "out": str(tmp_path), "controller_trained": not given})
    return s, qs, results


def test_a_complete_summary_passes_and_each_missing_or_contradicting_field_is_named(tmp_path):
    good, _, _ = build(tmp_path)
    assert check_summary(good) == [] and json.loads((tmp_path / "summary.json").read_text()) == \
        json.loads(json.dumps(good))
    edits = [
        (lambda s: s.pop("n_test"), "n_test"),
        (lambda s: s["settings"].pop("dtype"), "settings"),
        (lambda s: s["methods"].pop("recommended"), "'recommended' missing"),
        (lambda s: s["methods"].pop("standard_rag"), "'standard_rag' missing"),
        (lambda s: s["methods"]["vanilla"].pop("by_subtask"), "methods['vanilla'].by_subtask"),
        (lambda s: s["methods"]["prag_sum"].pop("em"), "methods['prag_sum']"),
        (lambda s: s["paired"]["scale:2"].pop("ci95_logprob"), "paired['scale:2']"),
        (lambda s: s["paired"]["scale:2"].update(ci95_logprob=[0.2, 0.1]), "paired['scale:2']"),
        (lambda s: s["verdict"].update(ship="both"), "verdict.ship"),
        (lambda s: s["verdict"]["settings"].pop("combine"), "verdict.settings"),
        (lambda s: s["verdict"]["settings"]["param"]["scale"].pop("measured"), "verdict.settings.param.scale"),
        (lambda s: s["verdict"]["settings"]["combine"].update(ship="network"), "reweighting gain's lower bound"),
        (lambda s: s["verdict"]["settings"]["combine"].update(ship="scale_only"), "scale gain's lower bound"),
        (lambda s: s["verdict"]["settings"]["param"].pop("decided_on"), "expected decided_on, margins"),
        (lambda s: s["verdict"]["settings"]["param"]["margins"].pop("scale"), "expected decided_on, margins"),
        (lambda s: s["verdict"]["what_to_run"]["vs_standard_rag"].update(reading="answers best"), "a reading of"),
        (lambda s: s["verdict"]["what_to_run"]["vs_standard_rag"].update(row=s["verdict"]["what_to_run"]["row"]),
         "another row"),  # a row compared with itself
        (lambda s: s["verdict"]["what_to_run"].update(row="arrow"), "verdict.what_to_run"),
        (lambda s: s["verdict"]["what_to_run"].pop("vs_prag_sum" if s["verdict"]["what_to_run"]["row"] != "prag_sum"
                                                   else "vs_standard_rag"), "verdict.what_to_run.vs_"),
        (lambda s: s["verdict"]["what_to_run"]["runner_up"].update(row=s["verdict"]["what_to_run"]["row"]),
         "runner_up"),
        (lambda s: s["verdict"]["what_to_run"].update(level=0.95), "level"),
        (lambda s: s["verdict"]["what_to_run_by_dataset"].update(x=s["verdict"]["what_to_run"]),
         "what_to_run_by_dataset"),
        (lambda s: s.pop("f1_unit"), "f1_unit"),
    ]
    for edit, needle in edits:
        s = copy.deepcopy(good)
        edit(s)
        assert any(needle in p for p in check_summary(s)), (needle, check_summary(s))


def test_nothing_ships_below_its_margin_and_a_gain_just_above_it_ships():
    p = Policy(min_gain=0.02, min_scale_gain=0.05)
    ship = lambda rw, sc, network=True, kappa=2.0: decide(_cv(rw, sc), network=network, kappa=kappa,  # noqa: E731
                                                           policy=p)[0]
    assert ship((0.03, 0.0201, 0.04), None) == "network"  # lower bound just above the margin
    assert ship((0.03, 0.0199, 0.04), None) == "prag_sum"  # just below: a CI above 0 is not enough
    assert ship((0.03, 0.0199, 0.04), (0.2, 0.0501, 0.3)) == "scale_only"  # the scale's own margin
    assert ship((0.03, 0.0199, 0.04), (0.2, 0.0499, 0.3)) == "prag_sum"
    assert ship((0.03, 0.0201, 0.04), None, network=False) == "prag_sum"  # no network: nothing to ship for it
    assert ship(None, (0.2, 0.1, 0.3), kappa=1.0) == "prag_sum"  # kappa 1: no scale to ship
    assert decide({}, network=True, kappa=2.0, policy=p)[0] == "prag_sum"  # no cross-validation: no evidence
    # the table study's network: +0.0001 held out, +2e-6 out of fold; it does not ship at the default margin
    assert ship((2e-6, -6.7e-6, 1.25e-5), (0.0, 0.0, 0.0), kappa=1.0) == "prag_sum"


def test_margins_and_the_decision_are_recorded_and_equivalence_read_at_the_margin(tmp_path):
    s, qs, res = build(tmp_path, policy=Policy(min_gain=0.025, min_scale_gain=0.5))
    pv = s["verdict"]["settings"]["param"]
    assert pv["margins"] == {"reweighting": 0.025, "scale": 0.5} and pv["ship"] == "network"
    assert "24 training questions" in pv["decided_on"] and s["policy"]["min_gain"] == 0.025
    test = [q for q in qs if qs[q]["split"] == "test"]
    d = [res[f"{q}|learned"]["logprob"] - res[f"{q}|prag_sum"]["logprob"] for q in test]
    lo, hi = stats.paired(d, "logprob")[1]
    assert pv["total"]["equivalent"] == (-0.025 < lo and hi < 0.025)
    wide = part(ScoredRows.from_dicts(qs, res), test, "learned", "prag_sum", 10.0)  # every question has every row
    assert wide.equivalent and wide.ci95 == pytest.approx([lo, hi])


def test_kappa_one_measures_no_scale_part(tmp_path):
    s, _, _ = build(tmp_path)
    c = s["verdict"]["settings"]["combine"]
    assert c["scale"]["measured"] is False and c["scale"]["delta"] is None and c["ship"] == "prag_sum"
    assert "prag_sum_combine vs prag_sum_combine" not in (tmp_path / "report.md").read_text()


def test_what_to_run_is_chosen_on_training_f1_and_measured_held_out(tmp_path):
    s, qs, res = build(tmp_path)
    train = [q for q in qs if qs[q]["split"] == "train"]
    test = [q for q in qs if qs[q]["split"] == "test"]
    rec = {"recommended": s["verdict"]["settings"]["param"]["recommended_row"],
           "recommended_combine": s["verdict"]["settings"]["combine"]["recommended_row"]}
    # combine ships PRAG's sum: its recommended row is prag_sum_combine itself, not a candidate of its own; DyPRAG's
    # rows are candidates only where scored (none here)
    cands = [c for c in summary.CANDIDATES if c != "recommended_combine" and not c.startswith("dyprag")]
    cost = ["vanilla", "standard_rag", "prag_sum", "prag_sum_combine", "recommended"]  # cheapest first
    scopes = [(None, s["verdict"]["what_to_run"])] + list(s["verdict"]["what_to_run_by_dataset"].items())
    made = 0
    for scope, choice in scopes:
        inside = [q for q in train if scope is None or qs[q]["dataset"] == scope]
        means = {c: sum(res[f"{q}|{rec.get(c, c)}"]["f1"] for q in inside) / len(inside) for c in cands}
        assert list(choice["choice_f1"]) == cands
        best = max(cands, key=lambda c: (means[c], -cost.index(c)))
        assert choice["row"] == best and choice["n_choice"] == len(inside) and choice["tied"] == []
        second = max((c for c in cands if c != best), key=lambda c: (means[c], -cost.index(c)))
        assert choice["runner_up"]["row"] == second
        assert choice["runner_up"]["lead_f1"] == pytest.approx(means[best] - means[second])
        held = [q for q in test if scope is None or qs[q]["dataset"] == scope]
        if best != "standard_rag":
            diffs = [res[f"{q}|{rec.get(best, best)}"]["f1"] - res[f"{q}|standard_rag"]["f1"] for q in held]
            assert choice["vs_standard_rag"]["delta_f1"] == pytest.approx(sum(diffs) / len(diffs))
            d, ci = stats.paired(diffs, f"what_to_run:{scope}:standard_rag", choice["level"], WHAT_TO_RUN_BOOT)
            assert choice["vs_standard_rag"]["ci_f1"] == pytest.approx(ci)
        # standard RAG, PRAG's sum and the runner-up, each once, never the choice itself
        made += len({"standard_rag", "prag_sum", second} - {best})
    for _, choice in scopes:
        assert choice["n_comparisons"] == made and choice["level"] == pytest.approx(1 - 0.05 / made)
    # the made-up data: Combine rows answer 'hot', the parametric rows 'wiki'
    assert s["verdict"]["what_to_run_by_dataset"]["hot"]["row"].endswith(("_combine", "standard_rag"))
    assert not s["verdict"]["what_to_run_by_dataset"]["wiki"]["row"].endswith(("_combine", "standard_rag"))


def test_with_a_given_controller_the_choice_is_descriptive(tmp_path):
    s, _, _ = build(tmp_path, given=True)
    assert s["verdict"]["what_to_run"]["chosen_on"] == "held-out (descriptive)"
    assert "descriptive, not a test" in (tmp_path / "report.md").read_text()
    for w in [s["verdict"]["what_to_run"], *s["verdict"]["what_to_run_by_dataset"].values()]:
        said = w["plain"] + w["plain_held_out"]
        assert "held out" not in said.lower() and "held-out" not in said  # chosen and measured on the same ones
        assert "chosen on them: descriptive" in w["plain_held_out"]


def test_subtasks_and_datasets_recomputed(tmp_path):
    s, qs, res = build(tmp_path)
    test = [q for q in qs if qs[q]["split"] == "test"]
    for name in ("vanilla", "prag_sum_combine", "recommended"):
        row = s["verdict"]["recommended_row"] if name == "recommended" else name
        for key, b in s["methods"][name]["by_subtask"].items():
            d, sub = key.split("/")
            f1 = [res[f"{q}|{row}"]["f1"] for q in test if qs[q]["dataset"] == d and qs[q]["subtask"] == sub]
            assert b["n"] == len(f1) and b["f1"] == pytest.approx(sum(f1) / len(f1))
        hot = s["methods"][name]["by_dataset"]["hot"]
        assert hot["f1_macro"] == pytest.approx((s["methods"][name]["by_subtask"]["hot/bridge"]["f1"]
                                                 + s["methods"][name]["by_subtask"]["hot/comparison"]["f1"]) / 2)
    assert set(s["methods"]["vanilla"]["by_subtask"]) == {"hot/bridge", "hot/comparison", "wiki/inference"}


def test_the_tables_are_typed_records_whose_json_is_the_summarys():
    qs, res = synthetic()
    rows = ScoredRows.from_dicts(qs, res)
    test = rows.test
    fig = tables.figures(rows, test, "standard_rag")
    bridge = [res[f"{q}|standard_rag"] for q in test if (qs[q]["dataset"], qs[q]["subtask"]) == ("hot", "bridge")]
    assert fig.by_subtask["hot/bridge"] == tables.Cell(pytest.approx(sum(r["f1"] for r in bridge) / len(bridge)),
                                                       pytest.approx(sum(r["em"] for r in bridge) / len(bridge)),
                                                       len(bridge))
    assert fig.by_dataset["wiki"].n == 20 and fig.to_json()["by_dataset"]["wiki"]["n"] == 20
    pairs = tables.paired_table(rows, test, ["vanilla", "prag_sum"], Policy())
    assert set(pairs) == {"vanilla"}  # PRAG's sum is the host: not paired with itself
    diffs = [res[f"{q}|vanilla"]["f1"] - res[f"{q}|prag_sum"]["f1"] for q in test]
    p = pairs["vanilla"]
    assert (p.against, p.delta["f1"]) == ("prag_sum", pytest.approx(sum(diffs) / len(diffs)))
    z = 1.959964 + 0.841621  # 95%, 80% power
    assert p.mde_f1 == pytest.approx(z * statistics.stdev(diffs) / len(diffs) ** 0.5, rel=1e-5)
    j = p.to_json()
    assert j["delta_f1"] == p.delta["f1"] and j["ci95_logprob"] == p.ci95["logprob"] and j["n_needed"] == p.n_needed


def test_every_figure_of_the_report_comes_from_the_summary(tmp_path):
    s, _, _ = build(tmp_path)
    text = (tmp_path / "report.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`|\(report\.png\)", "", text)
    allowed = set()

    def walk(x):
        if isinstance(x, bool) or x is None:
            return
        if isinstance(x, (int, float)):
            for v in (x, 100 * x):
                allowed.update({f"{v:.4f}", f"{v:.1f}", f"{v:g}", f"{v:.2f}", f"{v:+.2g}", words.signed(v),
                                words.signed(v, 1)})
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k) if isinstance(k, (int, float)) else None
                walk(v)
                allowed.update(re.findall(r"[+-]?\d+(?:\.\d+)?", str(k)))
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str):
            allowed.update(re.findall(r"[+-]?\d+(?:\.\d+)?", x))

    walk(s)
    allowed.update({"95", "2,000", "2", "000", "1", "80", "0", "100", "0.05"})  # stated levels, "kappa 1", units
    numbers = re.findall(r"(?<![\w.])[+-]?\d+(?:\.\d+)?", text)
    missing = [n for n in numbers if n not in allowed and n.lstrip("+") not in allowed]
    assert numbers and not missing, missing


def test_the_paper_table_bolds_the_best_row_per_column(tmp_path):
    s, _, _ = build(tmp_path)
    lines = markdown.paper_table(s)
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["method", "wiki total", "hot bridge", "hot comparison", "hot total"]  # datasets as first seen
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")[1:]] for ln in lines[3:]}
    for j, col in enumerate(head[1:]):
        vals = {n: float(rows[n][j].strip("*")) for n in rows}
        best = max(vals.values())  # as printed: rows showing the same figure are bold alike
        assert all((rows[n][j].startswith("**")) == (vals[n] == best) for n in rows), col
