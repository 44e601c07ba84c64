"""DyPRAG's rows as data for the fused slot: one composite adapter per row, and what sets the rows apart.

**The rule.** DyPRAG averages the passages' factors separately, ``A = mean_i A_i``, ``B = mean_i B_i``, and adds
``x @ (B @ A).T`` to each projection (no ``alpha / r``). With merge weights ``w~`` (one per passage) the composite
is ``A* = sum_i u_i A_i``, ``B* = sum_i u_i B_i`` with ``u = w~ / N`` (the ``separate`` merge mode on the generated
adapters, whose scaling is 1), scored as one adapter at weight 1 (:class:`fcprag_tools.study.scoring.Row`'s
``update``). ``w~ = [1] * N`` is DyPRAG's own ``mean(B) @ mean(A)``.

**What kappa means here.** A controller's weights sum to ``kappa * N``. On DyPRAG's separate averages both factors
carry ``u``, so ``w~ = [kappa] * N`` gives ``(kappa mean B)(kappa mean A) = kappa^2 * mean(B) @ mean(A)``: the
update grows with kappa squared, not kappa as on PRAG's sum (``cat``: ``sum_i w~_i s_i B_i A_i``). To scale
DyPRAG's update by ``c``, use ``w~ = [sqrt(c)] * N``.

**The gold-passage ceiling** uses the study's ceiling weights (:func:`fcprag_tools.study.ceiling.
gold_passage_weights`: ``w~ = N / k`` on the ``k`` supporting passages, 0 elsewhere), so ``u = 1 / k`` there: the
mean of the supporting passages' A and B; no supporting passage retrieved: every weight 1, DyPRAG's own row.

**How different the passages' updates are**: :func:`mean_pairwise_cosine` of the updates ``s_i B_i A_i`` (every
module flattened into one vector), from ``r x r`` products only.
"""

from __future__ import annotations

import math
import statistics
from itertools import combinations
from typing import Any, Iterable, Mapping, Sequence

from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.merge import merge_adapters
from .network import TranslatorError


def dyprag_adapter(generated: Sequence[LoraAdapter], merge_weights: Sequence[float] | None = None) -> LoraAdapter:
    """The composite update of one DyPRAG row: ``A* = sum_i u_i A_i``, ``B* = sum_i u_i B_i``, ``u = w~ / N``
    (``merge_weights`` ``w~``, default ``[1] * N``: DyPRAG's ``mean(B) @ mean(A)``), scaling 1, float32. The
    passages' updates must have scaling 1 (the translator's, :func:`.embed.generate_adapters`): PRAG's adapters
    carry ``alpha / r`` and have no DyPRAG rule."""
    if not generated:
        raise TranslatorError("a DyPRAG row needs at least one passage's generated update")
    for a in generated:
        bad = next((n for n, m in a.modules.items() if m.scaling != 1.0), None)
        if bad is not None:
            raise TranslatorError(f"{a.source}: module '{bad}' has scaling {a.modules[bad].scaling}; DyPRAG's rule "
                                  "averages the translator's factors, whose scaling is 1")
    w = [1.0] * len(generated) if merge_weights is None else [float(x) for x in merge_weights]
    out = merge_adapters(list(generated), w, mode="separate").adapter
    out.source = f"dyprag[N={len(generated)}, w~={[round(x, 4) for x in w]}]"
    return out


def update_inner(a: LoraAdapter, b: LoraAdapter) -> float:
    """``<s_a B_a A_a, s_b B_b A_b>`` summed over the modules, in float64 from ``r x r`` products:
    ``trace(A_a^T B_a^T B_b A_b) = sum((B_a^T B_b) * (A_a A_b^T))``; never the dense updates."""
    total = 0.0
    for name, ma in a.modules.items():
        mb = b.modules[name]
        g_b = ma.B.double().T @ mb.B.double()  # [r_a, r_b]
        g_a = ma.A.double() @ mb.A.double().T  # [r_a, r_b]
        total += ma.scaling * mb.scaling * float((g_b * g_a).sum())
    return total


def mean_pairwise_cosine(adapters: Sequence[LoraAdapter]) -> float | None:
    """The mean cosine over the passage pairs of their updates ``s_i B_i A_i`` (all modules as one vector): 1 when
    they point the same way, about 0 when unrelated. None with fewer than two passages or a zero update."""
    if len(adapters) < 2:
        return None
    names = set(adapters[0].modules)
    for a in adapters[1:]:
        if set(a.modules) != names:
            raise TranslatorError(f"{a.source} and {adapters[0].source} update different modules; the cosine of "
                                  "their updates needs the same modules")
    norms = [math.sqrt(max(update_inner(a, a), 0.0)) for a in adapters]
    if min(norms) == 0.0:
        return None
    cos = [update_inner(adapters[i], adapters[j]) / (norms[i] * norms[j])
           for i, j in combinations(range(len(adapters)), 2)]
    return sum(cos) / len(cos)


def prag_adapter_seconds(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per passage id the seconds of its PRAG adapter from the study's ``adapters.jsonl`` rows
    (``group_seconds / group``: its share of the stacked group it was trained in)."""
    return {str(r["id"]): float(r["group_seconds"]) / max(int(r.get("group", 1)), 1) for r in rows}


def cost_summary(train_seconds: float, generation: Mapping[str, float], prag: Mapping[str, float]
                 ) -> dict[str, Any]:
    """The translator's cost beside PRAG's: its training seconds, the median seconds per passage of the
    translator's generation (embedding + translator, :func:`.embed.generate_adapters`) and of a PRAG adapter, their
    ratio, and after how many passages the training has paid for itself (None when a PRAG adapter is not dearer)."""
    gen = statistics.median(generation.values()) if generation else None
    pr = statistics.median(prag.values()) if prag else None
    saved = pr - gen if gen is not None and pr is not None else None
    return {"train_seconds": round(float(train_seconds), 3), "passages_generated": len(generation),
            "generation_seconds_per_passage": gen, "prag_adapters": len(prag), "prag_seconds_per_passage": pr,
            "prag_over_generation": pr / gen if gen and pr is not None else None,
            "break_even_passages": math.ceil(train_seconds / saved) if saved and saved > 0 else None}

