"""Train a ``FusionController`` from leave-one-out label files (``trainer``); what the tooling uses is exported here."""

from __future__ import annotations

from ..controller_config import SHIPS  # noqa: F401
from .args import CHOICES, MAX_EPOCHS, MAX_HIDDEN, RECIPES, REMOVED, TrainArgs  # noqa: F401
from .data import LabelTensors, build_tensors  # noqa: F401
from .evaluation import collect_outputs, entropy, evaluate, metrics_from_outputs  # noqa: F401
from .embed_cache import open_cache, resolve_encoder  # noqa: F401
from ..labels import (KNOWN_SPLITS, ON_ERROR, OPTIONAL, LabelRecord, LabelSet, SkippedRecord, as_label_set,  # noqa: F401
                      load_labels)
from .stats import BOOTSTRAP, Z95, bootstrap_ci  # noqa: F401
from .targets import DEFAULT_FLAT_EPS, DEFAULT_FLAT_WEIGHT, DEFAULT_T_LABEL, make_targets, weighted_kl  # noqa: F401
from .trainer import ARGS_NAME, Trainer, TrainResult, train_controller  # noqa: F401
