"""``report.png``: each table row's held-out F1 with its 95% CI, one group per dataset (with matplotlib).

Each row has its own colour, fixed by its name (:data:`COLOURS`), so a row looks the same in every study: PRAG's
rows and the others in one palette, DyPRAG's rows in shades of purple that no other row uses, and hatched
(:data:`DYPRAG_HATCH`), so the two hosts' rows are told apart at a glance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..dyprag import is_dyprag
from .markdown import model_name
from .tables import PAPER_ROWS

DYPRAG_HATCH = "//"
COLOURS = {"vanilla": "#7f7f7f", "standard_rag": "#bcbd22", "prag_sum": "#1f77b4", "prag_sum_combine": "#17becf",
           "recommended": "#2ca02c", "recommended_combine": "#98df8a", "random_controller": "#d62728",
           "random_controller_combine": "#ff9896",
           # DyPRAG's: purples only (no other row's colour is one)
           "dyprag": "#3f007d", "dyprag_combine": "#6a51a3", "dyprag_recommended": "#9e9ac8",
           "dyprag_recommended_combine": "#cbc9e2"}


def write_plot(s: dict[str, Any], path: Path) -> str | None:
    """``report.png``: F1 (points) per table row with its 95% CI, one group per dataset; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [n for n in PAPER_ROWS if n in s["methods"]]
    datasets = list(s["datasets"])
    fig, ax = plt.subplots(figsize=(2.8 * len(datasets) + 3.8, 4.0))
    width = 0.8 / len(rows)
    for i, n in enumerate(rows):
        xs, ys, lo, hi = [], [], [], []
        for j, d in enumerate(datasets):
            b = s["methods"][n]["by_dataset"][d]
            if b["f1"] is None:
                continue
            ci = b["ci95_f1"] or [b["f1"], b["f1"]]
            xs.append(j + (i - (len(rows) - 1) / 2) * width)
            ys.append(100 * b["f1"])
            lo.append(100 * (b["f1"] - ci[0]))
            hi.append(100 * (ci[1] - b["f1"]))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=n, color=COLOURS.get(n),
               hatch=DYPRAG_HATCH if is_dyprag(n) else None, edgecolor="white" if is_dyprag(n) else None)
    ax.set_xticks(range(len(datasets)), [f"{d} (n={s['datasets'][d]['n_test']})" for d in datasets])
    ax.set_ylabel("F1 (points), held-out, 95% CI")
    ax.set_title(f"{model_name(s['settings'])}: what each row answers")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
