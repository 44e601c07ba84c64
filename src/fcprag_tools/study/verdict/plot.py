"""``report.png``: each table row's held-out F1 with its 95% CI, one group per dataset (with matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .markdown import model_name
from .tables import PAPER_ROWS


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
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=n)
    ax.set_xticks(range(len(datasets)), [f"{d} (n={s['datasets'][d]['n_test']})" for d in datasets])
    ax.set_ylabel("F1 (points), held-out, 95% CI")
    ax.set_title(f"{model_name(s['settings'])}: what each row answers")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
