"""PNG plots of a training run / an evaluation (needs matplotlib: ``pip install 'fcprag-plugin[plot]'``).

    loss.png       train and validation loss per epoch
    g_tau.png      learned (g, tau) per sample
    entropy.png    histogram of the normalized weight entropy, learned vs the baselines
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import FcpragError
from .data import LabelTensors
from .metrics import entropy

logger = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise FcpragError("plots need matplotlib, which is not installed: pip install 'fcprag-plugin[plot]' "
                          "(or pip install matplotlib)") from e
    return plt


def plot_loss(history: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Train (and validation, when logged) loss per epoch."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ep = [h["epoch"] for h in history]
    ax.plot(ep, [h.get("train_loss") for h in history], "o-", label="train")
    if any(h.get("val_loss") is not None for h in history):
        ax.plot(ep, [h.get("val_loss") for h in history], "s-", label="validation")
    ax.set_xlabel("epoch")
    ax.set_ylabel("weighted KL(y || w)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def plot_g_tau(g: torch.Tensor, tau: torch.Tensor, path: str | Path, title: str = "learned controller") -> Path:
    """Scatter of the gate ``g [R]`` against the temperature ``tau [R]``, one point per sample."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.scatter(g.numpy(), tau.numpy(), s=8, alpha=0.5)
    ax.set_xlabel("gate g")
    ax.set_ylabel("temperature tau")
    ax.set_xlim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def plot_entropy(outputs: dict[str, dict[str, torch.Tensor]], data: LabelTensors, path: str | Path) -> Path:
    """Histogram of the per-sample normalized weight entropy ``H(w) / log N`` (1 = uniform; samples with N >= 2)
    for every controller in ``outputs``, on shared bins so the baselines are comparable."""
    plt = _pyplot()
    n = data.mask.sum(1)
    multi = n >= 2
    bins = torch.linspace(0, 1.0001, 31).numpy()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, o in outputs.items():
        h = entropy(o["w"], data.mask)[multi] / n[multi].to(torch.float64).log()
        ax.hist(h.numpy(), bins=bins, alpha=0.5, label=name)
    ax.set_xlabel("normalized weight entropy H(w) / log N")
    ax.set_ylabel("samples")
    ax.legend()
    return _save(fig, path, plt)


def _save(fig, path: str | Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_eval_plots(out_dir: str | Path, outputs: dict[str, dict[str, torch.Tensor]], data: LabelTensors
                     ) -> list[Path]:
    """``g_tau.png`` (of the first, i.e. evaluated, controller) and ``entropy.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    first = next(iter(outputs))
    paths = [plot_g_tau(outputs[first]["g"], outputs[first]["tau"], out_dir / "g_tau.png", f"{first} controller"),
             plot_entropy(outputs, data, out_dir / "entropy.png")]
    logger.info("wrote plots %s", [str(p) for p in paths])
    return paths


def write_training_plots(out_dir: str | Path, history: Sequence[dict[str, Any]],
                         outputs: dict[str, dict[str, torch.Tensor]], data: LabelTensors) -> list[Path]:
    """``loss.png`` plus the evaluation plots."""
    _pyplot()  # fail early and clearly when matplotlib is missing
    paths = [plot_loss(history, Path(out_dir) / "loss.png")] if history else []
    return paths + write_eval_plots(out_dir, outputs, data)
