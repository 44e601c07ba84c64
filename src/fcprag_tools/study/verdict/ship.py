"""What ships in each setting, decided on the training questions alone, and the held-out parts that measure it.

``ship`` comes from the trainer's nested cross-validation (``config.cv``, out-of-fold gains with 95% CIs): ``network``
only when the reweighting gain's lower bound lies above ``min_gain``, else ``scale_only`` when kappa is not 1 and
the scale gain's lower bound lies above the scale margin, else ``prag_sum`` (:class:`..options.Policy`, the margins
recorded per setting); a given controller (``--controller``) is decided elsewhere and ships as it is. The held-out
questions only measure it:

- ``scale``: PRAG's sum times the controller's ``kappa`` (for a given controller that reweights, its same-total
  twin) against PRAG's sum of that setting; not measured when kappa is 1;
- ``reweighting``: the learned network against its same-total twin (every passage at the mean of its ``w~``);
- ``total``: the controller's own row against PRAG's sum; each "equivalent" when its CI lies inside ``±margin``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from fcprag_plugin.training import Z95
from ..options import Policy
from ..stats import paired
from .kappa import kappa_rule
from .records import ControllerRecord, Measured, Part, ScoredRows, SettingVerdict, suffix


def part(rows: ScoredRows, keys: Sequence[str], a: str, b: str, margin: float) -> Part:
    """``a`` against ``b`` in gold log-lik. over ``keys`` (``equivalent``: the CI lies inside ``±margin``)."""
    d, ci = paired(rows.diffs(keys, a, b, "logprob"), "logprob")
    return Part(True, d, ci, (a, b), margin, -margin < ci[0] and ci[1] < margin)


def not_measured(why: str) -> Part:
    return Part(False, why=why)


def cv_part(cv: Mapping[str, Any] | None, key: str) -> dict[str, Any] | None:
    """The trainer's out-of-fold ``{"gain", "ci95"}`` of part ``key`` (``scale``, ``reweighting``), when recorded."""
    p = (cv or {}).get(key)
    ok = isinstance(p, dict) and isinstance(p.get("gain"), (int, float)) and isinstance(p.get("ci95"), list)
    return {"gain": float(p["gain"]), "ci95": [float(x) for x in p["ci95"]]} if ok else None


def decide(cv: Mapping[str, Any] | None, *, network: bool, kappa: float, policy: Policy) -> tuple[str, str]:
    """``(ship, why)`` from the training questions alone (the trainer's cross-validation ``cv``): ``network`` when
    there is one and its reweighting gain's lower bound lies above ``policy.min_gain``; else ``scale_only`` when
    ``kappa`` is not 1 and the scale gain's lower bound lies above the scale margin; else ``prag_sum``."""
    rw, sc = cv_part(cv, "reweighting"), cv_part(cv, "scale")
    m, ms = policy.min_gain, policy.scale_margin

    def said(p: dict[str, Any]) -> str:
        return f"{p['gain']:+.2g} [{p['ci95'][0]:+.2g}, {p['ci95'][1]:+.2g}]"

    if rw is None and sc is None:
        return "prag_sum", ("no cross-validation on the training questions (too few for its folds): no gain is shown "
                            "above the margin, so PRAG's sum ships")
    if network and rw is not None and rw["ci95"][0] > m:
        return "network", f"the reweighting gain on the training questions (out of fold) {said(rw)} lies above +{m:g}"
    why = ["no network" if not network else "the reweighting gain on the training questions (out of fold) "
           + (f"{said(rw)} does not lie above +{m:g}" if rw else "is not recorded")]
    if kappa != 1.0 and sc is not None and sc["ci95"][0] > ms:
        return "scale_only", f"{why[0]}; the scale x{kappa:g} gains {said(sc)}, above +{ms:g}"
    why.append("kappa is 1: no scale" if kappa == 1.0 else
               f"the scale x{kappa:g} gain {said(sc) if sc else '(not recorded)'} does not lie above +{ms:g}")
    return "prag_sum", "; ".join(why)


def rule_starved(args: Mapping[str, Any], n_train: int) -> int | None:
    """The training questions the risk rule in trainer ``args`` needs before it can allow any scale, when
    ``n_train`` is fewer (else None). The rule applies with kappa "auto" and the share's upper bound; at zero losses
    the 95% Wilson upper bound of the loss share, ``z^2 / (n + z^2)``, exceeds the share below the need (35 at 0.1)."""
    share = args.get("scale_max_loss_share")
    if args.get("kappa") != "auto" or args.get("scale_bound") != "upper" or not share or not 0 < share < 1:
        return None
    need = math.ceil(Z95 ** 2 * (1 - share) / share)
    return need if n_train < need else None


def _parts(rows: ScoredRows, keys: Sequence[str], setting: str, kappa: float, learned: bool, given: bool,
           policy: Policy) -> tuple[Part, Part, Part, str]:
    """The held-out ``(scale, reweighting, total, own row)`` of ``setting``."""
    sfx = suffix(setting)
    sname = f"scale:{kappa:g}{sfx}" if kappa != 1.0 else f"prag_sum{sfx}"
    m, ms = policy.min_gain, policy.scale_margin
    if given and learned:
        scale = part(rows, keys, f"learned_same_total{sfx}", f"prag_sum{sfx}", ms)
    elif kappa != 1.0:
        scale = part(rows, keys, sname, f"prag_sum{sfx}", ms)
    else:
        scale = not_measured("kappa is 1 (PRAG's sum): no scale to measure")
    reweighting = part(rows, keys, f"learned{sfx}", f"learned_same_total{sfx}", m) if learned else \
        not_measured("no network")
    own = f"learned{sfx}" if learned else sname
    total = part(rows, keys, own, f"prag_sum{sfx}", m) if own != f"prag_sum{sfx}" else \
        not_measured("the controller is PRAG's sum")
    return scale, reweighting, total, own


def setting_verdict(rows: ScoredRows, setting: str, ctrl: ControllerRecord, *, given: bool, policy: Policy,
                    default_args: Mapping[str, Any]) -> SettingVerdict:
    """What ships in ``setting``, decided on the training questions only (``ctrl.cv``, the trainer's nested
    cross-validation; a given controller ships as it is, decided elsewhere), the held-out parts that measure it,
    each with its equivalence at the margin, and the risk rule's figures behind its kappa (:mod:`.kappa`; the
    trainer's ``default_args`` when its own are not kept)."""
    test, n_train = rows.test, len(rows.train)
    sfx, kappa, cv = suffix(setting), float(ctrl.kappa), ctrl.cv or {}
    learned = any(rows.has(q, f"learned{sfx}") for q in test)  # a network: measured (missing rows leave questions)
    sname = f"scale:{kappa:g}{sfx}" if kappa != 1.0 else f"prag_sum{sfx}"
    keys = rows.complete(test, [f"prag_sum{sfx}", sname]
                         + ([f"learned{sfx}", f"learned_same_total{sfx}"] if learned else []))
    scale, reweighting, total, own = _parts(rows, keys, setting, kappa, learned, given, policy)
    if given:  # nothing is trained or decided here: the given controller is what it is, and is measured
        ship = "network" if learned else "scale_only" if kappa != 1.0 else "prag_sum"
        why = (f"the given controller as it is ({ship}); this study decides nothing about it and measures it on "
               "every question")
    else:
        ship, why = decide(cv, network=learned, kappa=kappa, policy=policy)
    need = rule_starved(ctrl.args or {}, n_train) if kappa == 1.0 and not given else None
    if need:
        why += (f"; with {n_train} training questions the risk rule cannot allow any scale (the 95% upper bound of "
                f"the loss share stays above {ctrl.args['scale_max_loss_share']:g} even if no question loses): "
                f"it needs about {need}")
    if given:  # the recommended row is the given controller itself
        rec = own
        decided_on = "elsewhere: a given controller (its own training questions, none evaluated here)"
    else:
        rec = {"network": f"learned{sfx}", "scale_only": sname, "prag_sum": f"prag_sum{sfx}"}[ship]
        decided_on = f"{n_train} training questions (the trainer's nested cross-validation, out-of-fold gains)"
    return SettingVerdict(setting, ship, kappa if ship != "prag_sum" else 1.0, kappa, decided_on, policy.margins(),
                          {"reweighting": cv_part(cv, "reweighting"), "scale": cv_part(cv, "scale")},
                          Measured(scale, reweighting, total, len(keys)), why, rec,
                          kappa_rule(ctrl, rows, keys, setting, given=given, default_args=default_args))
