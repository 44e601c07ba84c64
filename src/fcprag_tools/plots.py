"""PNG plots of a training run (``loss.png``) or an evaluation (``g_tau.png``, ``entropy.png``); needs matplotlib
(``pip install 'fcprag-plugin[plot]'``).
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.training import LabelTensors, collect_outputs, entropy, metrics_from_outputs

logger = logging.getLogger(__name__)

# The first efficacy study's grid for the fixed baseline (docs/results/efficacy.md), here scored by the training
# objective (weighted KL to the targets) instead of the gold-answer likelihood.
FIXED_G = (0.25, 0.5, 0.75, 1.0)
FIXED_TAU = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
COLORS = {"learned": "tab:blue", "uniform": "tab:orange", "random": "tab:green", "fixed": "tab:red"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise FcpragError("plots need matplotlib, which is not installed: pip install 'fcprag-plugin[plot]' "
                          "(or pip install matplotlib)") from e
    return plt


def outputs_kl(outputs: dict[str, torch.Tensor], data: LabelTensors) -> float | None:
    """The training objective (weighted KL(y || w)) of collected controller ``outputs`` on ``data``."""
    return metrics_from_outputs(outputs["w"], outputs["g"], outputs["tau"], data)["kl"]


def best_fixed(data: LabelTensors) -> dict[str, float] | None:
    """The fixed controller (cosine scores, one global g and tau from the grid FIXED_G x FIXED_TAU) with the lowest
    weighted KL on ``data``: ``{"g", "tau", "kl"}`` (None when ``data`` has no informative sample)."""
    from fcprag_plugin.controller import FusionController

    best = None
    for g, tau in itertools.product(FIXED_G, FIXED_TAU):
        kl = outputs_kl(collect_outputs(FusionController.fixed(g, tau, embed_dim=data.dim), data), data)
        if kl is not None and (best is None or kl < best["kl"]):
            best = {"g": g, "tau": tau, "kl": kl}
    return best


def plot_loss(history: Sequence[dict[str, Any]], path: str | Path, uniform_kl: float | None = None,
              reference_on: str = "validation") -> Path:
    """Train (and validation, when logged) loss per epoch; ``uniform_kl``: the uniform merge's loss on the
    ``reference_on`` set, drawn as a horizontal line (below it the controller beats PRAG's merge)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ep = [h["epoch"] for h in history]
    ax.plot(ep, [h.get("train_loss") for h in history], "o-", color="tab:blue", label="train")
    if any(h.get("val_loss") is not None for h in history):
        ax.plot(ep, [h.get("val_loss") for h in history], "s-", color="tab:purple", label="validation")
    if uniform_kl is not None:
        ax.axhline(uniform_kl, color=COLORS["uniform"], linestyle="--", linewidth=1.5,
                   label=f"uniform (PRAG's merge), {reference_on}: {uniform_kl:.4g}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("weighted KL(y || w)  (lower is better)")
    ax.set_title("training loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def plot_g_tau(g: torch.Tensor, tau: torch.Tensor, path: str | Path, title: str = "learned controller",
               learned_kl: float | None = None, uniform_kl: float | None = None,
               fixed: dict[str, float] | None = None) -> Path:
    """Scatter of the gate ``g [R]`` against the temperature ``tau [R]``, one point per sample, with the uniform
    merge (g = 0: tau has no effect) as a vertical line and the ``fixed`` baseline (``best_fixed``) as a star; the
    legend gives each one's weighted KL when known."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    kl = lambda v: f", KL {v:.4g}" if v is not None else ""  # noqa: E731
    ax.scatter(g.numpy(), tau.numpy(), s=10, alpha=0.5, color=COLORS["learned"],
               label=f"{title}, one point per sample{kl(learned_kl)}")
    ax.axvline(0.0, color=COLORS["uniform"], linestyle="--", linewidth=1.5,
               label=f"uniform (PRAG): g = 0, any tau{kl(uniform_kl)}")
    if fixed is not None:
        ax.scatter([fixed["g"]], [fixed["tau"]], marker="*", s=220, color=COLORS["fixed"], edgecolor="black",
                   zorder=3, label=f"best fixed cosine g={fixed['g']:g}, tau={fixed['tau']:g}{kl(fixed.get('kl'))}")
    taus = tau.numpy().tolist() + ([fixed["tau"]] if fixed is not None else [])
    if taus and min(taus) > 0 and max(taus) / min(taus) > 20:
        ax.set_yscale("log")  # the grid spans 0.05 .. 2: keep the learned cluster readable next to the star
    ax.set_xlim(-0.05, 1.05)
    ax.set_xlabel("gate g  (0: uniform merge, 1: fully controller-weighted)")
    ax.set_ylabel("temperature tau")
    ax.set_title(f"{title}: gate and temperature")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def plot_entropy(outputs: dict[str, dict[str, torch.Tensor]], data: LabelTensors, path: str | Path) -> Path:
    """How far each sample's weights are from uniform, ``1 - H(w) / log N`` (0 = uniform, 1 = all weight on one
    passage; samples with N >= 2), as one strip of jittered points per controller in ``outputs`` with its median,
    so close distributions stay apart (near-uniform controllers differ in the 4th decimal of the entropy)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    n = data.mask.sum(1)
    multi = n >= 2
    names = list(outputs)
    fig, ax = plt.subplots(figsize=(6.5, 1.4 + 0.8 * len(names)))
    gen = torch.Generator().manual_seed(0)  # the same jitter every time
    for row, name in enumerate(names):
        d = (1 - entropy(outputs[name]["w"], data.mask)[multi] / n[multi].to(torch.float64).log()).clamp_min(0)
        y = row + (torch.rand(len(d), generator=gen, dtype=torch.float64) - 0.5) * 0.5
        color = COLORS.get(name, COLORS["learned"] if row == 0 else None)
        ax.scatter(d.numpy(), y.numpy(), s=8, alpha=0.5, color=color)
        if len(d):
            med = float(d.median())
            ax.plot([med, med], [row - 0.33, row + 0.33], color="black", linewidth=2)
            ax.annotate(f" median {med:.3g}", (med, row - 0.33), fontsize=7, ha="left", va="bottom")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.invert_yaxis()
    fmt = ScalarFormatter(useMathText=True)
    fmt.set_powerlimits((-2, 3))  # small distances as "x 10^-4" on the axis, not long decimals per tick
    ax.xaxis.set_major_formatter(fmt)
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.set_xlim(left=min(0.0, ax.get_xlim()[0]))
    ax.set_xlabel("distance from uniform weights, 1 - H(w) / log N  (0 = uniform)")
    ax.set_title(f"how peaked the weights are, per sample ({int(multi.sum())} samples with N >= 2)")
    ax.grid(axis="x", alpha=0.3)
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
    uniform = outputs_kl(outputs["uniform"], data) if "uniform" in outputs else None
    paths = [plot_g_tau(outputs[first]["g"], outputs[first]["tau"], out_dir / "g_tau.png", f"{first} controller",
                        learned_kl=outputs_kl(outputs[first], data), uniform_kl=uniform, fixed=best_fixed(data)),
             plot_entropy(outputs, data, out_dir / "entropy.png")]
    logger.info("wrote plots %s", [str(p) for p in paths])
    return paths


def write_training_plots(out_dir: str | Path, history: Sequence[dict[str, Any]],
                         outputs: dict[str, dict[str, torch.Tensor]], data: LabelTensors) -> list[Path]:
    """``loss.png`` plus the evaluation plots. ``data`` is the validation set when the history logs a validation
    loss, else the training set (what the trainer evaluated)."""
    _pyplot()  # fail early and clearly when matplotlib is missing
    paths = []
    if history:
        on = "validation" if any(h.get("val_loss") is not None for h in history) else "training set"
        uniform = outputs_kl(outputs["uniform"], data) if "uniform" in outputs else None
        paths.append(plot_loss(history, Path(out_dir) / "loss.png", uniform, on))
    return paths + write_eval_plots(out_dir, outputs, data)
