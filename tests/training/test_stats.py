"""training/stats.py: grouped folds, bootstrap CIs over questions, Wilson intervals (references written out)."""

import pytest
import torch

from fcprag_plugin.training.stats import bootstrap_ci, group_kfold, wilson_interval
from helpers import wilson_by_bisection


def test_cv_folds_never_share_a_question():
    groups = [f"q{i // 3}" for i in range(90)] + [f"r{i}" for i in range(7)]
    for k in (2, 3, 5):
        folds = group_kfold(groups, k, seed=k)
        assert sorted(i for f in folds for i in f) == list(range(len(groups)))
        owner = {}
        for f, rows in enumerate(folds):
            for i in rows:
                assert owner.setdefault(groups[i], f) == f
    assert len(group_kfold(["a", "a", "b"], 5, 0)) == 2  # fewer questions than folds: fewer folds


def test_bootstrap_ci_resamples_questions():
    values = torch.tensor([1.0, 1.0, 1.0, -1.0])  # question a: three records, question b: one
    assert bootstrap_ci(values, ["a", "a", "a", "b"], 0) == (pytest.approx(-1.0), pytest.approx(1.0))
    lo, hi = bootstrap_ci(torch.full((50,), 0.3), [str(i) for i in range(50)], 0)
    assert lo == pytest.approx(0.3) and hi == pytest.approx(0.3)
    v = torch.randn(200, generator=torch.Generator().manual_seed(0))
    wide, narrow = bootstrap_ci(v, [str(i) for i in range(200)], 1, level=0.975), bootstrap_ci(v, [str(i) for i in
                                                                                                   range(200)], 1)
    assert wide[0] < narrow[0] and wide[1] > narrow[1]  # the Bonferroni-adjusted interval is wider


def test_wilson_interval_is_the_root_of_its_defining_equation():
    for k, n in ((0, 10), (1, 10), (5, 10), (10, 10), (3, 126), (14, 196)):
        lo, hi = wilson_interval(k, n)
        assert hi == pytest.approx(wilson_by_bisection(k, n, True), abs=1e-9)
        assert lo == pytest.approx(wilson_by_bisection(k, n, False), abs=1e-9)
    assert wilson_interval(0, 0) == (0.0, 1.0)
