"""Leave-one-out label builder (``fcprag labels build`` / ``from-prag`` / ``merge``): label records in the trainer's
format (``metric_all``, ``metric_without``); see ``docs/labels-builder.md``."""

from __future__ import annotations

from .errors import LabelBuildError
from .manifest import ManifestRecord, from_prag, read_manifest
from ..lm.metrics import exact_match, extract_answer, f1_score, normalize_answer
from ..lm.prompts import PromptTemplate

__all__ = ["LabelBuildError", "ManifestRecord", "PromptTemplate", "exact_match", "extract_answer", "f1_score",
           "from_prag", "normalize_answer", "read_manifest"]
