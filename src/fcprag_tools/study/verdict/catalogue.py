"""The rows a user chooses among ("what to run"), as data: each row's prompt setting, its place in the cost order,
the host whose script runs it and with which method, and for a fusion the host's row it is measured against and
the controller folder that ships it. Adding a host's rows is adding entries to :data:`ROWS` (and its command to
:data:`.commands.HOSTS`).

The cost order (:attr:`RowSpec.cost`, lower is cheaper): no retrieval; standard RAG (the passages in the prompt, no
adapter); DyPRAG's ``dyprag`` / ``dyprag_combine`` (no per-passage training: one translator's forward per passage);
PRAG's sum (an adapter trained per passage); its Combine (the same and the passages in the prompt, a longer prompt); a
fusion (a controller over the passages' updates): DyPRAG's over the translator's LoRAs first, then PRAG's over its
trained adapters (a passage's training costs more than a longer prompt, as between DyPRAG's rows and PRAG's).

DyPRAG's rows (``always=False``) are candidates where a study scored them (a translator: ``fcprag study`` without
``--no-dyprag``); they come after PRAG's in :data:`ROWS`, so the paper's table and the plot show PRAG's rows first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowSpec:
    """One candidate row: ``setting`` is its prompt (``param``: the question alone, ``combine``: the passages in it
    too); ``host`` / ``method``: the host script and method that run it (None: no host command runs it);
    ``host_row``: for a fusion, the host's own row of its setting (what it replaces); ``controller``: the study
    folder's controller that a fusion row ships; ``always``: every study scores it (a host's rows that only some
    studies score: False, and they are candidates where they are scored)."""

    name: str
    setting: str
    cost: int
    words: str
    host: str | None = None
    method: str | None = None
    host_row: str | None = None
    controller: str | None = None
    always: bool = True


ROWS = {r.name: r for r in (
    RowSpec("vanilla", "param", 0, "no retrieval, the question alone"),
    RowSpec("standard_rag", "combine", 10, "standard RAG, the passages in the prompt and no adapter", "prag", "icl"),
    RowSpec("prag_sum", "param", 30, "PRAG's sum, its parametric setting", "prag", "prag"),
    RowSpec("prag_sum_combine", "combine", 40, "PRAG's Combine, its sum with the passages in the prompt", "prag",
            "combine"),
    RowSpec("recommended", "param", 50, "the fusion this study ships, in PRAG's prompt", "prag", "prag", "prag_sum",
            "controller"),
    RowSpec("recommended_combine", "combine", 55, "the fusion this study ships, in the Combine prompt", "prag",
            "combine", "prag_sum_combine", "controller_combine"),
    RowSpec("dyprag", "param", 20, "DyPRAG, the translator's LoRAs of the passages averaged", "dyprag", "dyprag",
            always=False),
    RowSpec("dyprag_combine", "combine", 25, "DyPRAG-Combine, DyPRAG with the passages in the prompt", "dyprag",
            "dyprag_combine", always=False),
    RowSpec("dyprag_recommended", "param", 45, "the fusion this study ships over DyPRAG's LoRAs, in its prompt",
            "dyprag", "dyprag", "dyprag", "controller", always=False),
    RowSpec("dyprag_recommended_combine", "combine", 48, "the fusion this study ships over DyPRAG's LoRAs, in the "
            "Combine prompt", "dyprag", "dyprag_combine", "dyprag_combine", "controller_combine", always=False),
)}
CANDIDATES = tuple(ROWS)
ALWAYS = tuple(r.name for r in ROWS.values() if r.always)
STATUS_QUO = "prag_sum"  # a tie among the best goes to it when it is tied (nothing changes for a PRAG user)


def cheaper(a: str, b: str) -> bool:
    """Row ``a`` costs less than row ``b``."""
    return ROWS[a].cost < ROWS[b].cost
