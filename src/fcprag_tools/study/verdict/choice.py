""""What to run" (``verdict.what_to_run``, ``verdict.what_to_run_by_dataset``): among the candidates
(:data:`.tables.CANDIDATES` less a ``recommended`` row that is PRAG's sum), the row with the highest mean F1 on the
training questions (a tie: PRAG's sum when tied, else the cheapest tied row, and said as a tie), overall and per
dataset; its F1 against ``standard_rag`` and against the host's own row of its setting on the held-out questions,
paired percentile-bootstrap intervals Bonferroni-corrected over every interval of the choice, each with the smallest
difference it can detect at 80% power (``mde_f1``) and the questions a target effect needs (``n_needed``). With a
given controller nothing is trained: the choice is made on the evaluated questions themselves and says so
(descriptive)."""

from __future__ import annotations

from typing import Mapping, Sequence

from ..options import Policy
from ..stats import detectable, paired
from .records import Choice, Comparison, ScoredRows, SettingVerdict, mean, suffix
from .tables import CANDIDATES

HOST_ROW = {"vanilla": "prag_sum", "standard_rag": "prag_sum", "prag_sum": "prag_sum", "recommended": "prag_sum",
            "prag_sum_combine": "prag_sum_combine", "recommended_combine": "prag_sum_combine"}
WHAT_TO_RUN_BOOT = 10_000
READINGS = ("same", "tie", "better", "worse", "equivalent", "not_shown")  # a held-out F1 comparison's reading
TIE = 1e-9  # training means this close are equal (the same answers give the same F1 mean)


def candidates(verdicts: Mapping[str, SettingVerdict]) -> list[str]:
    """:data:`CANDIDATES`, less a ``recommended`` row that is PRAG's sum of its setting (the same answers twice)."""
    same = {f"recommended{suffix(s)}" for s, v in verdicts.items() if v.recommended_row == f"prag_sum{suffix(s)}"}
    return [c for c in CANDIDATES if c not in same]


def compare(row: str, diffs: Sequence[float], seed: str, level: float, target: float, power: float) -> Comparison:
    """One held-out F1 comparison against ``row``: the paired mean, its ``level`` interval, what it can detect and
    its reading: ``tie`` (every difference 0), ``better`` / ``worse`` (the interval excludes 0), ``equivalent``
    (inside ``±target``), else ``not_shown``."""
    d, ci = paired(diffs, seed, level, WHAT_TO_RUN_BOOT)
    det = detectable(diffs, level, target, power)
    reading = ("tie" if det["n_nonzero"] == 0 else "better" if ci[0] > 0 else "worse" if ci[1] < 0 else
               "equivalent" if -target < ci[0] and ci[1] < target else "not_shown")
    return Comparison(row, reading, d, ci, det["mde"], det["n_needed"], det["n_nonzero"], det["sd"])


def what_to_run(rows: ScoredRows, test: Sequence[str], *, descriptive: bool, cands: Sequence[str] = CANDIDATES,
                policy: Policy) -> tuple[Choice | None, dict[str, Choice]]:
    """``(overall, {dataset: choice})``: the candidate of ``cands`` with the highest training F1 (a tie: PRAG's sum
    when it is among the tied, else the cheapest of them) and its held-out comparisons (:func:`compare`)."""
    qs = rows.questions
    choose_on = list(test) if descriptive else rows.train
    if not choose_on or not all(rows.has(q, c) and rows.score(q, c).f1 is not None for q in choose_on
                                for c in cands):
        return None, {}
    datasets = list(dict.fromkeys(qs[q].dataset for q in test))
    level = 1 - 0.05 / (2 * (1 + len(datasets)))  # Bonferroni over every interval of the choice

    def one(dataset: str | None) -> Choice:
        inside = lambda qids: [q for q in qids if dataset is None or qs[q].dataset == dataset]  # noqa: E731
        cq, hq = inside(choose_on), inside(test)
        means = {c: mean([rows.score(q, c).get("f1") for q in cq]) for c in cands}
        tied = [c for c in cands if means[c] >= max(means.values()) - TIE]
        best = "prag_sum" if "prag_sum" in tied else tied[0]
        comparisons = {}
        for key, other in (("vs_standard_rag", "standard_rag"), ("vs_host", HOST_ROW[best])):
            if best == other:
                comparisons[key] = Comparison(other, "same", 0.0, [0.0, 0.0])
                continue
            comparisons[key] = compare(other, rows.diffs(hq, best, other, "f1"), f"what_to_run:{dataset}:{other}",
                                       level, policy.target_f1, policy.power)
        return Choice(best, tied if len(tied) > 1 else [], "held-out (descriptive)" if descriptive else "training",
                      len(cq), means, len(hq), level, policy.target_f1, policy.power,
                      mean([rows.score(q, best).get("f1") for q in hq]), comparisons)

    return one(None), {d: one(d) for d in datasets}
