"""summary.json's checker (no JSON schema) and the verdict rule: what ships agrees with the measured parts."""

from __future__ import annotations

import copy

import pytest

from fcprag_tools.study.summary import check_summary, decide


def _part(delta, lo, hi, measured=True):
    return {"delta": delta, "ci95": [lo, hi], "measured": measured, "rows": []}


def good():
    m = {"logprob": -1.0, "f1": 0.2, "em": 0.1, "acc": 0.3}
    p = {"delta_logprob": 0.1, "ci95_logprob": [0.0, 0.2], "delta_f1": 0.0, "ci95_f1": [-0.1, 0.1]}
    names = ["prag_sum", "recommended", "learned", "learned_same_total", "scale:2"]
    return {"n_train": 10, "n_test": 5, "settings": {"model": "m", "device": "cpu", "dtype": "float32"},
            "methods": {n: dict(m) for n in names}, "paired": {n: dict(p) for n in names[1:]},
            "verdict": {"ship": "scale_only", "kappa": 2.0, "scale": _part(0.1, 0.02, 0.2),
                        "reweighting": _part(0.0, -0.1, 0.1)}}


def test_a_complete_summary_passes():
    assert check_summary(good()) == []


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.pop("n_test"), "n_test"),
    (lambda s: s["settings"].pop("dtype"), "settings"),
    (lambda s: s["methods"].pop("recommended"), "'recommended' missing"),
    (lambda s: s["methods"].pop("learned"), "'learned' missing"),
    (lambda s: [s["methods"].pop(k) for k in list(s["methods"]) if k.startswith("scale:")], "scale:<s>"),
    (lambda s: s["methods"]["prag_sum"].pop("em"), "methods['prag_sum']"),
    (lambda s: s["paired"]["learned"].pop("ci95_logprob"), "paired['learned']"),
    (lambda s: s["paired"]["learned"].update(ci95_logprob=[0.2, 0.1]), "paired['learned']"),
    (lambda s: s["verdict"].update(ship="both"), "verdict.ship"),
    (lambda s: s["verdict"]["scale"].pop("measured"), "verdict.scale"),
    (lambda s: s["verdict"].update(ship="network"), "reweighting's CI does not lie above 0"),
    (lambda s: s["verdict"]["scale"].update(ci95=[-0.1, 0.2]), "scale part's CI does not lie above 0"),
])
def test_each_missing_or_contradicting_field_is_named(edit, needle):
    s = copy.deepcopy(good())
    edit(s)
    assert any(needle in p for p in check_summary(s)), check_summary(s)


def test_the_verdict_ships_only_what_its_measured_parts_show():
    up, flat = _part(0.1, 0.02, 0.2), _part(0.01, -0.02, 0.04)
    assert decide(up, up, 0.3)[0] == "network"
    assert decide(up, up, -0.1)[0] == "scale_only"  # reweighting shown but the network loses to the sum
    assert decide(up, flat, 0.3)[0] == "scale_only"
    assert decide(flat, flat, 0.3)[0] == "prag_sum"
    assert decide(flat, {"delta": None, "ci95": None, "measured": False, "rows": []}, None)[0] == "prag_sum"
