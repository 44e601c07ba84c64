"""Every row's figures on the held-out questions: means per metric, per dataset and per subtask, each row paired
against the host's row of its setting, how the questions were split, and the gold-passage ceiling."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..ceiling import reached
from ..options import Policy
from ..stats import detectable, paired
from .catalogue import ALWAYS, CANDIDATES
from .records import METRICS, ScoredRows, SettingVerdict, mean

# the rows a PRAG user compares (the paper's table), in this order: the candidates of "what to run" first; the rows
# every study scores are required (TABLE_ROWS), the others shown where scored (PAPER_ROWS)
PAPER_ROWS = (*CANDIDATES, "random_controller", "random_controller_combine")
TABLE_ROWS = (*ALWAYS, "random_controller", "random_controller_combine")


def row_names(rows: ScoredRows, test: Sequence[str]) -> list[str]:
    """Every row measured on all the held-out questions, the paper's rows first, then in first-scored order."""
    inside = set(test)
    seen = dict.fromkeys(name for q, name in rows.scores if q in inside)
    names = [n for n in seen if not n.startswith("loo:") and all(rows.has(q, n) for q in test)]
    return [n for n in PAPER_ROWS if n in names] + [n for n in names if n not in PAPER_ROWS]


def partial_rows(rows: ScoredRows, test: Sequence[str]) -> dict[str, int]:
    """The rows scored on some of the held-out questions ``test`` but not all (left out of the tables): ``{row:
    questions lacking it}``."""
    inside = set(test)
    seen = dict.fromkeys(name for q, name in rows.scores if q in inside and not name.startswith("loo:"))
    lacking = {n: sum(not rows.has(q, n) for q in test) for n in seen}
    return {n: k for n, k in lacking.items() if k}


def metric_means(rows: ScoredRows, qids: Sequence[str], name: str) -> dict[str, Any]:
    scores = [rows.score(q, name) for q in qids]
    return {m: mean([s.get(m) for s in scores if s.get(m) is not None]) for m in METRICS}


def breakdown(rows: ScoredRows, keys: Sequence[str], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(by_dataset, by_subtask)`` of one row: F1 / EM means and n per ``"<dataset>/<subtask>"``; per dataset
    also the gold log-lik., the macro F1 over its subtasks and the F1 mean's 95% CI (for the plot)."""
    qs = rows.questions
    by_subtask: dict[str, Any] = {}
    by_dataset: dict[str, Any] = {}
    for d in dict.fromkeys(qs[q].dataset for q in keys):
        dq = [q for q in keys if qs[q].dataset == d]
        subs = {}
        for s in sorted(dict.fromkeys(qs[q].subtask for q in dq)):
            sq = [q for q in dq if qs[q].subtask == s]
            m = metric_means(rows, sq, name)
            subs[s] = by_subtask[f"{d}/{s}"] = {"f1": m["f1"], "em": m["em"], "n": len(sq)}
        m = metric_means(rows, dq, name)
        f1s = [rows.score(q, name).get("f1") for q in dq]
        ci = paired([float(x) for x in f1s], f"f1:{d}")[1] if all(x is not None for x in f1s) else None
        macro = [v["f1"] for v in subs.values() if v["f1"] is not None]
        by_dataset[d] = {"f1": m["f1"], "em": m["em"], "logprob": m["logprob"], "n": len(dq),
                         "f1_macro": mean(macro) if len(macro) == len(subs) else None, "ci95_f1": ci}
    return by_dataset, by_subtask


def host_of(name: str) -> str:
    """The host's own row in the setting of row ``name``: what its deltas are paired against."""
    return "prag_sum_combine" if name.endswith("_combine") or name == "standard_rag" else "prag_sum"


def paired_table(rows: ScoredRows, keys: Sequence[str], names: Sequence[str], policy: Policy) -> dict[str, Any]:
    """Each row against the host's row of its setting (``against``), every metric, paired over ``keys``; for F1 also
    ``mde_f1`` and ``n_needed`` (for ``policy.target_f1``) at 95% (:func:`.stats.detectable`)."""
    pairs: dict[str, Any] = {}
    for n in names:
        against = host_of(n)
        if n == against:
            continue
        pairs[n] = {"against": against}
        for m in METRICS:
            both = [q for q in keys if None not in (rows.score(q, n).get(m), rows.score(q, against).get(m))]
            diffs = rows.diffs(both, n, against, m)
            d, ci = paired(diffs, m) if diffs else (None, None)  # one resampling per metric for every row
            pairs[n][f"delta_{m}"], pairs[n][f"ci95_{m}"] = d, ci
            if m == "f1" and diffs:
                det = detectable(diffs, 0.95, policy.target_f1, policy.power)
                pairs[n]["mde_f1"], pairs[n]["n_needed"] = det["mde"], det["n_needed"]
    return pairs


def datasets_of(rows: ScoredRows, keys: Sequence[str]) -> dict[str, Any]:
    """Each dataset's held-out count and subtasks over ``keys``, in first-seen order."""
    qs = rows.questions
    return {d: {"n_test": sum(qs[q].dataset == d for q in keys),
                "subtasks": sorted({qs[q].subtask for q in keys if qs[q].dataset == d})}
            for d in dict.fromkeys(qs[q].dataset for q in keys)}


def split_info(rows: ScoredRows, settings: Mapping[str, Any]) -> dict[str, Any]:
    """How the questions were split (checked against each rule) and each ``dataset/subtask``'s train / test count."""
    from ..data import split_method

    strata: dict[str, dict[str, int]] = {}
    for r in rows.questions.values():
        c = strata.setdefault(f"{r.dataset}/{r.subtask}", {"train": 0, "test": 0, "n": 0})
        c[r.split] += 1
        c["n"] += 1
    ids = [{"id": r.id, "dataset": r.dataset, "subtask": r.subtask} for r in rows.questions.values()]
    return {"method": split_method(ids, set(rows.test), settings), "strata": strata}


def ceiling_info(rows: ScoredRows, keys: Sequence[str], pairs: Mapping[str, Any],
                 verdicts: Mapping[str, SettingVerdict]) -> dict[str, Any]:
    """The gold-passage ceiling per setting (:func:`.ceiling.reached`), or why its row is absent."""
    per = {s: reached(pairs, s, v.held.reweighting.measured) for s, v in verdicts.items()}
    if all(per.values()):
        return {"why_absent": None, "settings": per}
    titles = [rows.questions[q].supporting_titles for q in keys]
    if all(t is None for t in titles):
        why = ("questions.jsonl records no supporting titles: the study's rows predate the gold_passages row (a "
               "fresh study scores it)")
    elif not all(titles):
        why = (f"{sum(not t for t in titles)} of {len(titles)} held-out questions carry no supporting titles (the "
               "data gives none), and the row needs every one")
    else:
        why = "the gold_passages rows were not scored in this study folder (a fresh study scores them)"
    return {"why_absent": why, "settings": {}}
