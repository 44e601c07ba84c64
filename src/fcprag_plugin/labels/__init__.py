"""Leave-one-out label builder: ``fcprag labels build``, ``fcprag labels from-prag``, ``fcprag labels merge``.

For each training question with N passage adapters, the builder evaluates the model with all N adapters merged
uniformly (PRAG's sum) and with each adapter left out (N merged evaluations + 1), and writes label records in the
trainer's format (``metric_all``, ``metric_without``). Modules:

- :mod:`.manifest`: reading/validating the manifest, ``from_prag`` conversion of PRAG's layout.
- :mod:`.prompts`: the prompt template (modes ``param`` and ``combine``) and tokenisation.
- :mod:`.metrics`: answer log-probability under teacher forcing, greedy generation, SQuAD-style F1/EM.
- :mod:`.store`: JSON Lines output (atomic appends, resume scan).
- :mod:`.shard`: rank/world from torchrun / accelerate, part files, ``merge``.
- :mod:`.builder`: per-record orchestration and the run loop.
"""

from __future__ import annotations

from .errors import LabelBuildError
from .manifest import ManifestRecord, from_prag, read_manifest
from .metrics import exact_match, extract_answer, f1_score, normalize_answer
from .prompts import PromptTemplate

__all__ = [
    "LabelBuildError",
    "ManifestRecord",
    "PromptTemplate",
    "exact_match",
    "extract_answer",
    "f1_score",
    "from_prag",
    "normalize_answer",
    "read_manifest",
]
