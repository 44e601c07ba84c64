"""Train a :class:`~fcprag_plugin.controller.FusionController` from leave-one-out label files (``trainer``)."""

from __future__ import annotations

from .labels import LabelRecord, LabelSet, load_labels
from .evaluation import evaluate
from .targets import make_targets, weighted_kl
from .trainer import TrainArgs, Trainer, TrainResult, train_controller

__all__ = ["train_controller", "Trainer", "TrainArgs", "TrainResult", "LabelRecord", "LabelSet", "load_labels",
           "make_targets", "weighted_kl", "evaluate"]
