"""The terminal text of ``fcprag train`` / ``fcprag eval``: the metrics table and the verdict lines."""

import math

from fcprag_tools.train_report import format_table, train_table, verdict_lines


def metrics(top1):
    return {"n": 10, "n_nonflat": 8, "kl": 0.25, "top1": top1, "spearman": None, "spearman_n": 0}


def test_format_table_has_a_column_per_controller_and_a_row_per_metric():
    table = format_table({"learned": metrics(0.5), "uniform": metrics(math.nan)}, "validation")
    lines = table.splitlines()
    assert lines[0] == "validation" and lines[1].split() == ["metric", "learned", "uniform"]
    assert "top1" in table and "spearman" in table
    assert lines[[r.split()[0] for r in lines].index("top1")].split() == ["top1", "0.5000", "-"]  # NaN: "-"


def test_train_table_adds_the_verdict_when_cross_validation_ran():
    part = {"gain": 0.1, "ci95": [0.05, 0.15], "shown": True, "measured": True}
    cv = {"folds": 5, "n_groups": 40, "shipped": "scale_only", "kappa": 2.0, "verdict": "better_than_uniform",
          "gain": 0.1, "ci95": [0.05, 0.15], "reweighting": {**part, "shown": False},
          "scale": {**part, "kappa": 2.0, "chosen_by": "measured", "at_grid_edge": False}}
    text = train_table({"train": {"learned": metrics(0.5)}, "cv": cv})
    assert text.startswith("training set") and text.endswith("\n".join(verdict_lines(cv)))
    assert "a scale-only controller (PRAG's sum times 2, no network)" in text and "better than PRAG's sum" in text
    assert train_table({"train": {"learned": metrics(0.5)}}) == format_table({"learned": metrics(0.5)}, "training set")
