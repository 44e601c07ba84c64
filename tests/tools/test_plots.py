"""The training / evaluation plots draw the numbers they claim: the uniform merge's loss on loss.png, uniform and
the best fixed (g, tau) on g_tau.png, one separate strip per controller on entropy.png. The figures are read
back from matplotlib before they are saved and compared with independent computations."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("matplotlib")

from fcprag_plugin.training import train_controller
from fcprag_tools import plots  # noqa: E402
from fcprag_plugin.training.data import build_tensors  # noqa: E402
from fcprag_tools.synthetic import synthetic_records, table_encoder  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def figures(monkeypatch):
    """file name -> the saved figure's (only) axes, captured just before the figure is written and closed."""
    seen: dict[str, object] = {}
    save = plots._save

    def capture(fig, path, plt):
        seen[str(path).rsplit("/", 1)[-1]] = fig.axes[0]
        return save(fig, path, plt)

    monkeypatch.setattr(plots, "_save", capture)
    return seen


def reference_fixed_kl(data, g: float, tau: float) -> float:
    """Weighted KL(y || w) of the cosine fixed baseline, written out: s = (1 + cos) / 2, pi = softmax(s / tau)
    over the real passages, w = g pi + (1 - g) / N, sum_b omega_b KL_b / sum_b omega_b."""
    total = weight = 0.0
    for b in range(len(data)):
        m = data.mask[b]
        eq = data.table[data.q_idx[b]].double()
        ep = data.table[data.p_idx[b][m]].double()
        cos = (ep @ eq) / (ep.norm(dim=1) * eq.norm())
        pi = torch.softmax(((1 + cos) / 2) / tau, 0)
        w = g * pi + (1 - g) / len(pi)
        y = data.y[b][m].double()
        kl = sum(float(yi * (math.log(yi) - math.log(wi))) for yi, wi in zip(y, w) if yi > 0)
        total += float(data.omega[b]) * kl
        weight += float(data.omega[b])
    return total / weight


def test_best_fixed_is_the_grid_minimum_of_the_weighted_kl():
    recs, table = synthetic_records(40, (2, 4), 8, seed=3)
    data = build_tensors(recs, table_encoder(table, "t8"))
    best = plots.best_fixed(data)
    grid = {(g, t): reference_fixed_kl(data, g, t) for g in plots.FIXED_G for t in plots.FIXED_TAU}
    g, t = min(grid, key=grid.get)
    assert (best["g"], best["tau"]) == (g, t)
    assert best["kl"] == pytest.approx(grid[(g, t)], rel=1e-4)


def test_training_plots_draw_uniform_fixed_and_one_strip_per_controller(tmp_path, figures):
    recs, table = synthetic_records(120, (2, 4), 8, seed=5)
    enc = table_encoder(table, "t8")
    res = train_controller(recs, tmp_path / "run", encoder=enc, cache_dir="", epochs=3,
                           progress=False, threads=1, controller={"score_hidden": [16], "calib_hidden": 8},
                           keep_network=True)
    plots.write_training_plots(res.out / "plots", res.history, res.outputs, res.report_data)
    for name in ("loss.png", "g_tau.png", "entropy.png"):
        assert (tmp_path / "run" / "plots" / name).read_bytes()[:8] == PNG
    val = json.loads((tmp_path / "run" / "metrics.json").read_text())["train"]

    # loss.png: the training curve, and a horizontal line at the uniform merge's KL on the training records
    ax = figures["loss.png"]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["train"].get_ydata()) == pytest.approx([h["train_loss"] for h in res.history])
    ref = [ln for label, ln in lines.items() if label.startswith("uniform (PRAG's merge), training set")]
    assert len(ref) == 1 and list(ref[0].get_ydata()) == pytest.approx([val["uniform"]["kl"]] * 2, rel=1e-6)

    # g_tau.png: uniform is the vertical line g = 0, the star is the best fixed (g, tau) on the training data
    ax = figures["g_tau.png"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    uniform = [ln for ln in ax.get_lines() if ln.get_label().startswith("uniform")]
    assert len(uniform) == 1 and list(uniform[0].get_xdata()) == [0.0, 0.0]
    vdata = build_tensors(recs, enc)
    best = plots.best_fixed(vdata)
    star = [c for c in ax.collections if c.get_label().startswith("best fixed")]
    assert len(star) == 1 and star[0].get_offsets().tolist() == [[best["g"], best["tau"]]]
    assert any(f"KL {val['learned']['kl']:.4g}" in t for t in labels)

    # entropy.png: one strip per controller (rows 0, 1, 2 apart), x = 1 - H(w)/log N: uniform is exactly 0
    ax = figures["entropy.png"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["learned", "uniform", "random"]
    strips = ax.collections
    assert len(strips) == 3
    for row, strip in enumerate(strips):
        ys = strip.get_offsets()[:, 1]
        assert abs(ys - row).max() <= 0.25  # jitter stays inside the row: strips never overlap
    assert set(strips[1].get_offsets()[:, 0].tolist()) == {0.0}
    assert strips[0].get_offsets()[:, 0].max() > 0  # the learned weights are not exactly uniform


def test_plots_without_uniform_outputs_or_history(tmp_path, figures):
    """Outputs without a uniform baseline (and an empty history) still plot: no reference line, no KL label."""
    recs, table = synthetic_records(20, 3, 8, seed=7)
    data = build_tensors(recs, table_encoder(table, "t8"))
    n = data.mask.shape[1]
    outputs = {"mine": {"w": torch.full((len(data), n), 1.0 / n), "g": torch.zeros(len(data)),
                        "tau": torch.ones(len(data))}}
    paths = plots.write_training_plots(tmp_path, [], outputs, data)
    assert [p.name for p in paths] == ["g_tau.png", "entropy.png"]
    assert not any(ln.get_label().startswith("uniform") and "KL" in ln.get_label()
                   for ln in figures["g_tau.png"].get_lines())
