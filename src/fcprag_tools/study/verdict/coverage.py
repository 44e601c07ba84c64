"""Which held-out questions the summary can use: those with every row it needs (the paper's rows, PRAG's sum and the
random controller of each setting, and each setting's scale and network rows). A question lacking some is left out
of every held-out figure, and the summary says which rows and how many questions; a needed row that no held-out
question has (an unfinished study: the random-controller rows are scored after the verdict) ends in one line."""

from __future__ import annotations

from typing import Any, Mapping

from fcprag_plugin.errors import FcpragError
from .records import SETTINGS, ControllerRecord, ScoredRows, suffix


class IncompleteRows(FcpragError):
    """The rows cannot make a summary (a needed row on no held-out question, or no question with them all)."""


def needed_rows(rows: ScoredRows, ctrls: Mapping[str, ControllerRecord]) -> list[str]:
    """The rows every held-out question must have for the summary."""
    test = rows.test
    names = ["vanilla", "standard_rag"]
    for s in SETTINGS:
        sfx, kappa = suffix(s), float(ctrls[s].kappa)
        names += [f"prag_sum{sfx}", f"random_controller{sfx}"] + ([f"scale:{kappa:g}{sfx}"] if kappa != 1.0 else [])
        if any(rows.has(q, f"learned{sfx}") for q in test):  # a network: its rows are measured
            names += [f"learned{sfx}", f"learned_same_total{sfx}"]
    return names


def coverage(rows: ScoredRows, needed: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``(the held-out questions with every row of needed, {"questions", "of", "rows": {row: questions lacking
    it}})``; raises :class:`IncompleteRows` when some needed row is on no held-out question, or none has them all."""
    test = rows.test
    lacking = {n: sum(not rows.has(q, n) for q in test) for n in needed}
    absent = [n for n, k in lacking.items() if test and k == len(test)]
    if absent:
        raise IncompleteRows(f"its rows lack {', '.join(absent)} on all {len(test)} held-out questions (an unfinished "
                             "study: the random-controller rows are scored after the verdict)")
    keep = rows.complete(test, needed)
    if not keep:
        raise IncompleteRows(f"none of its {len(test)} held-out questions has every row the summary needs "
                             f"({', '.join(n for n, k in lacking.items() if k)} missing on some)")
    return keep, {"questions": len(test) - len(keep), "of": len(test),
                  "rows": {n: k for n, k in lacking.items() if k}}
