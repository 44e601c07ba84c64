"""The study's scoring job: one question asked one way, with the weightings of its adapters to score.

A *job* is a question's prompt (``param``: question only; ``combine``: passages too), its gold answer(s), its
distinct adapters ``pids [K]`` and named weight rows ``{name: [K]}`` (``w~`` per adapter, PRAG's ``cat`` sum).
:func:`scoring.score_jobs` turns every row into one row of the library's batched scorer
(``fcprag_tools.label_builder.batched.score_rows``, the code path of ``fcprag labels build``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fcprag_tools.label_builder.prompts import answer_ids, render_prompt
from fusion_eval import TEMPLATE


@dataclass
class Job:
    key: str
    question: str
    answers: list[str]
    passages: list[str]
    mode: str
    pids: list[str]
    rows: dict[str, list[float]]
    generate: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    gold: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        return cls(d["key"], d["question"], list(d["answers"]), list(d.get("passages") or []), d["mode"],
                   list(d["pids"]), {k: list(v) for k, v in d["rows"].items()}, bool(d.get("generate", False)))

    def encode(self, tok: Any) -> "Job":
        prompt = render_prompt(tok, TEMPLATE, self.question, self.passages if self.mode == "combine" else None,
                               self.mode)
        self.prompt_ids = list(prompt.ids)
        self.gold = [answer_ids(tok, prompt, a) for a in self.answers]
        return self

    def cost(self) -> int:
        """Tokens this job puts through the model (rows x aliases x length)."""
        return len(self.rows) * sum(len(self.prompt_ids) + len(g) for g in self.gold)
