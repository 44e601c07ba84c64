"""The fusion methods compared in the study, as merge weights ``w~ [n]`` for one question's passages.

- ``prag_sum``: PRAG's merge, every ``w~_i = 1`` (the sum of the passage updates);
- ``average``: ``w~_i = 1/n`` (the mean update);
- ``random``: an untrained, seeded FusionController (``mode="random"``);
- ``fixed``: the best fixed calibration (g, tau) with cosine scores, chosen on the train split (grid.py);
- ``learned:<run>``: a controller trained with ``fcprag train`` (train_stage.py);
- ``oracle:<metric>``: ``w~ = n * softmax(delta / 0.1)`` from this very question's leave-one-out deltas
  (an upper reference that peeks at the test answers; not a method one can deploy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fcprag_plugin import FusionController

T_LABEL = 0.1  # the trainer's default target temperature: the oracle uses the same targets the controllers learn
FIXED_G = (0.25, 0.5, 0.75, 1.0)
FIXED_TAU = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def controller_weights(ctrl: FusionController, e_q: torch.Tensor, E_p: torch.Tensor) -> dict[str, Any]:
    """``e_q [d]``, ``E_p [n, d]`` -> ``{"w_tilde": [n], "g": float, "tau": float}``."""
    with torch.no_grad():
        out = ctrl(e_q[None], E_p[None])
    return {"w_tilde": out.merge_weights[0].float(), "g": float(out.g[0]), "tau": float(out.tau[0])}


def random_baseline(dim: int, encoder_name: str) -> dict[str, FusionController]:
    """The untrained, seeded random controller (the uniform baseline is PRAG's own merge, no controller)."""
    return {"random": FusionController.random(embed_dim=dim, seed=0, embedding_model=encoder_name).eval()}


def fixed_controller(g: float, tau: float, dim: int, encoder_name: str) -> FusionController:
    return FusionController.fixed(g, tau, embed_dim=dim, scorer="cosine", embedding_model=encoder_name).eval()


def learned_controllers(root: Path) -> dict[str, FusionController]:
    out = {}
    for d in sorted(root.glob("*")) if root.is_dir() else []:
        if (d / "config.json").is_file():
            out[f"learned:{d.name}"] = FusionController.from_pretrained(d).eval()
    return out


def oracle_weights(deltas: torch.Tensor) -> torch.Tensor:
    n = deltas.shape[0]
    return n * torch.softmax(deltas.float() / T_LABEL, dim=0)
