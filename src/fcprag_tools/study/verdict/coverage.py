"""Which held-out questions the summary can use: those with every row it needs (the paper's rows, PRAG's sum and the
random controller of each setting, each setting's scale and network rows, and in a study with DyPRAG's rows its own
two, ``dyprag`` and ``dyprag_combine``, and its fusions once scored). A question lacking some is left out of every
held-out figure, and the summary says which rows and how many questions; a needed row that no held-out question has
ends in one line (saying, when they are the random-controller rows, that the study is unfinished: those are scored
after the verdict)."""

from __future__ import annotations

from typing import Any, Mapping

from fcprag_plugin.errors import FcpragError
from ..dyprag import FUSION, OWN, is_dyprag
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
    scored = {name for q, name in rows.scores if rows.questions[q].split == "test"}
    if any(is_dyprag(n) for n in scored):  # DyPRAG's rows: its own, and its fusions once they are scored
        names += [*OWN, *(n for n in FUSION if n in scored)]
    return names


def coverage(rows: ScoredRows, needed: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``(the held-out questions with every row of needed, {"questions", "of", "rows": {row: questions lacking
    it}})``; raises :class:`IncompleteRows` when some needed row is on no held-out question, or none has them all."""
    test = rows.test
    lacking = {n: sum(not rows.has(q, n) for q in test) for n in needed}
    absent = [n for n, k in lacking.items() if test and k == len(test)]
    if absent:
        late = all(n.startswith("random_controller") for n in absent)  # the rows scored after the verdict
        raise IncompleteRows(f"{', '.join(absent)} missing on all {len(test)} held-out questions"
                             + (" (an unfinished study: the random-controller rows are scored after the verdict)"
                                if late else ""))
    keep = rows.complete(test, needed)
    if not keep:
        raise IncompleteRows(f"none of the {len(test)} held-out questions has every row the summary needs "
                             f"({', '.join(n for n, k in lacking.items() if k)} missing on some)")
    return keep, {"questions": len(test) - len(keep), "of": len(test),
                  "rows": {n: k for n, k in lacking.items() if k}}
