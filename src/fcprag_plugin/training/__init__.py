"""Train a :class:`~fcprag_plugin.controller.FusionController` from leave-one-out label files (``trainer`` runs
the loop; ``fcprag train`` / ``fcprag eval`` are in ``fcprag_tools.train_cli``)."""

from __future__ import annotations

from .labels import LabelRecord, LabelSet, load_labels, write_labels
from .evaluation import evaluate, format_table
from .targets import make_targets, weighted_kl
from .trainer import EvalResult, TrainArgs, Trainer, TrainResult, evaluate_controller, train_controller

__all__ = ["train_controller", "evaluate_controller", "EvalResult", "Trainer", "TrainArgs", "TrainResult",
           "LabelRecord", "LabelSet", "load_labels", "write_labels", "make_targets", "weighted_kl", "evaluate",
           "format_table"]
