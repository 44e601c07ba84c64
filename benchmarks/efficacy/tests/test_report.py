"""The efficacy report's statistics (bootstrap CIs, paired differences, retention) and perturbations."""

from __future__ import annotations

import json

import pytest

import common
import evaluate
import report


def test_bootstrap_ci_contains_the_mean_and_shrinks_with_n():
    import random

    r = random.Random(0)
    small = [r.gauss(1.0, 1.0) for _ in range(20)]
    large = [r.gauss(1.0, 1.0) for _ in range(400)]
    p1, lo1, hi1 = report.bootstrap({"x": small}, lambda v: report.mean(v["x"]), "s")
    p2, lo2, hi2 = report.bootstrap({"x": large}, lambda v: report.mean(v["x"]), "l")
    assert lo1 < p1 < hi1 and lo2 < p2 < hi2
    assert p1 == pytest.approx(sum(small) / 20)
    assert (hi2 - lo2) < (hi1 - lo1) / 2


def _row(qid, cond, mode, method, f1, lp, share=0.5, g=None):
    r = {"id": qid, "condition": cond, "mode": mode, "method": method, "f1": f1, "em": float(f1 == 1.0),
         "logprob": lp, "share_supporting": share}
    if g is not None:
        r.update(g=g, tau=0.5)
    return r


def test_analysis_of_a_synthetic_eval_file(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "HERE", tmp_path)
    rows = []
    for q in range(30):
        base = (q % 5) / 5
        for cond, factor in (("clean", 1.0), ("replace", 0.5), ("repeat", 1.0)):
            for mode in ("param",):
                rows.append(_row(f"q{q}", cond, mode, "prag_sum", base * factor, -2.0))
                rows.append(_row(f"q{q}", cond, mode, "learned:f1", min(1.0, base * factor + 0.2), -1.5, 0.8, g=0.9))
                rows.append(_row(f"q{q}", cond, mode, "random", base * factor, -2.0 + (0.1 if q % 2 else -0.1)))
                rows.append(_row(f"q{q}", cond, mode, "loo:0", 0.0, -3.0))
    d = common.cache_dir("toy")
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = report.analyse("toy")
    assert res["methods"] == ["prag_sum", "random", "learned:f1"]  # leave-one-out rows are not methods
    d_f1 = res["diff_vs_prag_sum"]["clean/param/learned:f1"]["f1"]
    assert d_f1[1] > 0 and report.verdict(d_f1) == "higher"
    d_lp = res["diff_vs_prag_sum"]["clean/param/random"]["logprob"]
    assert d_lp[1] < 0 < d_lp[2] and report.verdict(d_lp) == "no clear difference"
    ret = res["retention"]["replace/param/prag_sum"]["f1_retained"]
    assert ret[0] == pytest.approx(0.5)
    assert res["retention"]["repeat/param/prag_sum"]["f1_retained"][0] == pytest.approx(1.0)
    assert res["calibration"]["clean/param/learned:f1"]["g_mean"] == pytest.approx(0.9)


def test_perturbations_are_seeded_and_well_formed():
    def q(i):
        return {"id": f"q{i}", "passages": [{"pid": f"p{i}-{k}", "text": f"t{i}{k}", "supporting": k == 0}
                                            for k in range(3)]}

    rows = [q(i) for i in range(5)]
    ps, info = evaluate.perturb(rows[0], "replace", rows)
    assert len(ps) == 3 and ps[info["replaced_position"]]["pid"] == info["donor_pid"]
    assert info["donor"] != "q0" and not ps[info["replaced_position"]]["supporting"]
    assert sum(p["pid"] != o["pid"] for p, o in zip(ps, rows[0]["passages"])) == 1
    assert evaluate.perturb(rows[0], "replace", rows) == (ps, info)  # seeded
    ps2, info2 = evaluate.perturb(rows[0], "repeat", rows)
    assert len(ps2) == 4 and ps2[3] == ps2[info2["repeated_position"]]
    assert evaluate.perturb(rows[0], "clean", rows)[0] == rows[0]["passages"]
