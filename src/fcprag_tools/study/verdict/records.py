"""What the verdict reads and what it returns, as typed records (no I/O).

In: :class:`ScoredRows`, the questions of a study (split, dataset, subtask) and each question's scored rows
(:class:`Score`: gold log-lik., F1, EM, answer presence, the weights and prompt it was scored with), built from the
stage's ``{"qid|row": record}`` dicts or a folder's ``eval.jsonl`` by :meth:`ScoredRows.from_dicts`; and per
setting a :class:`ControllerRecord` (its kappa, the trainer's cross-validation and recorded arguments).

Out: per setting a :class:`SettingVerdict` (what ships, its three held-out :class:`Part` s, why its kappa:
:class:`KappaRule`), and what to run (:class:`Choice`, with its held-out :class:`Comparison` s); every row's
figures are :mod:`.tables`' records. Each ``to_json()`` is what ``summary.json`` records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

SETTINGS = ("param", "combine")  # PRAG's prompt (the question only) and the paper's Combine (passages in it too)
METRICS = ("logprob", "f1", "em", "acc")


def suffix(setting: str) -> str:
    """A row's or file's name suffix for ``setting``: none for ``param`` (PRAG's), ``_combine``."""
    return "" if setting == "param" else f"_{setting}"


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------- in
@dataclass(frozen=True)
class Question:
    """One question of the study: ``split`` is ``train`` or ``test`` (held out)."""

    id: str
    split: str
    dataset: str
    subtask: str
    supporting_titles: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Score:
    """One row of one question: gold log-lik. (nats), F1 / EM / answer presence (fractions of 1; None without a
    greedy answer), and the ``w~``, prompt setting and passage ids it was scored with (a DyPRAG row: also the
    sha256 of its ``translator``)."""

    logprob: float
    f1: float | None = None
    em: float | None = None
    acc: float | None = None
    w: tuple[float, ...] | None = None
    prompt: str | None = None
    pids: tuple[str, ...] | None = None
    translator: str | None = None

    def get(self, metric: str) -> float | None:
        v = getattr(self, metric)
        return None if v is None else float(v)

    @classmethod
    def from_dict(cls, r: Mapping[str, Any]) -> "Score":
        opt = lambda k: None if r.get(k) is None else float(r[k])  # noqa: E731
        tup = lambda k: None if r.get(k) is None else tuple(r[k])  # noqa: E731
        return cls(float(r["logprob"]), opt("f1"), opt("em"), opt("acc"), tup("w"), r.get("prompt"), tup("pids"),
                   r.get("translator"))


@dataclass(frozen=True)
class ScoredRows:
    """The questions (in their order) and every scored ``(question id, row)`` in first-scored order."""

    questions: Mapping[str, Question]
    scores: Mapping[tuple[str, str], Score]

    @classmethod
    def from_dicts(cls, qs: Mapping[str, Mapping[str, Any]], results: Mapping[str, Mapping[str, Any]]
                   ) -> "ScoredRows":
        """From the stage's ``{qid: question}`` and ``{"qid|row": record}`` (a row of a question not in ``qs`` is
        left out)."""
        questions = {q: Question(q, r["split"], r["dataset"], r["subtask"],
                                 None if r.get("supporting_titles") is None else tuple(r["supporting_titles"]))
                     for q, r in qs.items()}
        scores = {}
        for key, r in results.items():
            q, name = key.split("|", 1)
            if q in questions:
                scores[(q, name)] = Score.from_dict(r)
        return cls(questions, scores)

    def ids(self, split: str) -> list[str]:
        return [q for q, x in self.questions.items() if x.split == split]

    @property
    def test(self) -> list[str]:
        return self.ids("test")

    @property
    def train(self) -> list[str]:
        return self.ids("train")

    def has(self, q: str, row: str) -> bool:
        return (q, row) in self.scores

    def score(self, q: str, row: str) -> Score:
        return self.scores[(q, row)]

    def complete(self, qids: Sequence[str], names: Sequence[str]) -> list[str]:
        """The questions of ``qids`` that have every row of ``names``."""
        return [q for q in qids if all((q, n) in self.scores for n in names)]

    def diffs(self, qids: Sequence[str], a: str, b: str, metric: str) -> list[float]:
        """Per question of ``qids``, row ``a``'s ``metric`` minus row ``b``'s (both must be there)."""
        return [float(self.scores[(q, a)].get(metric)) - float(self.scores[(q, b)].get(metric)) for q in qids]

    def with_copies(self, copies: Mapping[str, str]) -> "ScoredRows":
        """These rows with ``{new row: source row}`` added on every question that has the source (the recommended
        rows: the rows of what ships)."""
        scores = dict(self.scores)
        for new, src in copies.items():
            for q in self.questions:
                if (q, src) in self.scores:
                    scores[(q, new)] = self.scores[(q, src)]
        return replace(self, scores=scores)


@dataclass(frozen=True)
class ScaleLabel:
    """One training question's measured scale labels (a label file's record): the gain of PRAG's sum times ``s``
    over the sum, in the label metric (``gains``) and in F1 (``f1_gains``, None without answers), per scale."""

    group: str
    gains: Mapping[float, float]
    f1_gains: Mapping[float, float] | None = None


@dataclass(frozen=True)
class ControllerRecord:
    """What the verdict reads of a setting's controller: ``kappa`` (its learned total scale), the trainer's
    cross-validation ``cv`` (``config.cv``: out-of-fold gains), the arguments it recorded (``args``; None for a
    given controller or when not kept) and the scale labels it chose kappa on (``labels``, the setting's
    ``labels{,_combine}.jsonl``; None when the folder does not keep them)."""

    kappa: float
    cv: Mapping[str, Any] = field(default_factory=dict)
    args: Mapping[str, Any] | None = None
    labels: tuple[ScaleLabel, ...] | None = None


# ----------------------------------------------------------------------------- out
@dataclass(frozen=True)
class Rule:
    """The trainer's risk rule: a scale is allowed when its share of questions losing more than ``loss_margin``
    (in ``metric``: ``label``, the gold log-lik., or ``f1``) is at most ``max_loss_share``, by the upper end of the
    share's two-sided 95% Wilson interval (``bound`` ``upper``) or the observed share (``observed``)."""

    max_loss_share: float
    loss_margin: float
    bound: str = "upper"
    metric: str = "label"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KappaFigures:
    """The rule at one ``kappa``: the mean gain over PRAG's sum, the questions losing more than the margin, their
    share, the upper end of its 95% Wilson interval, and whether the rule allows it."""

    kappa: float
    mean_gain: float | None
    losing: int
    share: float | None
    upper_bound: float
    allowed: bool


@dataclass(frozen=True)
class RuleFigures:
    """The rule's figures on ``questions`` questions, per kappa, and the kappa it chooses; ``left_out``: scale rows
    missing on some of those questions (``{row: questions lacking it}``), left out of the figures."""

    questions: int
    kappas: tuple[KappaFigures, ...]
    rule_kappa: float
    left_out: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"questions": self.questions, "kappas": [asdict(k) for k in self.kappas],
                "rule_kappa": self.rule_kappa, "left_out": dict(self.left_out)}


@dataclass(frozen=True)
class KappaRule:
    """Why a setting's kappa (``summary.json``'s ``kappa_rule``): what the trainer chose and how, its ``rule`` (and
    where it was read), the rule's figures on the training labels (``training``, or ``why_absent``) and the same
    rule read on the held-out scale rows (``held_out``, descriptive, or ``held_out_why``)."""

    trainer_kappa: float | None
    chosen_by: str | None
    rule: Rule | None = None
    rule_from: str | None = None
    training: RuleFigures | None = None
    why_absent: str | None = None
    held_out: RuleFigures | None = None
    held_out_why: str | None = None

    def to_json(self) -> dict[str, Any]:
        part = lambda x: None if x is None else x.to_json()  # noqa: E731
        return {"trainer_kappa": self.trainer_kappa, "chosen_by": self.chosen_by, "rule": part(self.rule),
                "rule_from": self.rule_from, "training": part(self.training), "why_absent": self.why_absent,
                "held_out": part(self.held_out), "held_out_why": self.held_out_why}


@dataclass(frozen=True)
class Part:
    """One held-out part of a setting's verdict: ``rows[0]`` against ``rows[1]`` in gold log-lik. (``delta`` and
    its 95% ``ci95``), ``equivalent`` when the interval lies inside ``±margin``; or not measured, and ``why``."""

    measured: bool
    delta: float | None = None
    ci95: list[float] | None = None
    rows: tuple[str, ...] = ()
    margin: float | None = None
    equivalent: bool | None = None
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        if not self.measured:
            return {"delta": None, "ci95": None, "measured": False, "rows": [], "why": self.why}
        return {"delta": self.delta, "ci95": self.ci95, "measured": True, "rows": list(self.rows),
                "margin": self.margin, "equivalent": self.equivalent}


@dataclass(frozen=True)
class Measured:
    """The held-out parts of a setting's verdict (``scale``, ``reweighting``, ``total``) over ``n`` questions."""

    scale: Part
    reweighting: Part
    total: Part
    n: int


@dataclass(frozen=True)
class SettingVerdict:
    """What ships in one setting (``ship``: ``network``, ``scale_only`` or ``prag_sum``), why, on what it was
    decided, the held-out parts that measure it (``held``), and the risk rule's figures behind its kappa
    (``kappa_rule``)."""

    setting: str
    ship: str
    kappa: float
    kappa_learned: float
    decided_on: str
    margins: dict[str, float]
    cv: dict[str, Any]
    held: Measured
    why: str
    recommended_row: str
    kappa_rule: KappaRule | None = None

    def to_json(self) -> dict[str, Any]:
        h = self.held
        return {"setting": self.setting, "ship": self.ship, "kappa": self.kappa, "kappa_learned": self.kappa_learned,
                "decided_on": self.decided_on, "margins": self.margins, "cv": self.cv,
                "scale": h.scale.to_json(), "reweighting": h.reweighting.to_json(), "total": h.total.to_json(),
                "why": self.why, "recommended_row": self.recommended_row, "n": h.n,
                "kappa_rule": self.kappa_rule and self.kappa_rule.to_json()}


@dataclass(frozen=True)
class Comparison:
    """The choice's held-out F1 against another ``row``: the paired mean, its interval at the choice's level, its
    ``reading`` (``tie``, ``better``, ``worse``, ``equivalent``, ``not_shown``) and what it could detect
    (``n_needed`` at the family's level; ``n_needed_95`` for one planned follow-up test at 95%). In JSON ``shown``
    is true when the interval excludes 0 on either side: shown better or shown worse, the direction being the
    ``reading``."""

    row: str
    reading: str
    delta_f1: float
    ci_f1: list[float]
    mde_f1: float | None = None
    n_needed: int | None = None
    n_nonzero: int | None = None
    sd_f1: float | None = None
    n_needed_95: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row, "delta_f1": self.delta_f1, "ci_f1": self.ci_f1,
                "shown": self.reading in ("better", "worse"), "reading": self.reading, "mde_f1": self.mde_f1, "n_needed": self.n_needed,
                "n_needed_95": self.n_needed_95, "n_nonzero": self.n_nonzero, "sd_f1": self.sd_f1}


@dataclass(frozen=True)
class Lead:
    """The choice against another candidate on the questions it was chosen on: that row's F1 there, the choice's
    paired lead over it and the lead's interval at ``level``; ``clear`` when the interval lies above 0."""

    row: str
    f1: float
    lead_f1: float
    ci_f1: list[float]
    level: float

    @property
    def clear(self) -> bool:
        return self.ci_f1[0] > 0

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row, "f1": self.f1, "lead_f1": self.lead_f1, "ci_f1": self.ci_f1, "level": self.level,
                "clear": self.clear}


@dataclass(frozen=True)
class HeldOutF1:
    """The choice measured on ``n`` held-out questions: its F1 and its comparisons (``vs_standard_rag``,
    ``vs_prag_sum``, ``vs_host``, ``vs_runner_up``: each row once, never the choice itself), each interval at
    ``level`` (Bonferroni over the ``n_comparisons`` made in every scope), sized for ``target_f1`` at ``power``."""

    n: int
    f1: float | None
    level: float
    n_comparisons: int
    target_f1: float
    power: float
    comparisons: dict[str, Comparison]


@dataclass(frozen=True)
class Choice:
    """What to run in one scope (overall or a dataset): the candidate with the highest F1 on the questions it is
    chosen on, its lead over the runner-up and over each cheaper candidate there, and how it did held out. A
    dataset's choice that differs from the overall one also has its lead over the overall row on the dataset's
    questions (``vs_overall``): only a clear lead makes it the row to ``follow`` there, else the overall row
    (chosen on more questions, so better powered)."""

    row: str
    tied: list[str]
    chosen_on: str
    n_choice: int
    choice_f1: dict[str, float | None]
    runner_up: Lead | None
    cheaper: list[Lead]
    held: HeldOutF1
    vs_overall: Lead | None = None

    @property
    def follow(self) -> str:
        """The row to run in this scope: the overall row unless this choice leads it clearly here."""
        v = self.vs_overall
        return self.row if v is None or v.clear else v.row

    def to_json(self) -> dict[str, Any]:
        h = self.held
        return {"row": self.row, "tied": self.tied, "chosen_on": self.chosen_on, "n_choice": self.n_choice,
                "choice_f1": self.choice_f1, "runner_up": self.runner_up and self.runner_up.to_json(),
                "cheaper": [c.to_json() for c in self.cheaper], "follow": self.follow,
                "vs_overall": self.vs_overall and self.vs_overall.to_json(), "n": h.n, "level": h.level,
                "n_comparisons": h.n_comparisons, "target_f1": h.target_f1, "power": h.power, "f1": h.f1,
                **{k: c.to_json() for k, c in h.comparisons.items()}}
