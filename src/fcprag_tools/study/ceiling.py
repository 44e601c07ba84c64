"""The gold-passage ceiling row ``gold_passages``: what a reweighting could reach if it knew which retrieved passages
support the answer (the data's supporting titles; it reads the answer's evidence, so it is a reference, not a
method).

Its ``w~`` keeps PRAG's total ``N`` (the number of retrieved passages) and spreads it evenly over the supporting
passages, zero on the others; a question none of whose retrieved passages supports the answer keeps PRAG's sum
(every weight 1). A question that carries no supporting titles at all has no such row.
"""

from __future__ import annotations

from typing import Any, Sequence

ROW = "gold_passages"


def gold_passage_weights(passages: Sequence[dict[str, Any]], supporting_titles: Sequence[str] | None
                         ) -> list[float] | None:
    """``w~`` per passage (each ``{"title", ...}``): ``N / k`` on the ``k`` passages whose title is a supporting
    title, 0 elsewhere; ``[1.0] * N`` when ``k`` is 0; None when ``supporting_titles`` is empty or None."""
    if not supporting_titles:
        return None
    titles = set(supporting_titles)
    hits = [p["title"] in titles for p in passages]
    n, k = len(passages), sum(hits)
    return [n / k if h else 0.0 for h in hits] if k else [1.0] * n


def gold_rows(q: dict[str, Any], settings: Sequence[str]) -> dict[str, tuple[str, list[float]]]:
    """``{"gold_passages" + suffix: (setting, w~)}`` for one question in each of ``settings`` (``param``: no
    suffix); empty when the question records no supporting titles (``q["supporting_titles"]``)."""
    w = gold_passage_weights(q["passages"], q.get("supporting_titles"))
    return {} if w is None else {ROW + ("" if s == "param" else f"_{s}"): (s, w) for s in settings}


def reached(paired: dict[str, Any], setting: str, learned: bool) -> dict[str, Any] | None:
    """How much of the ceiling the learned controller reaches in ``setting``, from the paired table (each row
    against PRAG's sum of its setting): ``{"gold", "learned", "share"}`` of the gold log-lik. gain; ``share`` is
    None when the ceiling does not lie above PRAG's sum or no network was measured. None without the row."""
    sfx = "" if setting == "param" else f"_{setting}"
    gold = paired.get(ROW + sfx)
    if gold is None:
        return None
    net = paired.get("learned" + sfx) if learned else None
    g, l_ = gold["delta_logprob"], (net or {}).get("delta_logprob")
    return {"gold": g, "gold_f1": gold.get("delta_f1"), "learned": l_, "learned_f1": (net or {}).get("delta_f1"),
            "share": l_ / g if l_ is not None and g > 0 else None}
