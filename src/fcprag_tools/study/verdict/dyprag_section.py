"""DyPRAG's section of the verdict (``summary.json``'s ``dyprag``): what a study with DyPRAG's rows says of the second
host, as typed records from pure functions on the scored rows and the folder's DyPRAG record
(:func:`fcprag_tools.study.dyprag.dyprag_record`, read by :func:`..summary.finish`).

- **The plan's three comparisons** (``benchmarks/efficacy/dyprag/PLAN.md``), held out, F1, paired per question,
  percentile bootstrap (10,000 resamples): ``dyprag`` against ``prag_sum`` (does the translator stand in for PRAG's
  per-passage adapters?), ``dyprag`` against ``vanilla`` (do DyPRAG's generated adapters help over no retrieval?),
  ``dyprag_combine`` against ``standard_rag`` (does DyPRAG-Combine beat the passages in the prompt?); each interval
  at ``1 - 0.05 / m``, Bonferroni over the ``m`` comparisons made (3 when all three are: 98.33%), each read and sized
  as the what-to-run comparisons are (:func:`.choice.compare`), the gold log-lik. difference beside it at that level.
- **How different the passages' updates are**: the mean pairwise cosine of a question's passages' updates, DyPRAG's
  generated ones against PRAG's adapters (mean, median, quartiles over the held-out questions), and whether DyPRAG's
  are nearly parallel (median at least :data:`PARALLEL`): then any weighting of them is close to a global scale.
- **The cost**: the translator's training seconds; per passage its generation against PRAG's adapter training and
  PRAG's augmentation (DyPRAG skips both); after how many passages the translator has paid for itself.
- **The fusion over DyPRAG's LoRAs** (``dyprag_recommended{,_combine}`` against ``dyprag{,_combine}``: ``u = w~/N``
  of what ships, kappa acting squared) and **the gold-passage ceiling over them** (``dyprag_gold_passages{,_combine}``
  against the same), read from the paired table (95%), per setting.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from ..dyprag import is_dyprag
from ..options import Policy
from ..stats import paired
from .choice import ALPHA, WHAT_TO_RUN_BOOT, compare
from .records import Comparison, ScoredRows, SettingVerdict, suffix

# (key, row, against, the question it answers), in the plan's order
PLAN = (("dyprag_vs_prag_sum", "dyprag", "prag_sum",
         "does the translator stand in for PRAG's per-passage adapters?"),
        ("dyprag_vs_vanilla", "dyprag", "vanilla", "do DyPRAG's generated adapters help over no retrieval at all?"),
        ("dyprag_combine_vs_standard_rag", "dyprag_combine", "standard_rag",
         "does DyPRAG-Combine beat the passages in the prompt?"))
PARALLEL = 0.9  # a median cosine at least this: the passages' updates point nearly the same way
TRANSLATOR_KEYS = ("source", "file", "sha256", "export", "dyprag_flags", "options", "shape")
TRAINING_KEYS = ("seconds", "passages", "steps", "first_loss", "last_loss")


@dataclass(frozen=True)
class PlanComparison:
    """One of the plan's comparisons: ``row`` against ``f1.row`` in F1 (:class:`.records.Comparison`) and the gold
    log-lik. difference beside it at the same level."""

    key: str
    row: str
    question: str
    f1: Comparison
    delta_logprob: float
    ci_logprob: list[float]

    def to_json(self) -> dict[str, Any]:
        c = self.f1.to_json()
        return {"key": self.key, "row": self.row, "against": c.pop("row"), "question": self.question, **c,
                "delta_logprob": self.delta_logprob, "ci_logprob": self.ci_logprob}


@dataclass(frozen=True)
class Primary:
    """The plan's comparisons made on ``n`` held-out questions at ``level`` (Bonferroni over ``n_comparisons``), and
    why any other was not made (``{key: why}``)."""

    n: int
    level: float
    n_comparisons: int
    target_f1: float
    power: float
    comparisons: tuple[PlanComparison, ...]
    not_made: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "level": self.level, "n_comparisons": self.n_comparisons, "target_f1": self.target_f1,
                "power": self.power, "comparisons": [c.to_json() for c in self.comparisons],
                "not_made": dict(self.not_made)}


@dataclass(frozen=True)
class Cost:
    """The translator against PRAG per passage (seconds; medians over the held-out passages, the augmentation a
    mean): ``break_even`` passages against PRAG's adapter training alone, ``break_even_with_augmentation`` counting
    PRAG's augmentation too (None: the translator's training is not known here, or saves nothing per passage)."""

    source: str | None
    train_seconds: float | None
    generation_seconds: float | None
    passages_generated: int
    prag_seconds: float | None
    prag_adapters: int
    augment_seconds: float | None
    break_even: int | None
    break_even_with_augmentation: int | None


@dataclass(frozen=True)
class HostPart:
    """One setting's DyPRAG row against DyPRAG's own (the paired table's 95% figures): the fusion with what ships
    (``ship``, ``kappa``: on DyPRAG's averages the update grows by ``kappa ** 2``; ``same``: what ships is PRAG's
    sum, so the row is DyPRAG's own) or the gold-passage ceiling; ``share``: the fusion's share of the ceiling's
    gold log-lik. gain (None when the ceiling does not lie above DyPRAG's row or no fusion was measured)."""

    row: str
    against: str
    delta_logprob: float | None
    ci_logprob: list[float] | None
    delta_f1: float | None
    ci_f1: list[float] | None
    ship: str | None = None
    kappa: float | None = None
    same: bool | None = None
    share: float | None = None


@dataclass(frozen=True)
class DypragSection:
    """``summary.json``'s ``dyprag``: the translator as recorded (None, and ``why``, where the folder keeps no
    record), the plan's comparisons, how different the passages' updates are, the cost, and per setting the fusion
    and the ceiling over DyPRAG's LoRAs; ``other_translator``: of the DyPRAG rows the summary reads (``of``), how
    many record another translator than the one recorded (``rows``; a row is valid for its translator only)."""

    translator: Mapping[str, Any] | None
    why: str | None
    primary: Primary
    diversity: Mapping[str, Any] | None
    cost: Cost | None
    fusion: Mapping[str, HostPart]
    ceiling: Mapping[str, HostPart]
    other_translator: Mapping[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"translator": None if self.translator is None else dict(self.translator), "why": self.why,
                "other_translator": None if self.other_translator is None else dict(self.other_translator),
                "primary": self.primary.to_json(), "diversity": None if self.diversity is None else dict(
                    self.diversity), "cost": None if self.cost is None else asdict(self.cost),
                "fusion": {s: asdict(p) for s, p in self.fusion.items()},
                "ceiling": {s: asdict(p) for s, p in self.ceiling.items()}}


def primary(rows: ScoredRows, keys: Sequence[str], names: Sequence[str], policy: Policy) -> Primary:
    """The plan's comparisons on the held-out questions ``keys``: those whose two rows are in the table (``names``:
    measured on every one of them) with F1 on each; the level over those made."""
    made, not_made = [], {}
    for key, row, against, _ in PLAN:
        missing = [r for r in (row, against) if r not in names]
        if missing:
            not_made[key] = f"{', '.join(f'`{r}`' for r in missing)} not measured on every held-out question"
        elif any(rows.score(q, r).f1 is None for q in keys for r in (row, against)):
            not_made[key] = "no F1 (greedy answers): run without --no-generate"
        else:
            made.append(key)
    level = 1 - ALPHA / max(len(made), 1)
    out = []
    for key, row, against, question in PLAN:
        if key in made:
            f1 = compare(against, rows.diffs(keys, row, against, "f1"), f"dyprag:{key}", level, policy.target_f1,
                         policy.power)
            lp, ci = paired(rows.diffs(keys, row, against, "logprob"), f"dyprag:{key}:logprob", level,
                            WHAT_TO_RUN_BOOT)
            out.append(PlanComparison(key, row, question, f1, lp, ci))
    return Primary(len(keys), level, len(made), policy.target_f1, policy.power, tuple(out), not_made)


def diversity(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cosines' spread (``dyprag``, ``prag``: :func:`..dyprag.spread`), the questions they cover and whether
    DyPRAG's updates are nearly parallel (``parallel``: their median at least :data:`PARALLEL`; None without
    cosines)."""
    d = record.get("diversity")
    if not d:
        return None
    med = (d.get("dyprag") or {}).get("median")
    return {"dyprag": d.get("dyprag"), "prag": d.get("prag"), "questions": record.get("questions"),
            "parallel_at": PARALLEL, "parallel": None if med is None else med >= PARALLEL}


def break_even(train: float | None, saved: float | None) -> int | None:
    """The passages after which a translator trained in ``train`` seconds has paid for itself when each passage
    saves ``saved`` seconds (None when either is unknown or nothing is saved)."""
    if train is None or saved is None or saved <= 0:
        return None
    return math.ceil(train / saved)


def cost(record: Mapping[str, Any]) -> Cost | None:
    """:class:`Cost` from the folder's record; a given translator's training is not known here (None)."""
    c, t = record.get("cost"), record.get("translator") or {}
    if not c:
        return None
    train = c.get("train_seconds") if t.get("source") == "trained" else None
    gen, prag, aug = (c.get(k) for k in ("generation_seconds_per_passage", "prag_seconds_per_passage",
                                         "augment_seconds_per_passage"))
    saved = None if gen is None or prag is None else prag - gen
    return Cost(t.get("source"), train, gen, int(c.get("passages_generated") or 0), prag,
                int(c.get("prag_adapters") or 0), aug, break_even(train, saved),
                break_even(train, None if saved is None or aug is None else saved + aug))


def _against(pairs: Mapping[str, Any], row: str, **kw: Any) -> HostPart | None:
    p = pairs.get(row)
    if p is None:
        return None
    return HostPart(row, p.against, p.delta.get("logprob"), p.ci95.get("logprob"), p.delta.get("f1"),
                    p.ci95.get("f1"), **kw)


def host_parts(pairs: Mapping[str, Any], verdicts: Mapping[str, SettingVerdict]
               ) -> tuple[dict[str, HostPart], dict[str, HostPart]]:
    """Per setting, from the paired table (each DyPRAG fusion and ceiling row against DyPRAG's own row of its
    setting): the fusion with what ships, and the ceiling with the fusion's share of it."""
    fusion, ceiling = {}, {}
    for s, v in verdicts.items():
        sfx = suffix(s)
        f = _against(pairs, f"dyprag_recommended{sfx}", ship=v.ship, kappa=v.kappa,
                     same=v.recommended_row == f"prag_sum{sfx}")
        if f is not None:
            fusion[s] = f
        g = pairs.get(f"dyprag_gold_passages{sfx}")
        if g is not None:
            gain, got = g.delta.get("logprob"), None if f is None else f.delta_logprob
            ceiling[s] = _against(pairs, f"dyprag_gold_passages{sfx}",
                                  share=got / gain if got is not None and gain is not None and gain > 0 else None)
    return fusion, ceiling


def dyprag_section(rows: ScoredRows, keys: Sequence[str], names: Sequence[str], pairs: Mapping[str, Any],
                   verdicts: Mapping[str, SettingVerdict], record: Mapping[str, Any] | None, policy: Policy
                   ) -> DypragSection | None:
    """DyPRAG's section, or None when no DyPRAG row is in the table (a study without DyPRAG's rows reports as
    before). ``record``: the folder's DyPRAG record (None: the folder keeps no ``translator/translator.json``)."""
    if "dyprag" not in names:
        return None
    fusion, ceiling = host_parts(pairs, verdicts)
    plan = primary(rows, keys, names, policy)
    if record is None:
        return DypragSection(None, "this folder keeps no translator/translator.json (the translator's record, its "
                             "cost and the cosines are read from the study's files)", plan, None, None, fusion, ceiling)
    t = record.get("translator") or {}
    translator = {k: t.get(k) for k in TRANSLATOR_KEYS} | {
        "training": None if not t.get("training") else {k: t["training"].get(k) for k in TRAINING_KEYS}}
    read = set(keys) | set(rows.train)
    mine = [x for (q, n), x in rows.scores.items() if q in read and is_dyprag(n)]
    other = {"rows": sum(x.translator != t.get("sha256") for x in mine), "of": len(mine)}
    return DypragSection(translator, None, plan, diversity(record), cost(record), fusion, ceiling, other)
