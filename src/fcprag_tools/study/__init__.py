"""``fcprag study``: from a question file and a model to a measured verdict (retrieval, augmentation, passage
adapters, labels, controller training, held-out evaluation by real forwards, summary and report); see
:mod:`.pipeline` for the stages and :mod:`.summary` for the output."""

from __future__ import annotations

from .options import StudyOptions
from .pipeline import run_study
from .summary import check_summary

__all__ = ["StudyOptions", "check_summary", "run_study"]
