"""The two-dataset efficacy report (``report.py``) on small synthetic caches with known values, the bootstrap, the
held-out command's section, and the perturbations the evaluation uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import analysis
import common
import evaluate
import report

CHOSEN = "kl-paper-k1"
OTHER = "risk-paper-k1"
N_TEST = {"hotpotqa": 6, "2wiki": 4}  # even counts: the +-0.02 noise below has mean 0 in each dataset
DISCUSSION = "## Hand-written discussion (toy)\n\nThe toy controller gains 0.1 everywhere.\n"


def _results(ds: str, n: int, combine_questions: int) -> list[dict]:
    """Gold log-lik. rows: the chosen configuration = prag_sum + 0.1 + noise (its seeds at -0.05, 0, +0.05 around
    that); replace-one costs prag_sum 0.2 and the chosen configuration 0.1; repeat-one costs nothing."""
    rows = []

    def add(q, cond, mode, name, v):
        rows.append({"key": f"{ds}|q{q}|{cond}|{mode}", "name": name, "logprob": round(v, 6)})

    for q in range(n):
        prag = -2.0 - 0.1 * q
        noise = 0.02 if q % 2 else -0.02
        for cond, shift_prag, shift_mine in (("clean", 0.0, 0.0), ("replace", -0.2, -0.1), ("repeat", 0.0, 0.0)):
            add(q, cond, "param", "prag_sum", prag + shift_prag)
            add(q, cond, "param", "average", prag - 0.5 + shift_prag)
            for s in range(3):
                add(q, cond, "param", f"learned:{CHOSEN}:s{s}", prag + 0.1 + noise + 0.05 * (s - 1) + shift_mine)
        for name, v in (("random", prag), ("best_kappa", prag), ("best_cos", prag - 0.01), ("best_bm25", prag),
                        ("oracle", prag + 0.3), ("loo:0", prag - 0.1), ("loo:1", prag - 0.1), ("loo:2", prag - 0.1)):
            add(q, "clean", "param", name, v)
        for s in range(3):
            add(q, "clean", "param", f"learned:{OTHER}:s{s}", prag - 0.05)
        if q < combine_questions:  # the combine pass did not finish
            add(q, "clean", "combine", "prag_sum", prag + 0.5)
            add(q, "clean", "combine", f"learned:{CHOSEN}:s0", prag + 0.6)
    add(0, "clean", "param", "prag_sum", -2.0)  # scored twice (same value)
    return rows


def _meta(ds: str, n: int) -> list[dict]:
    """Two lines per question (clean) to be merged: PRAG's and the average's weights, then the learned seeds'."""
    rows = []
    for q in range(n):
        base = {"dataset": ds, "id": f"q{q}", "condition": "clean", "positions": ["a", "b", "c"],
                "supporting": [True, False, False], "rank": [0, 1, 2]}
        rows.append(dict(base, weights={"prag_sum": [1.0, 1.0, 1.0], "average": [1 / 3] * 3,
                                        "best_kappa": [0.0, 0.0, 0.0], "loo:0": [0.0, 1.0, 1.0]}, calibration={}))
        rows.append(dict(base, weights={f"learned:{CHOSEN}:s0": [2.0, 0.5, 0.5],
                                        f"learned:{CHOSEN}:s1": [1.0, 1.0, 1.0],
                                        f"learned:{CHOSEN}:s2": [1.5, 0.75, 0.75]},
                         calibration={f"learned:{CHOSEN}:s{s}": [0.5 + 0.1 * s, 0.2 + 0.01 * q, 1.0]
                                      for s in range(3)}))
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    common.write_json(path, obj)


def _controller(cand: str, seed: int, gain: float | None, lo: float = 0.0, hi: float = 0.0) -> dict:
    cv = None if gain is None else {"gain": gain, "ci95": [lo, hi], "verdict": "better_than_uniform" if lo > 0 else
                                    "unproven", "selected_epochs": 3, "folds": 5, "n_groups": 8, "objective": "kl",
                                    "metric": "first-order held-out gain"}
    return {"candidate": cand, "seed": seed, "options": {}, "epochs_max": 10, "questions": 8, "seconds": 12.5,
            "cv": cv, "metrics": {}}


def _analysis_inputs(root: Path) -> tuple[dict, dict]:
    results = {ds: common.read_jsonl(root / ds / "results_test.jsonl") for ds in N_TEST
               if (root / ds / "results_test.jsonl").exists()}
    cv: dict[str, list[float]] = {}
    for p in sorted((root / "controllers").glob("*.json")):
        m = json.loads(p.read_text())
        if m["cv"]:
            cv.setdefault(m["candidate"], []).append(m["cv"]["gain"])
    return results, cv


def _write_analysis(root: Path) -> dict:
    """``cache/analysis.json`` as ``analysis.py`` writes it."""
    out = analysis.analyse(*_analysis_inputs(root))
    _write_json(root / "analysis.json", out)
    return out


def _stale_png_and_others(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "efficacy_hotpotqa_g_tau.png").write_bytes(b"stale")  # a plot name the report does not write
    (out / "other.png").write_bytes(b"not ours")


def _toy_caches(base: Path) -> tuple[Path, dict]:
    """A complete toy study under ``base/cache``: both datasets evaluated (but the combine pass on 3 questions
    only), controllers, analysis.json, timings, scope, discussion; no learning curve."""
    root = base / "cache"
    for ds, n in N_TEST.items():
        _write_jsonl(root / ds / "retrieval.jsonl",
                     [{"id": f"q{q}", "dataset": ds, "split": "test", "passages": [
                         {"pid": f"{ds}{q}{k}", "supporting": k == 0} for k in range(6)]} for q in range(n)]
                     + [{"id": f"t{q}", "dataset": ds, "split": "train", "passages": []} for q in range(3)])
        _write_jsonl(root / ds / "results_test.jsonl", _results(ds, n, 3 if ds == "hotpotqa" else 0))
        _write_jsonl(root / ds / "test_meta.jsonl", _meta(ds, n))
        _write_jsonl(root / ds / "adapters.jsonl", [
            {"pid": f"{ds}{k}", "steps": 4, "loss_at_step": {"passage": 3.0, "qa0": 2.0},
             "loss_after": {"passage": 2.5, "qa0": 1.5}, "group_size": 2, "group_seconds": 100.0,
             "finished": f"{ds}-T1"} for k in range(2)])
        _write_jsonl(root / ds / "timings.jsonl", [{"stage": "retrieve", "seconds": 2.0}])
    _write_jsonl(root / "timings.jsonl", [
        {"stage": "adapters-bench", "runs": [{"group": 1, "adapters_per_s": 0.04}], "dtype": "float32"},
        {"stage": "progress", "now_utc": "x", "adapters_done": {}},
        {"stage": "labels", "seconds": 100.0}, {"stage": "labels", "seconds": 50.0},
        {"stage": "eval", "seconds": 30.0}])
    for s in range(3):
        _write_json(root / "controllers" / f"{CHOSEN}-s{s}.json", _controller(CHOSEN, s, 0.02, 0.01, 0.03))
        _write_json(root / "controllers" / f"{OTHER}-s{s}.json", _controller(OTHER, s, 0.005, -0.01, 0.02))
    _write_json(root / "controllers" / "risk-side-query-s0.json", _controller("risk-side-query", 0, None))
    _write_json(root / "scope.json", {"frozen_utc": "T", "reason": "compute", "train_questions": {},
                                      "train_ids": {ds: ["t0", "t1"] for ds in N_TEST},
                                      "conditions": ["clean", "replace", "repeat"]})
    (base / "discussion.md").write_text(DISCUSSION)
    return root, _write_analysis(root)


def _run(out_dir: Path) -> tuple[str, dict]:
    report.main(["--boot", "50"])
    return (out_dir / "efficacy.md").read_text(), json.loads((out_dir / "efficacy.json").read_text())


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy study's caches and its report (built once for the tests that only read them)."""
    base = tmp_path_factory.mktemp("toy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "HERE", base)
        mp.setattr(report, "OUT_DIR", base / "out")
        _stale_png_and_others(base / "out")
        root, ana = _toy_caches(base)
        md, blob = _run(base / "out")
    return root, ana, md, blob, base / "out"


@pytest.fixture()
def out_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "HERE", tmp_path)
    monkeypatch.setattr(report, "OUT_DIR", tmp_path / "out")
    _stale_png_and_others(tmp_path / "out")
    return tmp_path / "out"


def test_primary_comes_first_and_equals_the_registered_analysis(toy):
    root, ana, md, blob, _ = toy
    p = ana["primary"]  # what analysis.analyse computed from the toy caches
    assert ana["chosen"] == CHOSEN and p["n"] == 10
    assert p["delta_loglik"] == pytest.approx(0.1, abs=1e-6)  # learned = prag_sum + 0.1 + zero-mean noise
    primary = md[md.index("## 2. Pre-registered primary"):md.index("## 3. Secondary")]
    assert f"| {p['n']} | {p['delta_loglik']:+.4f} | [{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}] | {p['p']:.4f} |" \
        in primary
    assert 0 < p["ci95"][0] < 0.1 < p["ci95"][1] and "**better than PRAG's sum**" in primary
    assert md.index("## 2. Pre-registered primary") < md.index("## 5. Every method")
    assert blob["analysis"]["primary"] == p and not blob["analysis_check"]["stale"]
    assert md.count("## Hand-written discussion (toy)") == 1 and md.count("gains 0.1 everywhere") == 1
    # secondary family: raw and Holm p of every tested comparison; 'alt' reported as dropped, not as a result
    sec = md[md.index("## 3. Secondary"):md.index("## 4. Candidate")]
    for name, v in ana["secondary"].items():
        if v.get("n") and v["n"] == sum(N_TEST[ds] for ds in v["datasets"]):
            assert f"| {name} | {v['n']} | {v['delta_loglik']:+.4f} |" in sec and f"{v['p_holm']:.4f} |" in sec
    assert f"learned:{CHOSEN}@param/alt | 0 | not run: dropped at the scope freeze" in sec
    assert f"learned:{CHOSEN}@combine/clean | 3/10 | not run to completion" in sec


def test_tables_seeds_retention_runs_and_plots(toy):
    _, _, md, blob, out_dir = toy
    cells = blob["cells"]
    pooled = "hotpotqa+2wiki"
    assert cells[f"learned:{CHOSEN}|clean|param|{pooled}"]["delta"][0] == pytest.approx(0.1, abs=1e-6)
    assert cells[f"average|clean|param|hotpotqa"]["delta"][0] == pytest.approx(-0.5, abs=1e-6)
    assert cells[f"learned:{OTHER}|clean|param|2wiki"]["delta"] == pytest.approx([-0.05] * 3, abs=1e-6)
    mean_h = sum(-2.0 - 0.1 * q for q in range(6)) / 6
    assert cells["prag_sum|clean|param|hotpotqa"]["mean"][0] == pytest.approx(mean_h, abs=1e-6)
    for s, d in ((0, 0.05), (1, 0.1), (2, 0.15)):  # each seed separately
        assert cells[f"learned:{CHOSEN}:s{s}|clean|param|{pooled}"]["delta"][0] == pytest.approx(d, abs=1e-6)
    # the unfinished combine pass is not a result
    comb = cells[f"prag_sum|clean|combine|{pooled}"]
    assert not comb["complete"] and "mean" not in comb and comb["n"] == {"hotpotqa": 3, "2wiki": 0}
    assert "not run (3/10 questions)" in md
    ret = blob["retention"]
    assert ret[f"prag_sum|replace|{pooled}"]["delta"][0] == pytest.approx(-0.2, abs=1e-6)
    assert ret[f"learned:{CHOSEN}|replace|{pooled}"]["delta"][0] == pytest.approx(-0.1, abs=1e-6)
    assert ret[f"average|repeat|{pooled}"]["delta"] == pytest.approx([0.0] * 3, abs=1e-6)
    # CV: every run listed (the one without a CV result too), the chosen one marked
    for name in [f"{CHOSEN}-s{s}.json" for s in range(3)] + [f"{OTHER}-s{s}.json" for s in range(3)] + \
            ["risk-side-query-s0.json"]:
        assert f"`{name}`" in md
    assert "no CV result" in md and f"**{CHOSEN}** (chosen)" in md
    assert "| risk-side-query | 0 | — | 0 of 1 |" in md
    # every row name present, seeds and leave-one-out included; the repeated row is reported
    runs = blob["runs"]["results_test_rows"]
    assert runs["loo:2"]["2wiki clean/param"] == 4 and runs[f"learned:{CHOSEN}:s1"]["hotpotqa replace/param"] == 6
    assert "`loo:0`" in md and "scored more than once" in md
    # calibration: the chosen seeds' (g, tau)
    cal = blob["calibration"][f"learned:{CHOSEN}:s2"]["clean"]
    assert cal["n"] == 10 and cal["g_mean"] == pytest.approx(0.7)
    # cost: summed per stage; bench and progress rows apart; an adapter group counted once
    st = blob["cost"]["stages"]
    assert st["labels"] == {"runs": 2, "seconds": 150.0, "source": "cache/timings.jsonl"}
    assert st["retrieve"]["seconds"] == 4.0 and st["train (controller runs)"]["seconds"] == 87.5
    assert st["adapters (groups logged in adapters.jsonl)"] == {"runs": 2, "seconds": 200.0,
                                                                "source": "cache/<ds>/adapters.jsonl"}
    assert "progress" not in st and "adapters-bench" not in st and "Adapter bench" in md
    # plots written, the stale one deleted, others' files kept; no learning curve: said so
    written = sorted(p.name for p in out_dir.glob("efficacy_*.png"))
    assert written == sorted(blob["plots"]) == ["efficacy_delta.png", "efficacy_g_tau.png", "efficacy_retention.png",
                                                "efficacy_supporting_weight.png"]
    assert all((out_dir / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in written)
    assert (out_dir / "other.png").exists()
    assert "## 9. Learning curve\n\nNot run: the `curve` stage" in md


def test_meta_lines_are_merged_and_the_supporting_share_is_exact(toy):
    meta, conflicts = report.merge_meta(_meta("hotpotqa", 2) + [
        {"dataset": "hotpotqa", "id": "q0", "condition": "clean", "positions": ["x", "y", "z"], "supporting": [],
         "weights": {"prag_sum": [9.0, 9.0, 9.0]}}])  # disagrees on the positions: ignored, counted
    assert conflicts == 1
    m = meta[("hotpotqa", "q0", "clean")]
    assert set(m["weights"]) == {"prag_sum", "average", "best_kappa", "loo:0"} | {f"learned:{CHOSEN}:s{s}"
                                                                                  for s in range(3)}
    assert m["weights"]["prag_sum"] == [1.0, 1.0, 1.0] and set(m["calibration"]) == {f"learned:{CHOSEN}:s{s}"
                                                                                     for s in range(3)}
    assert report.supporting_share([2.0, 0.5, 0.5], [True, False, False]) == pytest.approx(2 / 3)
    assert report.supporting_share([1.0, 3.0], [False, True]) == pytest.approx(0.75)
    assert report.supporting_share([0.0, 0.0], [True, False]) is None
    sh = toy[3]["supporting_share"]["clean"]
    assert sh["prag_sum"]["mean"]["pooled"] == pytest.approx(1 / 3) and sh["prag_sum"]["n"]["pooled"] == 10
    assert sh[f"learned:{CHOSEN}:s0"]["mean"]["2wiki"] == pytest.approx(2 / 3)
    assert sh[f"learned:{CHOSEN}"]["mean"]["pooled"] == pytest.approx((2 / 3 + 1 / 3 + 1 / 2) / 3)  # seeds averaged
    assert sh["best_kappa"]["undefined"] == 10 and "loo:0" not in sh  # all-zero weights: no share


def test_missing_caches_are_reported_as_not_run(out_dir, tmp_path):
    md, blob = _run(out_dir)  # nothing at all: no crash, every part says what is missing
    for rel in ("hotpotqa/results_test.jsonl", "2wiki/test_meta.jsonl", "analysis.json", "controllers/", "curve/"):
        assert f"`cache/{rel}`: not run (" in md
    assert "## 2. Pre-registered primary" in md and "Not run: the `analysis` stage has not run" in md
    assert "Not run: the `eval` stage has not scored any test row yet." in md
    assert "Not written yet (`benchmarks/efficacy/discussion.md` does not exist)" in md
    assert blob["plots"] == [] and sorted(p.name for p in out_dir.glob("*.png")) == ["other.png"]
    assert blob["cells"] == {} and blob["analysis"] is None
    # one dataset half evaluated: the analysis has numbers, the report does not present them as a result
    root = tmp_path / "cache"
    _write_jsonl(root / "hotpotqa" / "retrieval.jsonl", [{"id": f"q{q}", "dataset": "hotpotqa", "split": "test",
                                                          "passages": []} for q in range(6)])
    _write_jsonl(root / "hotpotqa" / "results_test.jsonl",
                 [r for r in _results("hotpotqa", 3, 0) if "|clean|param" in r["key"]])
    _write_json(root / "controllers" / f"{CHOSEN}-s0.json", _controller(CHOSEN, 0, 0.01, -0.01, 0.02))
    ana = _write_analysis(root)
    assert ana["primary"]["n"] == 3
    md, blob = _run(out_dir)
    primary = md[md.index("## 2. Pre-registered primary"):md.index("## 3. Secondary")]
    assert "**Not a result**: the evaluation covered 3 of 6 test questions" in primary and "Reading:" not in primary
    assert "not run (3/6 questions)" in md and "mean" not in blob["cells"]["prag_sum|clean|param|hotpotqa"]
    assert "`cache/2wiki/results_test.jsonl`: not run (" in md
    assert "No candidate's CV gain has a 95% CI above 0" in md


def test_a_stale_analysis_file_is_flagged(toy, out_dir, tmp_path):
    import copy
    import shutil

    shutil.copytree(toy[0], tmp_path / "cache")
    ana = copy.deepcopy(toy[1])
    ana["primary"]["delta_loglik"] += 0.5  # as if computed from other results
    common.write_json(tmp_path / "cache" / "analysis.json", ana)
    md, blob = _run(out_dir)
    assert "**`analysis.json` is stale**" in md and blob["analysis_check"]["stale"]
    assert blob["analysis_check"]["delta_loglik"] == pytest.approx(0.1, abs=1e-6)


def test_bootstrap_ci_contains_the_mean_and_shrinks_with_n():
    import random

    r = random.Random(0)
    small = [r.gauss(1.0, 1.0) for _ in range(20)]
    large = [r.gauss(1.0, 1.0) for _ in range(200)]
    p1, lo1, hi1 = analysis.paired_bootstrap({"x": small}, "s", n=2000)
    p2, lo2, hi2 = analysis.paired_bootstrap({"x": large}, "l", n=2000)
    assert lo1 < p1 < hi1 and lo2 < p2 < hi2
    assert p1 == pytest.approx(sum(small) / 20)
    assert (hi2 - lo2) < (hi1 - lo1) / 2


def test_heldout_section_per_file_and_pooled_with_the_bar(tmp_path):
    def rows(file, n, gain, prompt="param"):
        out = []
        for q in range(n):
            prag = -2.0 - 0.1 * q
            for name, v in (("prag_sum", prag), ("learned", prag + gain + (0.01 if q % 2 else -0.01)),
                            ("learned_same_total", prag + gain - 0.05),
                            ("oracle", prag + 0.3), ("loo:0", prag - 1.0)):
                out.append({"key": f"{file}|q{q}|clean|{prompt}", "name": name, "logprob": v})
        return out

    for file, n, gain in (("fa", 6, 0.2), ("fb", 4, -0.5)):
        (tmp_path / file).mkdir()
        common.write_jsonl(tmp_path / file / "eval.jsonl", rows(file, n, gain) + rows(file, 2, 0.1, "combine"))
    L: list[str] = []
    out = report.heldout_section(tmp_path, L, 500)
    assert out["param"]["fa"]["learned"]["delta_loglik"] == pytest.approx(0.2)
    assert out["param"]["fb"]["learned"]["delta_loglik"] == pytest.approx(-0.5)
    pooled = out["param"]["pooled"]["learned"]
    assert pooled["n"] == 10 and pooled["delta_loglik"] == pytest.approx((6 * 0.2 - 4 * 0.5) / 10)
    assert pooled["ci95"][0] < pooled["delta_loglik"] < pooled["ci95"][1]
    assert out["combine"]["fa"]["learned"]["n"] == 2 and "loo:0" not in out["param"]["fa"]
    assert out["param"]["pooled"]["learned - learned_same_total"]["delta_loglik"] == pytest.approx(0.05)
    text = "\n".join(L)
    assert "| param | fa | 6 | `learned` |" in text and "| yes |" in text and "**no**" in text
    empty: list[str] = []
    assert report.heldout_section(tmp_path / "none", empty, 500) == {} and "Not run" in empty[-1]


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


# ----------------------------------------------------------------------------- the plots' content
@pytest.fixture
def figures(monkeypatch):
    """The plot functions' figures, kept open for inspection (``close`` records instead of closing)."""
    plt = report._plt()
    kept = []

    class Keep:
        def __getattr__(self, name):
            return getattr(plt, name)

        def close(self, fig):
            kept.append(fig)

    monkeypatch.setattr(report, "_plt", lambda: Keep())
    yield kept
    for fig in kept:
        plt.close(fig)


def test_method_labels_are_readable():
    assert report.method_label("learned:risk-side-kappa", "risk-side-kappa") == \
        "learned: risk, + side features, kappa tuned [chosen]"
    assert report.method_label("learned:kl-paper-k1:s2") == "learned: KL, paper features, kappa 1 (seed 2)"
    assert report.method_label("learned:risk-side-query") == "learned: risk, + side features, per-query scale"
    assert report.method_label("best_kappa") == "fixed scale (w~ = kappa, tuned)"
    assert report.method_label("something-new") == "something-new"  # unknown names are shown as they are


def test_forest_plot_has_a_title_and_readable_rows(figures, tmp_path):
    rows = [("prag_sum", [0.0, 0.0, 0.0]), ("best_cos", [0.001, -0.001, 0.002]),
            (f"learned:{CHOSEN}", [0.12, 0.09, 0.15]), ("oracle", [0.2, 0.15, 0.24])]
    report.plot_delta(rows, tmp_path / "d.png", CHOSEN)
    ax = figures[0].axes[0]
    assert "PRAG's sum" in ax.get_title()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "learned: KL, paper features, kappa 1 [chosen]" in labels and "fixed cosine (g, tau tuned)" in labels
    assert not any(":" in lb.split(" ")[0] and "-" in lb for lb in labels), labels  # no internal row names
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_learning_curve_legend_matches_the_points(figures, tmp_path):
    """One legend entry per seed, in that seed's colour."""
    pts = [{"questions": q, "seed": s, "candidate": "risk-side-kappa", "gain": 0.2 + 0.01 * s,
            "ci95": [0.1, 0.3]} for q in (16, 32, 64, 126) for s in (0, 1)]
    report.plot_curve(pts, tmp_path / "c.png")
    ax = figures[0].axes[0]
    legend = ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert sorted(t for t in texts if t.startswith("seed")) == ["seed 0", "seed 1"]
    import matplotlib.colors as mcolors

    point_colors = {}
    for container in ax.containers:  # one errorbar container per seed: its data line and its label
        line = container.lines[0]
        point_colors[container.get_label()] = mcolors.to_hex(line.get_color())
        assert len(line.get_xdata()) == 4  # the seed's four sizes, one connected line
    handle_colors = {t: mcolors.to_hex(h.lines[0].get_color() if hasattr(h, "lines") else h.get_color())
                     for t, h in zip(texts, legend.legend_handles) if t.startswith("seed")}
    assert handle_colors == point_colors and len(set(point_colors.values())) == 2
    assert "learned: risk, + side features, kappa tuned" in ax.get_title()


def test_supporting_share_axis_shows_small_differences(figures, tmp_path):
    """0.518 vs 0.549 must be visible: the axis is zoomed (not from 0), no legend covers the points, and the
    perturbed conditions get their own panel and axis."""
    def entry(v):
        return {"mean": {"pooled": v}, "n": {"pooled": 256}, "undefined": 0}

    shares = {"clean": {"prag_sum": entry(0.518), "learned:risk-side-kappa": entry(0.535),
                        "learned:kl-side-k1": entry(0.549)},
              "replace": {"prag_sum": entry(0.340), "learned:risk-side-kappa": entry(0.339)}}
    methods = ["prag_sum", "learned:risk-side-kappa", "learned:kl-side-k1"]
    report.plot_share(shares, methods, tmp_path / "s.png", "risk-side-kappa")
    fig = figures[0]
    clean, replace = fig.axes
    lo, hi = clean.get_xlim()
    assert lo > 0.4 and (0.549 - 0.518) / (hi - lo) > 0.3
    assert replace.get_xlim()[0] > 0.3 and replace.get_xlim()[1] < 0.4
    assert clean.get_legend() is None and replace.get_legend() is None
    assert "clean" in clean.get_title() and "replace-one" in replace.get_title()
    assert "learned: risk, + side features, kappa tuned [chosen]" in [t.get_text() for t in clean.get_yticklabels()]
    assert "do not start at 0" in fig._suptitle.get_text()


def test_g_tau_pools_the_overlapping_conditions_and_names_them(figures, tmp_path):
    pts = {f"learned:{CHOSEN}:s{s}": {c: [(0.7 + 0.001 * i, 0.6 - 0.001 * i) for i in range(5)]
                                       for c in ("clean", "replace", "repeat")} for s in range(3)}
    report.plot_g_tau(pts, tmp_path / "g.png")
    left, right = figures[0].axes
    assert len(left.collections) == 3  # one point set per seed, not one per (seed, condition)
    assert sorted(t.get_text().split(":")[0] for t in left.get_legend().get_texts()) == ["seed 0", "seed 1",
                                                                                       "seed 2"]
    conds = " ".join(t.get_text() for t in right.get_yticklabels())
    assert "a passage from another question" in conds and "a passage listed twice" in conds
    assert "learned: KL, paper features, kappa 1" in figures[0]._suptitle.get_text()
