"""The plan's primary analysis (PLAN.md): the recommended controller against PRAG's sum on the pooled 200 held-out
questions, the remake's 60 and this check's 140, each question's deltas from the run that built its adapters.

    python benchmarks/efficacy/check/pool.py extract REMAKE_OUT CHECK_OUT   # -> per_question.jsonl (committed)
    python benchmarks/efficacy/check/pool.py                                # -> pooled.json, printed

``extract`` keeps, per held-out question, the ``prag_sum`` row and the row the controller's weights equal
(``scale:2``: its ``w~`` is ``[2.0] * N``, checked), and checks that their means reproduce each run's
``summary.json`` (``prag_sum`` and ``recommended``). The rows of one run are resampled as ``fcprag study`` resamples
them (seeded by the metric), so their CIs are the ones in that run's ``summary.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fcprag_tools.study.stats import paired

HERE = Path(__file__).parent
METRICS = ("logprob", "f1", "em", "acc")
KAPPA = 2.0


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def extract(runs: dict[str, Path]) -> None:
    out = []
    for run, folder in runs.items():
        qs = {q["id"]: q for q in _jsonl(folder / "questions.jsonl") if q["split"] == "test"}
        rows = {r["id"]: r for r in _jsonl(folder / "eval.jsonl")}
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        mine = []
        for qid, q in qs.items():
            base, rec = rows[f"{qid}|prag_sum"], rows[f"{qid}|scale:{KAPPA:g}"]
            assert rec["w"] == [KAPPA] * len(rec["w"]) and base["w"] == [1.0] * len(base["w"]), qid
            mine.append({"id": qid, "run": run, "dataset": "hotpotqa" if len(qid) == 24 else "2wiki",
                         **{f"{m}_sum": base[m] for m in METRICS}, **{f"{m}_rec": rec[m] for m in METRICS}})
        for m in METRICS:  # the run's own summary, reproduced from these rows
            for side, name in (("sum", "prag_sum"), ("rec", "recommended")):
                mean = sum(r[f"{m}_{side}"] for r in mine) / len(mine)
                assert abs(mean - summary["methods"][name][m]) < 1e-6, (run, m, name, mean)
        out += mine
        print(f"{run}: {len(mine)} held-out questions")
    (HERE / "per_question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")


def report() -> dict:
    rows = _jsonl(HERE / "per_question.jsonl")
    res: dict = {}
    parts = {"pooled": lambda r: True, "remake (60)": lambda r: r["run"] == "remake",
             "check (140)": lambda r: r["run"] == "check", "hotpotqa": lambda r: r["dataset"] == "hotpotqa",
             "2wiki": lambda r: r["dataset"] == "2wiki"}
    runs = ("remake (60)", "check (140)")  # seeded as fcprag study seeds them: the CIs of each run's summary.json
    for name, keep in parts.items():
        sel = [r for r in rows if keep(r)]
        if not sel:
            continue
        res[name] = {"n": len(sel)}
        for m in METRICS:
            d, ci = paired([r[f"{m}_rec"] - r[f"{m}_sum"] for r in sel], m if name in runs else f"check:{name}:{m}")
            res[name][m] = {"delta": d, "ci95": ci}
        res[name]["share_losing_0.1_logprob"] = sum(r["logprob_rec"] - r["logprob_sum"] < -0.1 for r in sel) / len(sel)
    p = res["pooled"]
    res["primary"] = {"logprob_ci_above_0": p["logprob"]["ci95"][0] > 0, "f1_ci_lower_not_below_-0.02":
                      p["f1"]["ci95"][0] >= -0.02}
    (HERE / "pooled.json").write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    for name, r in res.items():
        if name != "primary":
            print(f"{name:12s} n={r['n']:3d}  " + "  ".join(
                f"{m} {r[m]['delta']:+.4f} [{r[m]['ci95'][0]:+.4f}, {r[m]['ci95'][1]:+.4f}]" for m in METRICS))
    print("primary:", res["primary"])
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == ["extract"]:
        extract({"remake": Path(sys.argv[2]), "check": Path(sys.argv[3])})
    report()
