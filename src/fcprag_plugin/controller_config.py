"""A ``FusionController``'s config and files: :class:`ControllerConfig` (``config.json``: every key a field, an unknown
one an error), the weights file, and the words for what a trained controller ships (:data:`SHIPS`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .errors import ControllerError
from .features import SIDE_FEATURES, side_feature_columns
from .fileio import read_json_object, read_tensor_file, write_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CONTROLLER_MODES = ("learned", "uniform", "random", "fixed")
SCORERS = ("mlp", "cosine")
INITS = ("uniform", "random")
FORMAT_VERSION = 1
HOST_OPTIONAL_SIDE = ("retrieval_rank", "retrieval_score")  # side inputs hosts lack (adapter statistics: computable)
# what a trained controller ships (fcprag train's and fcprag study's word): PRAG's sum, x kappa, the network
SHIPS = ("prag_sum", "scale_only", "network")


@dataclass
class ControllerConfig:
    """Everything needed to rebuild a controller; saved as ``config.json``. ``cv``: the trainer's selection-unbiased
    evidence against PRAG's sum (``training/selection.py``), or None. ``side_optional``: side features a host may
    lack, then taken as equal per passage (None: retrieval rank and score). ``trained_for``: see ``check_adapters``."""

    embed_dim: int = 768
    embedding_model: str | None = None
    score_hidden: list[int] = field(default_factory=lambda: [2048, 1024])
    calib_hidden: int = 256
    dropout: float = 0.1
    tau_min: float = 0.05
    tau_max: float = 2.0
    controller_mode: str = "learned"  # one of CONTROLLER_MODES (the controller module says what each does)
    scorer: str = "mlp"  # mlp | cosine (parameter-free (1+cos)/2, for fixed baselines)
    fixed_g: float = 0.5
    fixed_tau: float = 0.1
    seed: int | None = None
    format_version: int = FORMAT_VERSION
    init: str = "random"
    side_features: list[str] = field(default_factory=list)
    side_scale: list[float] | None = None  # one per side_feature_columns(side_features); None: 1
    side_optional: list[str] | None = None
    kappa: float = 1.0
    calib_scale: bool = False  # the calibration net's third output: a per-query scale c
    cv: dict[str, Any] | None = None
    trained_for: dict[str, Any] | None = None  # {"base_model": [...], "adapter_recipes": [features.adapter_recipe]}

    def validate(self, where: str = "controller config") -> "ControllerConfig":
        def need(ok: Any, what: str) -> None:
            if not ok:
                raise ControllerError(f"{where}: {what}")

        def positive(v: Any) -> bool:  # a finite number > 0; JSON's true is no number
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        for key, allowed in (("controller_mode", CONTROLLER_MODES), ("scorer", SCORERS), ("init", INITS)):
            value = getattr(self, key)
            need(value in allowed, f"key '{key}' is '{value}', expected one of {list(allowed)}")
        need(isinstance(self.embed_dim, int) and self.embed_dim > 0,
             f"key 'embed_dim' must be a positive integer, got {self.embed_dim!r}")
        need(0 < self.tau_min <= self.tau_max, "keys 'tau_min'/'tau_max' must satisfy 0 < tau_min <= tau_max, got "
             f"{self.tau_min}, {self.tau_max}")
        need(0.0 <= self.fixed_g <= 1.0 and not self.fixed_tau <= 0, "keys 'fixed_g' in [0, 1] and 'fixed_tau' > 0 "
             f"expected, got {self.fixed_g}, {self.fixed_tau}")
        need(all(n in SIDE_FEATURES for n in self.side_features) and len(set(self.side_features)) == len(
            self.side_features), f"key 'side_features' is {self.side_features}, expected distinct names among "
             f"{list(SIDE_FEATURES)}")
        k = len(self.side_columns)
        need(self.side_scale is None or len(self.side_scale) == k and all(map(positive, self.side_scale)),
             f"key 'side_scale' is {self.side_scale}, expected {k} positive numbers (one per side-feature column)")
        need(positive(self.kappa), f"key 'kappa' is {self.kappa!r}, expected a positive number")
        return self

    @property
    def side_columns(self) -> list[str]:
        return side_feature_columns(self.side_features)

    @property
    def optional_side(self) -> tuple[str, ...]:
        """The side features this controller falls back on when a call lacks them."""
        return tuple(HOST_OPTIONAL_SIDE if self.side_optional is None else self.side_optional)


def read_config(path: Path) -> ControllerConfig:
    """The validated config in controller directory ``path``; an unknown key or a newer format is an error."""
    cfg_path = path / CONFIG_NAME
    if not path.is_dir():
        raise ControllerError(f"{path}: controller directory not found (expected {CONFIG_NAME} + {WEIGHTS_NAME})")
    raw = read_json_object(cfg_path, ControllerError, "controller config not found")
    raw.pop("library", None)  # written by write_files to say which library made the file, not a field
    cv = raw.get("cv")  # a per-query scale controller (mode "scale", its grid; shipped "query_scale"): removed
    if raw.get("controller_mode") == "scale" or raw.pop("scale_grid", None) is not None or \
            isinstance(cv, dict) and cv.get("shipped") == "query_scale":
        raise ControllerError(f"{cfg_path}: a per-query scale controller (controller_mode 'scale'), which this "
                              "version no longer reads: it never beat one global scale on held-out questions and "
                              "was removed (docs/results/per-query-scale.md); train a new one with fcprag train")
    known = {f.name for f in fields(ControllerConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ControllerError(f"{cfg_path}: unknown key(s) {unknown}; expected keys among {sorted(known)}")
    if raw.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise ControllerError(f"{cfg_path}: key 'format_version' is {raw['format_version']}, newer than this "
                              f"library supports ({FORMAT_VERSION}); upgrade fcprag-plugin")
    return ControllerConfig(**raw).validate(str(cfg_path))  # every key is a field (checked above)


def read_weights(path: Path, own: dict[str, torch.Tensor], map_location: Any, embed_dim: int) -> dict[str, Any]:
    """The weights in directory ``path``, checked against ``own``, the state dict its config builds (keys, shapes)."""
    w_path = path / WEIGHTS_NAME
    state = read_tensor_file(w_path, map_location, ControllerError, "controller weights not found")
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ControllerError(f"{w_path}: weights do not match the config: missing {missing[:4]}, "
                              f"unexpected {extra[:4]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ControllerError(f"{w_path}: key '{k}' has shape {list(v.shape)}, the config implies "
                                  f"{list(own[k].shape)} (embed_dim {embed_dim})")
        if not bool(torch.isfinite(v).all()):
            raise ControllerError(f"{w_path}: key '{k}' has non-finite values")
    return state


def write_files(path: Path, config: ControllerConfig, state: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float32 whatever the in-memory dtype; never a pickle)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    write_json(path / CONFIG_NAME, {**asdict(config), "library": "fcprag_plugin"})
    save_file({k: v.detach().float().contiguous().cpu() for k, v in state.items()}, str(path / WEIGHTS_NAME),
              metadata={"format": "pt", "library": "fcprag_plugin"})
    return path
