""""What to run" (``verdict.what_to_run``, ``verdict.what_to_run_by_dataset``), overall and per dataset.

The choice: among the candidates (:data:`.catalogue.CANDIDATES` scored in the study, less a fusion row that is its
host's own row: a ``recommended`` row that is PRAG's sum, a ``dyprag_recommended`` row that is DyPRAG's), the
row with the highest mean F1 on the training questions; a tie goes to PRAG's sum when it is among the tied (nothing
changes for a PRAG user), else to the cheapest tied row, and is said as a tie.

Its margin, on the training questions it was chosen on: the runner-up (the next highest F1; ties: the cheapest) and
the choice's paired lead over it with a 95% percentile-bootstrap interval (``clear`` when it lies above 0), and the
same lead over each cheaper candidate: those whose interval reaches 0 are "not shown worse", named beside the choice
so that a user can trade cost against a difference the study could not see. Measured where it was chosen, the lead
is if anything optimistic.

A dataset's choice that differs from the overall one: its lead over the overall row on the dataset's training
questions (the same interval); only a clear lead makes it the row to follow there, else the overall row, chosen on
every dataset's questions and so better powered (a difference between scopes that is not shown is no reason to run
two settings).

Held out: the choice's F1 against standard RAG, PRAG's sum, a fusion's host row and the runner-up, each row once and
never the choice itself; paired percentile-bootstrap intervals at ``1 - 0.05 / m`` (Bonferroni over the ``m``
comparisons made in every scope), each with the smallest true difference it would detect at 80% power
(``mde_f1``) and the questions a target effect needs (``n_needed``, at that level; ``n_needed_95`` for a single
planned follow-up at 95%, which needs about a third fewer). With a given controller nothing is trained:
the choice is made on the evaluated questions themselves and says so (descriptive).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..options import Policy
from ..stats import detectable, paired
from .catalogue import CANDIDATES, ROWS, STATUS_QUO, cheaper
from .records import Choice, Comparison, HeldOutF1, Lead, ScoredRows, SettingVerdict, mean, suffix

WHAT_TO_RUN_BOOT = 10_000
READINGS = ("tie", "better", "worse", "equivalent", "not_shown")  # a held-out F1 comparison's reading
VS = ("vs_standard_rag", "vs_prag_sum", "vs_host", "vs_runner_up")  # a choice's held-out comparisons, in order
LEAD_LEVEL = 0.95  # the lead's interval on the training questions (where the choice was made)
TIE = 1e-9  # training means this close are equal (the same answers give the same F1 mean)
ALPHA = 0.05  # the family-wise error of the held-out comparisons


def same_as_host(verdicts: Mapping[str, SettingVerdict]) -> list[str]:
    """The fusion rows that are their host's own row: where a setting ships PRAG's sum, its ``recommended`` row is
    PRAG's sum and its ``dyprag_recommended`` row DyPRAG's own (``u = 1/N``), the same answers twice."""
    plain = {s for s, v in verdicts.items() if v.recommended_row == f"prag_sum{suffix(s)}"}
    return [r.name for r in ROWS.values() if r.controller and r.setting in plain]


def candidates(verdicts: Mapping[str, SettingVerdict], rows: ScoredRows) -> list[str]:
    """:data:`CANDIDATES` scored in this study (a row every study scores, or one scored on some question), less a
    fusion row that is its host's own row (:func:`same_as_host`)."""
    same = set(same_as_host(verdicts))
    scored = {name for _, name in rows.scores}
    return [c for c in CANDIDATES if c not in same and (ROWS[c].always or c in scored)]


def pick(means: Mapping[str, float]) -> tuple[str, list[str], str | None]:
    """``(choice, the rows tied with it, runner-up)`` from the mean F1 per candidate (see the module)."""
    top = max(means.values())
    tied = [c for c in means if means[c] >= top - TIE]
    best = STATUS_QUO if STATUS_QUO in tied else min(tied, key=lambda c: ROWS[c].cost)
    others = [c for c in means if c != best]
    if not others:
        return best, tied, None
    second = max(means[c] for c in others)
    return best, tied, min((c for c in others if means[c] >= second - TIE), key=lambda c: ROWS[c].cost)


def lead(rows: ScoredRows, qids: Sequence[str], best: str, other: str, seed: str) -> Lead:
    """``best``'s paired F1 lead over ``other`` on ``qids`` with its :data:`LEAD_LEVEL` interval."""
    d, ci = paired(rows.diffs(qids, best, other, "f1"), seed, LEAD_LEVEL, WHAT_TO_RUN_BOOT)
    return Lead(other, mean([rows.score(q, other).get("f1") for q in qids]), d, ci, LEAD_LEVEL)


def planned(best: str, runner_up: str | None) -> list[tuple[str, str]]:
    """The held-out comparisons of choice ``best``: ``[(key, row)]``, each row once and never ``best`` itself."""
    out, seen = [], {best}
    for key, row in zip(VS, ("standard_rag", "prag_sum", ROWS[best].host_row, runner_up)):
        if row is not None and row not in seen:
            out.append((key, row))
            seen.add(row)
    return out


def compare(row: str, diffs: Sequence[float], seed: str, level: float, target: float, power: float) -> Comparison:
    """One held-out F1 comparison against ``row``: the paired mean, its ``level`` interval, what it can detect and
    its reading: ``tie`` (every difference 0), ``better`` / ``worse`` (the interval excludes 0), ``equivalent``
    (inside ``±target``), else ``not_shown``."""
    d, ci = paired(diffs, seed, level, WHAT_TO_RUN_BOOT)
    det = detectable(diffs, level, target, power)
    reading = ("tie" if det["n_nonzero"] == 0 else "better" if ci[0] > 0 else "worse" if ci[1] < 0 else
               "equivalent" if -target < ci[0] and ci[1] < target else "not_shown")
    single = detectable(diffs, 0.95, target, power)["n_needed"]  # one planned follow-up, tested alone
    return Comparison(row, reading, d, ci, det["mde"], det["n_needed"], det["n_nonzero"], det["sd"], single)


def choice_questions(rows: ScoredRows, test: Sequence[str], cands: Sequence[str], descriptive: bool
                     ) -> tuple[list[str], list[str]]:
    """``(the questions the choice is made on, those left out for lacking a candidate's row)``: the training
    questions (``descriptive``: the held-out ones) with every candidate scored."""
    pool = list(test) if descriptive else rows.train
    keep = rows.complete(pool, cands)
    return keep, [q for q in pool if q not in set(keep)]


def choice_left_out(rows: ScoredRows, test: Sequence[str], cands: Sequence[str], descriptive: bool
                    ) -> dict[str, Any]:
    """``summary.json``'s ``left_out.choice``: how many of the questions the choice is made on lack a candidate's
    row, of how many, and which rows (``{row: questions lacking it}``)."""
    keep, left = choice_questions(rows, test, cands, descriptive)
    lacking = {c: sum(not rows.has(q, c) for q in left) for c in cands}
    return {"questions": len(left), "of": len(keep) + len(left), "rows": {c: k for c, k in lacking.items() if k}}


def what_to_run(rows: ScoredRows, test: Sequence[str], *, descriptive: bool, cands: Sequence[str] = CANDIDATES,
                policy: Policy) -> tuple[Choice | None, dict[str, Choice]]:
    """``(overall, {dataset: choice})`` chosen on the questions of :func:`choice_questions` and measured on the
    held-out ``test``; ``(None, {})`` without F1 there (``--no-generate``) or without any such question."""
    qs = rows.questions
    choose_on = choice_questions(rows, test, cands, descriptive)[0]
    if not choose_on or any(rows.score(q, c).f1 is None for q in choose_on for c in cands):
        return None, {}
    scopes: list[str | None] = [None, *dict.fromkeys(qs[q].dataset for q in test)]
    inside = lambda qids, d: [q for q in qids if d is None or qs[q].dataset == d]  # noqa: E731
    picks = {}
    for d in scopes:
        cq = inside(choose_on, d)
        picks[d] = (cq, {c: mean([rows.score(q, c).get("f1") for q in cq]) for c in cands})
    chosen = {d: pick(means) if cq else None for d, (cq, means) in picks.items()}
    m = sum(len(planned(best, ru)) for best, _, ru in filter(None, chosen.values()))
    level = 1 - ALPHA / max(m, 1)  # Bonferroni over the comparisons made in every scope

    def one(d: str | None) -> Choice | None:
        if chosen[d] is None:
            return None
        (cq, means), (best, tied, ru), hq = picks[d], chosen[d], inside(test, d)
        tag = f"{d}:" if d else ""
        margin = lead(rows, cq, best, ru, f"lead:{tag}{ru}") if ru else None
        below = [lead(rows, cq, best, c, f"lead:{tag}{c}") for c in sorted(cands, key=lambda c: ROWS[c].cost)
                 if c != best and cheaper(c, best)]
        held = {key: compare(row, rows.diffs(hq, best, row, "f1"), f"what_to_run:{d}:{row}", level, policy.target_f1,
                             policy.power) for key, row in planned(best, ru)}
        top = chosen[None][0] if chosen[None] else best
        return Choice(best, tied if len(tied) > 1 else [], "held-out (descriptive)" if descriptive else "training",
                      len(cq), means, margin, below,
                      HeldOutF1(len(hq), mean([rows.score(q, best).get("f1") for q in hq]), level, m,
                                policy.target_f1, policy.power, held),
                      lead(rows, cq, best, top, f"lead:{tag}overall:{top}") if d and top != best else None)

    by = {d: one(d) for d in scopes[1:]}
    return one(None), {d: c for d, c in by.items() if c is not None}
