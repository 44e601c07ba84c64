"""``evaluate_controller``: a saved controller's metrics on any label file (what ``fcprag eval`` prints)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fcprag_plugin.controller import FusionController
from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import finite_or_none, read_json_if_present
from fcprag_plugin.training import (ARGS_NAME, DEFAULT_FLAT_EPS, DEFAULT_FLAT_WEIGHT, DEFAULT_T_LABEL, LabelSet,
                                    LabelTensors, as_label_set, build_tensors, evaluate, open_cache, resolve_encoder)

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """``metrics[name]`` per controller (the evaluated one first, then ``uniform``, ``random``), their raw
    ``outputs[name]`` (``w, g, tau``), the tensors and the label set."""

    metrics: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, torch.Tensor]]
    data: LabelTensors
    label_set: LabelSet
    trained_on: str | None = None  # "trained" / "validated": the controller saw this very file (warned)


def evaluate_controller(controller: FusionController | str | Path, labels: Any, *, encoder: Any = None,
                        cache_dir: str | Path | None = None, on_error: str = "fail", t_label: float | None = None,
                        flat_eps: float | None = None, flat_weight: float | None = None, seed: int = 0,
                        batch_size: int = 512, progress: bool = False) -> EvalResult:
    """Metrics of a saved controller on any label file, next to the uniform and random baselines.

    Target settings (``t_label``, ``flat_eps``, ``flat_weight``) default to the controller's
    ``training_args.json`` when it sits next to it, else to the library defaults.
    """
    saved_args: dict[str, Any] = {}
    if not isinstance(controller, FusionController):
        cdir = Path(controller)
        controller = FusionController.from_pretrained(cdir)
        saved_args = read_json_if_present(cdir / ARGS_NAME, FcpragError) or {}
    targets = {k: v if v is not None else saved_args.get(k, d) for k, v, d in (
        ("t_label", t_label, DEFAULT_T_LABEL), ("flat_eps", flat_eps, DEFAULT_FLAT_EPS),
        ("flat_weight", flat_weight, DEFAULT_FLAT_WEIGHT))}
    label_set = as_label_set(labels, on_error, "labels")
    seen = trained_on(saved_args, label_set.sha256)
    if seen:
        logger.warning("fcprag eval: %s is the label file this controller was %s on (same sha256 as in its %s); "
                       "these numbers are not a held-out evaluation", label_set.path, seen, ARGS_NAME)
    name, enc = resolve_encoder(controller.config.embedding_model if encoder is None else encoder)
    if getattr(enc, "dim", None) is not None:
        controller.check_encoder(enc)
    cache = open_cache(cache_dir, name, getattr(enc, "dim", None))
    data = build_tensors(label_set.records, enc, cache, **targets, progress=progress,
                         side_features=controller.config.side_features)
    if data.dim != controller.config.embed_dim:
        raise FcpragError(f"encoder '{name}' gives {data.dim}-d embeddings but the controller expects "
                          f"{controller.config.embed_dim}-d (trained with '{controller.config.embedding_model}')")
    metrics, outputs = evaluate(controller, data, seed=seed, batch_size=batch_size)
    return EvalResult(finite_or_none(metrics), outputs, data, label_set, seen)


def trained_on(saved_args: dict[str, Any], sha256: str) -> str | None:
    """``"trained"`` / ``"validated"`` when ``sha256`` is the training / validation label file recorded in a
    controller's ``training_args.json``, else None."""
    if sha256 and sha256 == saved_args.get("train_labels_sha256"):
        return "trained"
    if sha256 and sha256 == saved_args.get("val_labels_sha256"):
        return "validated"
    return None
