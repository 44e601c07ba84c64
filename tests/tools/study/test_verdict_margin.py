"""A verdict that says how sure it is (issue 53): the choice's lead over the runner-up with its interval, the cheaper
settings not shown worse named on a near-tie, the level over the comparisons actually made, the minimum detectable
effect said the right way round, one F1 unit, the risk rule's figures behind kappa, and rows that are missing."""

from __future__ import annotations

import gzip
import json
import math
import random
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from fcprag_plugin.errors import FcpragError
from fcprag_tools.cli import main
from fcprag_tools.study import summary
from fcprag_tools.study.options import Policy
from fcprag_tools.study.verdict import kappa, words
from fcprag_tools.study.verdict.choice import what_to_run
from fcprag_tools.study.verdict.records import ScaleLabel, ScoredRows

from .test_summary import _ctrls, synthetic

TABLE = Path(__file__).resolve().parents[3] / "benchmarks" / "efficacy" / "table"
CANDS = ["vanilla", "standard_rag", "prag_sum", "prag_sum_combine"]


def planted(f1_of, n_train=40, n_test=20, datasets=("d",)):
    """Rows whose F1 is ``f1_of(row, dataset, i)`` for the ``i``-th question of its split (gold log-lik. 0)."""
    qs, res = {}, {}
    for split, n in (("train", n_train), ("test", n_test)):
        for i in range(n):
            d = datasets[i % len(datasets)]
            q = f"{split}{i}"
            qs[q] = {"split": split, "dataset": d, "subtask": "all"}
            for row in CANDS:
                res[f"{q}|{row}"] = {"logprob": 0.0, "f1": f1_of(row, d, i // len(datasets))}
    return ScoredRows.from_dicts(qs, res)


def choose(rows):
    return what_to_run(rows, rows.test, descriptive=False, cands=CANDS, policy=Policy())


def test_the_lead_over_the_runner_up_matches_a_hand_computation():
    # a constant lead: every resample's mean is +0.1, so the interval is [0.1, 0.1] and the lead is clear
    base = {"vanilla": 0.1, "standard_rag": 0.5, "prag_sum": 0.2, "prag_sum_combine": 0.6}
    c, _ = choose(planted(lambda row, d, i: base[row]))
    assert c.row == "prag_sum_combine" and c.runner_up.row == "standard_rag"
    assert c.runner_up.lead_f1 == pytest.approx(0.1) and c.runner_up.ci_f1 == pytest.approx([0.1, 0.1])
    assert c.runner_up.clear and c.runner_up.f1 == pytest.approx(0.5)
    # a lead of +0.3 / -0.1 on alternate questions: mean 0.1, population SD 0.2, so the 95% bootstrap interval is
    # about 0.1 -+ 1.96 * 0.2 / sqrt(40) = [0.038, 0.162] (the normal approximation, an independent reference)
    wavy = {"prag_sum_combine": lambda i: 0.5 + (0.3 if i % 2 == 0 else -0.1)}
    c, _ = choose(planted(lambda row, d, i: wavy[row](i) if row in wavy else base[row]))
    lead = [0.3 if i % 2 == 0 else -0.1 for i in range(40)]
    half = 1.959964 * statistics.pstdev(lead) / math.sqrt(40)
    assert c.runner_up.lead_f1 == pytest.approx(sum(lead) / 40)
    assert c.runner_up.ci_f1 == pytest.approx([0.1 - half, 0.1 + half], abs=0.012)
    assert c.runner_up.level == 0.95 and c.runner_up.clear


def test_a_planted_near_tie_names_the_cheaper_settings_not_shown_worse():
    r = random.Random(3)
    # mean-zero spreads (each value and its negation): the choice leads standard RAG and PRAG's sum by exactly one
    # point with a wide spread, no retrieval by 41 points
    a, b = [r.uniform(0, 0.25) for _ in range(30)], [r.uniform(0, 0.25) for _ in range(30)]
    n1, n2 = [x * (-1) ** i for x in a for i in (0, 1)], [x * (-1) ** i for x in b for i in (0, 1)]
    f1 = {"vanilla": lambda i: 0.1, "standard_rag": lambda i: 0.5, "prag_sum": lambda i: 0.5 + n2[i],
          "prag_sum_combine": lambda i: 0.51 + n1[i]}
    c, _ = choose(planted(lambda row, d, i: f1[row](i), n_train=60))
    assert c.row == "prag_sum_combine" and c.runner_up.row == "standard_rag" and not c.runner_up.clear  # a tie: cheaper
    near = [x.row for x in c.cheaper if not x.clear]
    assert near == ["standard_rag", "prag_sum"]  # cheapest first; no retrieval is shown worse
    assert [x.row for x in c.cheaper] == ["vanilla", "standard_rag", "prag_sum"] and c.cheaper[0].clear
    text = words.plain(c.to_json(), None)
    assert "is not clear" in text and text.index("`standard_rag`") < text.index("`prag_sum`")
    assert "cheaper and not shown worse there: `standard_rag`" in text and "`vanilla`" not in text


def test_the_level_counts_the_comparisons_made_and_none_against_itself():
    table = {"A": {"prag_sum": 0.6, "vanilla": 0.5}, "B": {"standard_rag": 0.6, "prag_sum_combine": 0.5},
             "C": {"prag_sum": 0.6, "standard_rag": 0.5}}
    rows = planted(lambda row, d, i: table[d].get(row, 0.1), n_train=30, n_test=30, datasets=("A", "B", "C"))
    overall, by = choose(rows)
    # by hand: A prag_sum (runner-up vanilla): standard_rag, vanilla; B standard_rag (runner-up prag_sum_combine):
    # prag_sum, prag_sum_combine; C prag_sum (runner-up standard_rag): standard_rag; overall prag_sum (0.433;
    # runner-up standard_rag 0.4): standard_rag. 2 + 2 + 1 + 1 = 6 (not 2 x 4 = 8: no row against itself)
    assert (overall.row, overall.runner_up.row) == ("prag_sum", "standard_rag")
    assert {d: (c.row, c.runner_up.row) for d, c in by.items()} == {
        "A": ("prag_sum", "vanilla"), "B": ("standard_rag", "prag_sum_combine"), "C": ("prag_sum", "standard_rag")}
    made = {d: sorted(x.row for x in c.held.comparisons.values()) for d, c in [(None, overall), *by.items()]}
    assert made == {None: ["standard_rag"], "A": ["standard_rag", "vanilla"], "B": ["prag_sum", "prag_sum_combine"],
                    "C": ["standard_rag"]}
    for c in [overall, *by.values()]:
        assert c.held.n_comparisons == 6 and c.held.level == pytest.approx(1 - 0.05 / 6)
        assert all(x.row != c.row for x in c.held.comparisons.values())


def test_the_minimum_detectable_effect_is_said_the_right_way_round():
    v = {"row": "standard_rag", "delta_f1": 0.027, "ci_f1": [-0.029, 0.087], "reading": "not_shown",
         "mde_f1": 0.0732, "n_needed": 596, "n_nonzero": 14}
    text = words.reading_text(v, 100, 0.03, 0.8)
    assert ("with 100 questions only a true difference of about 7.3 points or more would have been detected with "
            "80% power; about 596 questions are needed for 3 points") in text
    assert "no difference above" not in text and "+2.7 [-2.9, +8.7]" in text


def test_an_interval_end_keeps_its_sign():
    assert words.signed(0.00003) == "+0.00003" and words.signed(-0.00003) == "-0.00003"
    assert words.signed(0.0) == "+0.0000" and words.signed(1.2e-17) == "+0.0000"  # rounding noise stays 0
    assert words.pts(-0.0004) == "-0.04" and words.pts(0.02651) == "+2.7"


def test_the_risk_rule_figures_agree_with_the_trainers_rule():
    from fcprag_plugin.training.selection import ScaleRule, choose_scale

    r = random.Random(0)
    scales = [0.5, 2.0, 3.0]
    gains = [{s: r.gauss(0.1 * s, 0.15) for s in scales if r.random() > 0.05} for _ in range(60)]
    gains = [g for g in gains if g]
    t = torch.tensor([[g.get(s, float("nan")) for s in scales] for g in gains], dtype=torch.float64)
    for bound in ("upper", "observed"):
        rule = {"max_loss_share": 0.1, "loss_margin": 0.1, "bound": bound, "metric": "label"}
        k, ref = choose_scale(torch.tensor(scales), t, [f"q{i}" for i in range(len(gains))], ScaleRule(0.1, 0.1, bound))
        fig = kappa.rule_figures(gains, rule)
        assert fig["rule_kappa"] == k and [x["kappa"] for x in fig["kappas"]] == ref["grid"]
        assert [x["mean_gain"] for x in fig["kappas"]] == pytest.approx(ref["mean_gain"])
        assert [x["share"] for x in fig["kappas"]] == pytest.approx(ref["loss_share"])
        assert [x["upper_bound"] for x in fig["kappas"]] == pytest.approx([c[1] for c in ref["loss_share_ci95"]])


def test_the_risk_rule_by_hand():
    # 40 questions; at x2, 3 lose 0.2 and 37 gain 0.3: mean +0.2625, share 3/40, its Wilson upper bound 0.199
    gains = [{2.0: -0.2}] * 3 + [{2.0: 0.3}] * 37
    z, n, p = 1.959964, 40, 3 / 40
    upper = (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
    fig = kappa.rule_figures(gains, {"max_loss_share": 0.1, "loss_margin": 0.1, "bound": "upper"})
    one, two = fig["kappas"]
    assert (one["kappa"], one["mean_gain"], one["losing"], one["allowed"]) == (1.0, 0.0, 0, True)
    assert two["mean_gain"] == pytest.approx(0.2625) and two["losing"] == 3 and two["share"] == pytest.approx(p)
    assert two["upper_bound"] == pytest.approx(upper, abs=1e-5) and not two["allowed"] and fig["rule_kappa"] == 1.0
    loose = kappa.rule_figures(gains, {"max_loss_share": 0.25, "loss_margin": 0.1, "bound": "upper"})
    assert loose["rule_kappa"] == 2.0  # a looser rule allows the scale


def test_why_this_kappa_is_said_from_the_labels_and_the_trainers_arguments(tmp_path):
    qs, results = synthetic()
    train = [q for q, x in qs.items() if x["split"] == "train"]
    labels = tuple(ScaleLabel(f"group:{q}", {2.0: (-0.3 if i < 4 else 0.2), 3.0: -0.5}) for i, q in enumerate(train))
    args = {"kappa": "auto", "scale_max_loss_share": 0.2, "scale_loss_margin": 0.1, "scale_bound": "observed",
            "scale_metric": "label"}
    ctrls = _ctrls({})
    ctrls["param"] = type(ctrls["param"])(1.0, {"scale": {"kappa": 2.0, "chosen_by": "measured"}}, args, labels)
    s = summary.finish(ScoredRows.from_dicts(qs, results), ctrls, given=False, stage_seconds={}, out=tmp_path,
                       policy=Policy(), settings={"model": "m", "device": "cpu", "dtype": "float32"})
    kr = s["verdict"]["settings"]["param"]["kappa_rule"]
    assert kr["rule"] == {"max_loss_share": 0.2, "loss_margin": 0.1, "bound": "observed", "metric": "label"}
    two = next(k for k in kr["training"]["kappas"] if k["kappa"] == 2.0)
    assert (two["losing"], kr["training"]["questions"]) == (4, 24) and two["allowed"]  # 4 of 24 = 16.7% <= 20%
    assert kr["training"]["rule_kappa"] == 2.0 and kr["held_out"]["questions"] == 40  # scale:2 is scored held out
    text = (tmp_path / "report.md").read_text()
    assert "## Why this kappa" in text and "| 2 (chosen) | +0.1167 | 4 of 24 | 16.7% |" in text
    assert "keeps neither labels_combine.jsonl nor the trainer's training_args.json" in \
        s["verdict"]["settings"]["combine"]["kappa_rule"]["why_absent"]


def _table_copy(dest, keep=lambda r: True):
    for name in ("settings.json", "summary.json", "questions.jsonl.gz"):
        shutil.copy(TABLE / name, dest / name)
    rows = [json.loads(x) for x in gzip.open(TABLE / "eval.jsonl.gz", "rt")]
    with gzip.open(dest / "eval.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if keep(r))
    return [json.loads(x)["id"] for x in gzip.open(TABLE / "questions.jsonl.gz", "rt")
            if json.loads(x)["split"] == "test"]


@pytest.mark.slow  # two re-reports of the table study (about 10 s each on the shared CPU)
def test_rows_missing_on_some_held_out_questions_are_left_out_and_said(tmp_path, capsys):
    test = _table_copy(tmp_path)
    gone = set(test[:10])
    _table_copy(tmp_path, keep=lambda r: not (r["id"].split("|")[0] in gone and r["id"].endswith("|standard_rag")))
    assert main(["report", str(tmp_path)]) == 0, capsys.readouterr().err
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["left_out"]["held_out"] == {"questions": 10, "of": 100, "rows": {"standard_rag": 10}}
    assert s["n_test"] == 90 and s["verdict"]["what_to_run"]["n"] == 90
    assert "10 of 100 held-out questions lack a row the summary needs (`standard_rag` on 10)" in \
        (tmp_path / "report.md").read_text()
    # a study interrupted mid-evaluation: 20 held-out questions not evaluated yet, the others complete
    _table_copy(tmp_path, keep=lambda r: r["id"].split("|")[0] not in set(test[-20:]))
    assert main(["report", str(tmp_path)]) == 0, capsys.readouterr().err
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["left_out"]["held_out"]["questions"] == 20 and s["n_test"] == 80


def test_rows_no_held_out_question_has_end_in_one_line_in_the_study_and_in_fcprag_report(tmp_path, capsys):
    qs, results = synthetic()
    rows = ScoredRows.from_dicts(qs, {k: v for k, v in results.items() if "random_controller" not in k})
    with pytest.raises(FcpragError) as e:  # the study's summary stage, interrupted before the last rows
        summary.finish(rows, _ctrls({}), given=False, stage_seconds={}, out=tmp_path, policy=Policy(),
                       settings={"model": "m", "device": "cpu", "dtype": "float32"})
    assert "\n" not in str(e.value) and "random_controller, random_controller_combine on all 40" in str(e.value)
    _table_copy(tmp_path, keep=lambda r: "random_controller" not in r["id"])
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "random_controller" in err and "Traceback" not in err


def test_target_f1_takes_the_unit_of_summary_json_and_refuses_points_in_one_line(tmp_path, capsys):
    for bad in ("5", "0", "0.6"):
        assert main(["report", str(tmp_path), "--target-f1", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--target-f1 {bad}" in err and "fraction of 1" in err
    assert main(["report", str(tmp_path), "--target-f1", "5"]) == 2
    assert "5 looks like F1 points: give 0.05 for 5 points" in capsys.readouterr().err
    p = Policy.checked(min_gain=0.02, min_scale_gain=None, target_f1=0.05)
    assert p.target_f1 == 0.05
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.02)" in helped and "(default: 0.03)" in helped and "0.03 = 3 points" in helped


@pytest.mark.slow  # a re-report of the table study
def test_the_table_study_re_reported_says_its_margin_its_comparisons_and_its_units(tmp_path, capsys):
    _table_copy(tmp_path)
    assert main(["report", str(tmp_path), "--target-f1", "0.05"]) == 0, capsys.readouterr().err
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["f1_unit"] == "fraction" and s["policy"]["target_f1"] == 0.05
    scopes = [s["verdict"]["what_to_run"], *s["verdict"]["what_to_run_by_dataset"].values()]
    for w in scopes:
        ru = w["runner_up"]
        assert ru["row"] != w["row"] and isinstance(ru["lead_f1"], float) and ru["ci_f1"][0] <= ru["lead_f1"]
        assert ("vs_prag_sum" in w) == (w["row"] != "prag_sum") and "vs_host" not in w
        # n_needed for 5 points, by hand from the recorded SD and level
        v = w["vs_standard_rag"]
        zz = statistics.NormalDist().inv_cdf(1 - (1 - w["level"]) / 2) + statistics.NormalDist().inv_cdf(0.8)
        assert v["n_needed"] == math.ceil((zz * v["sd_f1"] / 0.05) ** 2)
    assert s["verdict"]["what_to_run_by_dataset"]["2wiki"]["runner_up"]["row"] == "vanilla"
    tv = s["training_verdict"]["param"]
    assert tv["trainer_kept"] == "network" and "shipped" not in tv
    text = (tmp_path / "report.md").read_text()
    assert "learned vs prag_sum +0.0001 [+0.000003, +0.0002]" in text  # the interval's lower end above 0, shown
    assert "0.199" not in text and "F1 (%)" not in text  # F1 in points only
    assert "Re-reported by `fcprag report`" in text and "Stage times of this invocation" not in text
