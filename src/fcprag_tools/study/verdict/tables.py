"""Every row's figures on the held-out questions, as typed records: means per metric, per dataset and per subtask
(:class:`RowFigures`), each row paired against the host's row of its setting (:class:`Paired`), how the questions
were split (:class:`Split`), and the gold-passage ceiling (:class:`Ceiling`); each ``to_json()`` is what
``summary.json`` records."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from ..ceiling import reached
from ..dyprag import OWN, is_dyprag
from ..options import Policy
from ..stats import detectable, paired
from .catalogue import ALWAYS, CANDIDATES
from .records import METRICS, ScoredRows, SettingVerdict, mean

# the rows a PRAG user compares (the paper's table), in this order: the candidates of "what to run" first; the rows
# every study scores are required (TABLE_ROWS), the others shown where scored (PAPER_ROWS)
PAPER_ROWS = (*CANDIDATES, "random_controller", "random_controller_combine")
TABLE_ROWS = (*ALWAYS, "random_controller", "random_controller_combine")


@dataclass(frozen=True)
class Cell:
    """One row's F1 and EM means (fractions of 1) over the ``n`` held-out questions of a dataset's subtask."""

    f1: float | None
    em: float | None
    n: int


@dataclass(frozen=True)
class DatasetCell:
    """One row over a dataset's ``n`` held-out questions: its means, the macro F1 over its subtasks (None when a
    subtask has no F1) and the F1 mean's 95% interval (for the plot)."""

    f1: float | None
    em: float | None
    logprob: float | None
    n: int
    f1_macro: float | None
    ci95_f1: list[float] | None


@dataclass(frozen=True)
class RowFigures:
    """One row on the held-out questions: its mean per metric (:data:`METRICS`), per dataset and per
    ``"<dataset>/<subtask>"``."""

    means: Mapping[str, float | None]
    by_dataset: Mapping[str, DatasetCell]
    by_subtask: Mapping[str, Cell]

    def to_json(self) -> dict[str, Any]:
        return {**self.means, "by_dataset": {d: asdict(c) for d, c in self.by_dataset.items()},
                "by_subtask": {k: asdict(c) for k, c in self.by_subtask.items()}}


@dataclass(frozen=True)
class Paired:
    """One row against its setting's host row (``against``), paired over the held-out questions: per metric the
    mean difference and its 95% interval (None without values), and for F1 what it could detect at 95%."""

    against: str
    delta: Mapping[str, float | None]
    ci95: Mapping[str, list[float] | None]
    mde_f1: float | None = None
    n_needed: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"against": self.against}
        for m in self.delta:
            out[f"delta_{m}"], out[f"ci95_{m}"] = self.delta[m], self.ci95[m]
        return {**out, "mde_f1": self.mde_f1, "n_needed": self.n_needed}


@dataclass(frozen=True)
class Split:
    """How the questions were split (``method``, checked against each rule) and each ``dataset/subtask``'s
    ``{"train", "test", "n"}`` counts."""

    method: str
    strata: Mapping[str, Mapping[str, int]]

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "strata": {k: dict(c) for k, c in self.strata.items()}}


@dataclass(frozen=True)
class Ceiling:
    """The gold-passage ceiling per setting (:func:`..ceiling.reached`'s figures), or why its row is absent."""

    why_absent: str | None
    settings: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"why_absent": self.why_absent, "settings": dict(self.settings)}


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


def metric_means(rows: ScoredRows, qids: Sequence[str], name: str) -> dict[str, float | None]:
    scores = [rows.score(q, name) for q in qids]
    return {m: mean([s.get(m) for s in scores if s.get(m) is not None]) for m in METRICS}


def figures(rows: ScoredRows, keys: Sequence[str], name: str) -> RowFigures:
    """One row's figures over ``keys``: its means, and per dataset (with the macro F1 over its subtasks and the F1
    mean's 95% CI, for the plot) and per ``"<dataset>/<subtask>"`` its F1 / EM means and n."""
    qs = rows.questions
    by_subtask: dict[str, Cell] = {}
    by_dataset: dict[str, DatasetCell] = {}
    for d in dict.fromkeys(qs[q].dataset for q in keys):
        dq = [q for q in keys if qs[q].dataset == d]
        subs = {}
        for s in sorted(dict.fromkeys(qs[q].subtask for q in dq)):
            sq = [q for q in dq if qs[q].subtask == s]
            m = metric_means(rows, sq, name)
            subs[s] = by_subtask[f"{d}/{s}"] = Cell(m["f1"], m["em"], len(sq))
        m = metric_means(rows, dq, name)
        f1s = [rows.score(q, name).get("f1") for q in dq]
        ci = paired([float(x) for x in f1s], f"f1:{d}")[1] if all(x is not None for x in f1s) else None
        macro = [v.f1 for v in subs.values() if v.f1 is not None]
        by_dataset[d] = DatasetCell(m["f1"], m["em"], m["logprob"], len(dq),
                                    mean(macro) if len(macro) == len(subs) else None, ci)
    return RowFigures(metric_means(rows, keys, name), by_dataset, by_subtask)


def host_of(name: str) -> str:
    """The host's own row in the setting of row ``name``: what its deltas are paired against. PRAG's sum for every
    row but DyPRAG's fusion and ceiling rows, which are paired against DyPRAG's own row (``dyprag`` and
    ``dyprag_combine`` themselves: against PRAG's sum, the per-passage adapters they stand in for)."""
    combine = name.endswith("_combine") or name == "standard_rag"
    if is_dyprag(name) and name not in OWN:
        return "dyprag_combine" if combine else "dyprag"
    return "prag_sum_combine" if combine else "prag_sum"


def paired_table(rows: ScoredRows, keys: Sequence[str], names: Sequence[str], policy: Policy) -> dict[str, Paired]:
    """Each row against the host's row of its setting, every metric, paired over ``keys``; for F1 also ``mde_f1``
    and ``n_needed`` (for ``policy.target_f1``) at 95% (:func:`.stats.detectable`)."""
    pairs: dict[str, Paired] = {}
    for n in names:
        against = host_of(n)
        if n == against:
            continue
        delta: dict[str, float | None] = {}
        ci95: dict[str, list[float] | None] = {}
        det: dict[str, Any] = {}
        for m in METRICS:
            both = [q for q in keys if None not in (rows.score(q, n).get(m), rows.score(q, against).get(m))]
            diffs = rows.diffs(both, n, against, m)
            delta[m], ci95[m] = paired(diffs, m) if diffs else (None, None)  # one resampling per metric, every row
            if m == "f1" and diffs:
                det = detectable(diffs, 0.95, policy.target_f1, policy.power)
        pairs[n] = Paired(against, delta, ci95, det.get("mde"), det.get("n_needed"))
    return pairs


def datasets_of(rows: ScoredRows, keys: Sequence[str]) -> dict[str, Any]:
    """Each dataset's held-out count and subtasks over ``keys``, in first-seen order."""
    qs = rows.questions
    return {d: {"n_test": sum(qs[q].dataset == d for q in keys),
                "subtasks": sorted({qs[q].subtask for q in keys if qs[q].dataset == d})}
            for d in dict.fromkeys(qs[q].dataset for q in keys)}


def split_info(rows: ScoredRows, settings: Mapping[str, Any]) -> Split:
    """How the questions were split (checked against each rule) and each ``dataset/subtask``'s train / test count."""
    from ..data import split_method

    strata: dict[str, dict[str, int]] = {}
    for r in rows.questions.values():
        c = strata.setdefault(f"{r.dataset}/{r.subtask}", {"train": 0, "test": 0, "n": 0})
        c[r.split] += 1
        c["n"] += 1
    ids = [{"id": r.id, "dataset": r.dataset, "subtask": r.subtask} for r in rows.questions.values()]
    return Split(split_method(ids, set(rows.test), settings), strata)


def ceiling_info(rows: ScoredRows, keys: Sequence[str], pairs: Mapping[str, Paired],
                 verdicts: Mapping[str, SettingVerdict]) -> Ceiling:
    """The gold-passage ceiling per setting (:func:`.ceiling.reached`), or why its row is absent."""
    table = {n: p.to_json() for n, p in pairs.items()}
    per = {s: reached(table, s, v.held.reweighting.measured) for s, v in verdicts.items()}
    if all(per.values()):
        return Ceiling(None, per)
    titles = [rows.questions[q].supporting_titles for q in keys]
    if all(t is None for t in titles):
        why = ("the study's rows predate the gold_passages row, and its questions.jsonl the `supporting_titles` "
               "field that row reads (a fresh study records both)")
    elif not all(titles):
        why = (f"{sum(not t for t in titles)} of {len(titles)} held-out questions carry no supporting titles (the "
               "data gives none), and the row needs every one")
    else:
        why = "the gold_passages rows were not scored in this study folder (a fresh study scores them)"
    return Ceiling(why, {})
