"""The study's result, a function of the scored rows and the verdicts it is given: ``summary.json`` (fields
checked by :func:`check_summary`), ``report.md`` (every figure read from the summary) and ``report.png``.

Two settings, each with its own controller: ``param`` (PRAG's prompt, the question only) and ``combine`` (the
passages in the prompt too, the paper's "Combine"); a row's Combine twin carries the suffix ``_combine``.

Decided on the training questions only (``decided_on``): ``ship`` comes from the trainer's nested cross-validation
(``config.cv``, out-of-fold gains with 95% CIs): ``network`` only when the reweighting gain's lower bound lies above
``min_gain``, else ``scale_only`` when kappa is not 1 and the scale gain's lower bound lies above the scale margin,
else ``prag_sum`` (:class:`Policy`, the margins recorded per setting); a given controller (``--controller``) is
decided elsewhere and ships as it is. The held-out questions only measure it:

- ``scale``: PRAG's sum times the controller's ``kappa`` (for a given controller that reweights, its same-total
  twin) against PRAG's sum of that setting; not measured when kappa is 1;
- ``reweighting``: the learned network against its same-total twin (every passage at the mean of its ``w~``);
- ``total``: the controller's own row against PRAG's sum; each "equivalent" when its CI lies inside ``±margin``.

"What to run" (``verdict.what_to_run``, ``verdict.what_to_run_by_dataset``): among the candidates (:data:`CANDIDATES`
less a ``recommended`` row that is PRAG's sum), the row with the highest mean F1 on the training questions (a tie:
PRAG's sum when tied, else the cheapest tied row, and said as a tie), overall and per dataset; its F1 against
``standard_rag`` and against the host's own row of its setting on the held-out questions, paired percentile-bootstrap
intervals Bonferroni-corrected over every interval of the choice, each with the smallest difference it can detect at
80% power (``mde_f1``) and the questions a target effect needs (``n_needed``). With a given controller nothing is
trained: the choice is made on the evaluated questions themselves and says so (descriptive).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.fileio import write_atomic, write_json
from fcprag_plugin.training import SHIPS, Z95
from .ceiling import reached
from .options import Policy
from .stats import detectable, paired

logger = logging.getLogger(__name__)

METRICS = ("logprob", "f1", "em", "acc")
STUDY_SHIPS = tuple(s for s in SHIPS if s != "query_scale")  # what a study ships (no per-query scale is measured)
SETTINGS = ("param", "combine")  # PRAG's prompt (the question only) and the paper's Combine (passages in it too)
# the rows a PRAG user compares (the paper's table), in this order; the candidates of "what to run" first
CANDIDATES = ("vanilla", "standard_rag", "prag_sum", "prag_sum_combine", "recommended", "recommended_combine")
TABLE_ROWS = (*CANDIDATES, "random_controller", "random_controller_combine")
HOST_ROW = {"vanilla": "prag_sum", "standard_rag": "prag_sum", "prag_sum": "prag_sum", "recommended": "prag_sum",
            "prag_sum_combine": "prag_sum_combine", "recommended_combine": "prag_sum_combine"}
WHAT_TO_RUN_BOOT = 10_000
READINGS = ("same", "tie", "better", "worse", "equivalent", "not_shown")  # a held-out F1 comparison's reading
SMALL_TEST = 30  # fewer held-out questions: the report warns that its intervals mean little


def suffix(setting: str) -> str:
    """A row's or file's name suffix for ``setting``: none for ``param`` (PRAG's), ``_combine``."""
    return "" if setting == "param" else f"_{setting}"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------- the verdict of one setting
def part(results: dict[str, dict[str, Any]], keys: list[str], a: str, b: str, margin: float) -> dict[str, Any]:
    """``a`` against ``b`` in gold log-lik. over ``keys``: ``{"delta", "ci95", "measured", "rows", "margin",
    "equivalent"}`` (``equivalent``: the CI lies inside ``±margin``)."""
    d, ci = paired([results[f"{q}|{a}"]["logprob"] - results[f"{q}|{b}"]["logprob"] for q in keys], "logprob")
    return {"delta": d, "ci95": ci, "measured": True, "rows": [a, b], "margin": margin,
            "equivalent": -margin < ci[0] and ci[1] < margin}


def not_measured(why: str) -> dict[str, Any]:
    return {"delta": None, "ci95": None, "measured": False, "rows": [], "why": why}


def cv_part(cv: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """The trainer's out-of-fold ``{"gain", "ci95"}`` of part ``key`` (``scale``, ``reweighting``), when recorded."""
    p = (cv or {}).get(key)
    ok = isinstance(p, dict) and isinstance(p.get("gain"), (int, float)) and isinstance(p.get("ci95"), list)
    return {"gain": float(p["gain"]), "ci95": [float(x) for x in p["ci95"]]} if ok else None


def decide(cv: dict[str, Any] | None, *, network: bool, kappa: float, policy: Policy) -> tuple[str, str]:
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


def rule_starved(args: dict[str, Any], n_train: int) -> int | None:
    """The training questions the risk rule in trainer ``args`` needs before it can allow any scale, when
    ``n_train`` is fewer (else None). The rule applies with kappa "auto" and the share's upper bound; at zero losses
    the 95% Wilson upper bound of the loss share, ``z^2 / (n + z^2)``, exceeds the share below the need (35 at 0.1)."""
    share = args.get("scale_max_loss_share")
    if args.get("kappa") != "auto" or args.get("scale_bound") != "upper" or not share or not 0 < share < 1:
        return None
    need = math.ceil(Z95 ** 2 * (1 - share) / share)
    return need if n_train < need else None


def complete_keys(results: dict[str, dict[str, Any]], qids: Sequence[str], names: Sequence[str]) -> list[str]:
    """The questions of ``qids`` that have every row of ``names``."""
    return [q for q in qids if all(f"{q}|{n}" in results for n in names)]


def setting_verdict(results: dict[str, dict[str, Any]], test: Sequence[str], setting: str, ctrl: Any, *,
                    given: bool, trainer_args: dict[str, Any] | None, n_train: int,
                    policy: Policy | None = None) -> dict[str, Any]:
    """What ships in ``setting``, decided on training questions only (``ctrl.config.cv``, the trainer's nested
    cross-validation; a given controller ships as it is, decided elsewhere), and the held-out parts that measure
    it: ``scale``, ``reweighting`` and ``total`` (the controller's row against PRAG's sum), each with its
    equivalence at the margin. ``ctrl``: anything with ``config.kappa`` and ``config.cv``."""
    policy = policy or Policy()
    sfx, kappa = suffix(setting), float(ctrl.config.kappa)
    cv = getattr(ctrl.config, "cv", None) or {}
    learned = all(f"{q}|learned{sfx}" in results for q in test)
    sname = f"scale:{kappa:g}{sfx}" if kappa != 1.0 else f"prag_sum{sfx}"
    names = [f"prag_sum{sfx}", sname] + ([f"learned{sfx}", f"learned_same_total{sfx}"] if learned else [])
    keys = complete_keys(results, test, names)
    m, ms = policy.min_gain, policy.scale_margin
    if given and learned:
        scale = part(results, keys, f"learned_same_total{sfx}", f"prag_sum{sfx}", ms)
    elif kappa != 1.0:
        scale = part(results, keys, sname, f"prag_sum{sfx}", ms)
    else:
        scale = not_measured("kappa is 1 (PRAG's sum): no scale to measure")
    reweighting = part(results, keys, f"learned{sfx}", f"learned_same_total{sfx}", m) if learned else \
        not_measured("no network")
    own = f"learned{sfx}" if learned else sname
    total = part(results, keys, own, f"prag_sum{sfx}", m) if own != f"prag_sum{sfx}" else \
        not_measured("the controller is PRAG's sum")
    if given:  # nothing is trained or decided here: the given controller is what it is, and is measured
        ship = "network" if learned else "scale_only" if kappa != 1.0 else "prag_sum"
        why = (f"the given controller as it is ({ship}); this study decides nothing about it and measures it on "
               "every question")
    else:
        ship, why = decide(cv, network=learned, kappa=kappa, policy=policy)
    need = rule_starved(trainer_args or {}, n_train) if kappa == 1.0 and not given else None
    if need:
        why += (f"; with {n_train} training questions the risk rule cannot allow any scale (the 95% upper bound of "
                f"the loss share stays above {trainer_args['scale_max_loss_share']:g} even if no question loses): "
                f"it needs about {need}")
    if given:  # the recommended row is the given controller itself
        rec = own
        decided_on = "elsewhere: a given controller (its own training questions, none evaluated here)"
    else:
        rec = {"network": f"learned{sfx}", "scale_only": sname, "prag_sum": f"prag_sum{sfx}"}[ship]
        decided_on = f"{n_train} training questions (the trainer's nested cross-validation, out-of-fold gains)"
    return {"setting": setting, "ship": ship, "kappa": kappa if ship != "prag_sum" else 1.0, "kappa_learned": kappa,
            "decided_on": decided_on, "margins": policy.margins(),
            "cv": {"reweighting": cv_part(cv, "reweighting"), "scale": cv_part(cv, "scale")},
            "scale": scale, "reweighting": reweighting, "total": total, "why": why, "recommended_row": rec,
            "n": len(keys)}


def shipped_controller(verdict: dict[str, Any], ctrl: Any) -> Any:
    """The controller of what ships (the trained one's recipe recorded: its check warns on other adapters)."""
    from fcprag_plugin import FusionController

    cfg = ctrl.config
    if verdict["ship"] == "network":
        return ctrl
    shipped = FusionController.scale_only(verdict["kappa"], embed_dim=cfg.embed_dim,
                                          embedding_model=cfg.embedding_model)
    shipped.config.trained_for = cfg.trained_for
    return shipped.eval()


# ----------------------------------------------------------------------------- tables
def row_names(results: dict[str, dict[str, Any]], test: Sequence[str]) -> list[str]:
    """Every row measured on all the held-out questions, the paper's rows first, then in first-scored order."""
    seen = dict.fromkeys(k.split("|", 1)[1] for k in results if k.split("|", 1)[0] in set(test))
    names = [n for n in seen if not n.startswith("loo:") and all(f"{q}|{n}" in results for q in test)]
    return [n for n in TABLE_ROWS if n in names] + [n for n in names if n not in TABLE_ROWS]


def metric_means(results: dict[str, dict[str, Any]], qids: Sequence[str], name: str) -> dict[str, Any]:
    rows = [results[f"{q}|{name}"] for q in qids]
    return {m: _mean([float(r[m]) for r in rows if r.get(m) is not None]) for m in METRICS}


def breakdown(results: dict[str, dict[str, Any]], qs: dict[str, dict[str, Any]], keys: Sequence[str],
              name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(by_dataset, by_subtask)`` of one row: F1 / EM means and n per ``"<dataset>/<subtask>"``; per dataset
    also the gold log-lik., the macro F1 over its subtasks and the F1 mean's 95% CI (for the plot)."""
    by_subtask: dict[str, Any] = {}
    by_dataset: dict[str, Any] = {}
    for d in dict.fromkeys(qs[q]["dataset"] for q in keys):
        dq = [q for q in keys if qs[q]["dataset"] == d]
        subs = {}
        for s in sorted(dict.fromkeys(qs[q]["subtask"] for q in dq)):
            sq = [q for q in dq if qs[q]["subtask"] == s]
            m = metric_means(results, sq, name)
            subs[s] = by_subtask[f"{d}/{s}"] = {"f1": m["f1"], "em": m["em"], "n": len(sq)}
        m = metric_means(results, dq, name)
        f1s = [results[f"{q}|{name}"].get("f1") for q in dq]
        ci = paired([float(x) for x in f1s], f"f1:{d}")[1] if all(x is not None for x in f1s) else None
        macro = [v["f1"] for v in subs.values() if v["f1"] is not None]
        by_dataset[d] = {"f1": m["f1"], "em": m["em"], "logprob": m["logprob"], "n": len(dq),
                         "f1_macro": _mean(macro) if len(macro) == len(subs) else None, "ci95_f1": ci}
    return by_dataset, by_subtask


def host_of(name: str) -> str:
    """The host's own row in the setting of row ``name``: what its deltas are paired against."""
    return "prag_sum_combine" if name.endswith("_combine") or name == "standard_rag" else "prag_sum"


def paired_table(results: dict[str, dict[str, Any]], keys: Sequence[str], names: Sequence[str],
                 policy: Policy | None = None) -> dict[str, Any]:
    """Each row against the host's row of its setting (``against``), every metric, paired over ``keys``; for F1 also
    ``mde_f1`` and ``n_needed`` (for ``policy.target_f1``) at 95% (:func:`.stats.detectable`)."""
    policy = policy or Policy()
    pairs: dict[str, Any] = {}
    for n in names:
        against = host_of(n)
        if n == against:
            continue
        pairs[n] = {"against": against}
        for m in METRICS:
            diffs = [float(results[f"{q}|{n}"][m]) - float(results[f"{q}|{against}"][m]) for q in keys
                     if results[f"{q}|{n}"].get(m) is not None and results[f"{q}|{against}"].get(m) is not None]
            d, ci = paired(diffs, m) if diffs else (None, None)  # one resampling per metric for every row
            pairs[n][f"delta_{m}"], pairs[n][f"ci95_{m}"] = d, ci
            if m == "f1" and diffs:
                det = detectable(diffs, 0.95, policy.target_f1, policy.power)
                pairs[n]["mde_f1"], pairs[n]["n_needed"] = det["mde"], det["n_needed"]
    return pairs


# ----------------------------------------------------------------------------- what to run
TIE = 1e-9  # training means this close are equal (the same answers give the same F1 mean)


def candidates(verdicts: dict[str, dict[str, Any]]) -> list[str]:
    """:data:`CANDIDATES`, less a ``recommended`` row that is PRAG's sum of its setting (the same answers twice)."""
    same = {f"recommended{suffix(s)}" for s, v in verdicts.items() if v["recommended_row"] == f"prag_sum{suffix(s)}"}
    return [c for c in CANDIDATES if c not in same]


def compare(diffs: list[float], seed: str, level: float, target: float, power: float) -> dict[str, Any]:
    """One held-out F1 comparison: the paired mean, its ``level`` interval, what it can detect and its reading:
    ``tie`` (every difference 0), ``better`` / ``worse`` (the interval excludes 0), ``equivalent`` (inside
    ``±target``), else ``not_shown``."""
    d, ci = paired(diffs, seed, level, WHAT_TO_RUN_BOOT)
    det = detectable(diffs, level, target, power)
    reading = ("tie" if det["n_nonzero"] == 0 else "better" if ci[0] > 0 else "worse" if ci[1] < 0 else
               "equivalent" if -target < ci[0] and ci[1] < target else "not_shown")
    return {"delta_f1": d, "ci_f1": ci, "shown": reading == "better", "reading": reading, "mde_f1": det["mde"],
            "n_needed": det["n_needed"], "n_nonzero": det["n_nonzero"], "sd_f1": det["sd"]}


def what_to_run(results: dict[str, dict[str, Any]], qs: dict[str, dict[str, Any]], test: Sequence[str],
                train: Sequence[str], *, descriptive: bool, cands: Sequence[str] = CANDIDATES,
                policy: Policy | None = None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(overall, {dataset: choice})``: the candidate of ``cands`` with the highest training F1 (a tie: PRAG's sum
    when it is among the tied, else the cheapest of them) and its held-out comparisons (:func:`compare`)."""
    policy = policy or Policy()
    choose_on = list(test) if descriptive else list(train)
    if not choose_on or not all(results.get(f"{q}|{c}", {}).get("f1") is not None for q in choose_on
                                for c in cands):
        return None, {}
    datasets = list(dict.fromkeys(qs[q]["dataset"] for q in test))
    level = 1 - 0.05 / (2 * (1 + len(datasets)))  # Bonferroni over every interval of the choice

    def one(dataset: str | None) -> dict[str, Any]:
        inside = lambda qids: [q for q in qids if dataset is None or qs[q]["dataset"] == dataset]  # noqa: E731
        cq, hq = inside(choose_on), inside(test)
        means = {c: _mean([float(results[f"{q}|{c}"]["f1"]) for q in cq]) for c in cands}
        tied = [c for c in cands if means[c] >= max(means.values()) - TIE]
        best = "prag_sum" if "prag_sum" in tied else tied[0]
        out: dict[str, Any] = {"row": best, "tied": tied if len(tied) > 1 else [],
                               "chosen_on": "held-out (descriptive)" if descriptive else "training",
                               "n_choice": len(cq), "choice_f1": means, "n": len(hq), "level": level,
                               "target_f1": policy.target_f1, "power": policy.power,
                               "f1": _mean([float(results[f"{q}|{best}"]["f1"]) for q in hq])}
        for key, other in (("vs_standard_rag", "standard_rag"), ("vs_host", HOST_ROW[best])):
            if best == other:
                out[key] = {"row": other, "delta_f1": 0.0, "ci_f1": [0.0, 0.0], "shown": False, "reading": "same"}
                continue
            diffs = [float(results[f"{q}|{best}"]["f1"]) - float(results[f"{q}|{other}"]["f1"]) for q in hq]
            out[key] = {"row": other, **compare(diffs, f"what_to_run:{dataset}:{other}", level, policy.target_f1,
                                                policy.power)}
        out["plain"] = plain(out, dataset)
        return out

    return one(None), {d: one(d) for d in datasets}


def reading_text(v: dict[str, Any], n: int, target: float) -> str:
    """One held-out comparison in words, its power said where it shows nothing."""
    pct = lambda x: f"{100 * x:+.1f}"  # noqa: E731
    fig = f"{pct(v['delta_f1'])} F1 [{pct(v['ci_f1'][0])}, {pct(v['ci_f1'][1])}] against {v['row']}"
    if v["reading"] == "tie":
        return f"the same F1 as {v['row']} on every one of the {n} questions (a tie)"
    if v["reading"] in ("better", "worse"):
        return f"{fig} ({v['reading']}: shown)"
    if v["reading"] == "equivalent":
        return f"{fig} (equivalent within ±{100 * target:g} F1)"
    can = (f"no difference above {100 * v['mde_f1']:.1f} F1 can be seen with {n} questions; about "
           f"{v['n_needed']} are needed for {100 * target:+g} F1") if v.get("mde_f1") is not None else \
        f"{n} questions are too few to size a test"
    return f"{fig} (not shown, {v['n_nonzero']} of {n} questions differ: {can})"


def plain(c: dict[str, Any], dataset: str | None) -> str:
    """The choice in one sentence a user acts on: a tie is said as one, never as a winner."""
    where = f"on {dataset}" if dataset else "overall"
    name = {"vanilla": "no retrieval (the question alone)", "standard_rag": "standard RAG (the passages in the "
            "prompt, no adapter)", "prag_sum": "PRAG's sum"}
    f1 = 100 * c["choice_f1"][c["row"]]
    if c["tied"]:
        why = "PRAG's own merge, so nothing changes" if c["row"] == "prag_sum" else "the cheapest of them"
        lead = (f"{', '.join(c['tied'])} tie on the {'training ' if c['chosen_on'] == 'training' else ''}questions "
                f"(F1 {f1:.1f}); run {name.get(c['row'], c['row'])}, {why}")
    else:
        lead = f"run {name.get(c['row'], '`' + c['row'] + '`')} (the highest F1 on the " \
               f"{'training ' if c['chosen_on'] == 'training' else ''}questions, {f1:.1f})"
    vs = [reading_text(c[k], c["n"], c["target_f1"]) for k in ("vs_standard_rag", "vs_host")
          if c[k]["reading"] != "same" and not (k == "vs_host" and c[k]["row"] == c["vs_standard_rag"]["row"])]
    held = c["chosen_on"] == "training"  # else chosen and measured on the same questions: descriptive
    measured = "held out" if held else "on the same questions"
    n = f"{c['n']} held-out questions" if held else f"{c['n']} questions"
    return f"{where}: {lead}" + (f"; {measured}: {'; '.join(vs)}" if vs else "") + \
        f" ({n}, {100 * c['level']:.2f}% intervals{'' if held else '; chosen on them: descriptive, not a test'})"


# ----------------------------------------------------------------------------- the whole summary
def finish(qs: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]], verdicts: dict[str, dict[str, Any]],
           *, given: bool, settings: dict[str, Any], cv: dict[str, Any], stage_seconds: dict[str, float],
           out: Path, shared: dict[str, dict[str, int]] | None = None, policy: Policy | None = None) -> dict[str, Any]:
    """The ``recommended`` rows, ``summary.json``, ``report.md`` and ``report.png`` (when matplotlib is there).
    ``shared``: the rows scored once for another (``{row: {the row it shares: questions}}``)."""
    policy = policy or Policy()
    test = [q for q, r in qs.items() if r["split"] == "test"]
    train = [q for q, r in qs.items() if r["split"] == "train"]
    results = dict(results)
    for s, v in verdicts.items():  # the recommended rows are the rows of what ships, on every question scored
        for q in qs:
            src = results.get(f"{q}|{v['recommended_row']}")
            if src is not None:
                results[f"{q}|recommended{suffix(s)}"] = {**src, "id": f"{q}|recommended{suffix(s)}"}
    names = row_names(results, test)
    keys = complete_keys(results, test, names)
    methods = {}
    for n in names:
        by_dataset, by_subtask = breakdown(results, qs, keys, n)
        methods[n] = {**metric_means(results, keys, n), "by_dataset": by_dataset, "by_subtask": by_subtask}
    overall, by_dataset = what_to_run(results, qs, keys, train, descriptive=given, cands=candidates(verdicts),
                                      policy=policy)
    param = verdicts["param"]
    pairs = paired_table(results, keys, names, policy)
    summary = {
        "n_train": len(train), "n_test": len(keys), "settings": settings,
        "split": split_info(qs, settings),
        "policy": policy.record(),
        "datasets": {d: {"n_test": sum(qs[q]["dataset"] == d for q in keys),
                         "subtasks": sorted({qs[q]["subtask"] for q in keys if qs[q]["dataset"] == d})}
                     for d in dict.fromkeys(qs[q]["dataset"] for q in keys)},
        "methods": methods, "paired": pairs,
        "verdict": {**{k: param[k] for k in ("ship", "kappa", "kappa_learned", "decided_on", "margins", "cv", "scale",
                                             "reweighting", "why", "recommended_row")},
                    "settings": verdicts, "what_to_run": overall, "what_to_run_by_dataset": by_dataset},
        "ceiling": ceiling_info(qs, keys, pairs, verdicts),
        "training_verdict": {s: {"note": "first order, from the training labels (fcprag train's cross-validation); "
                                         "what ships is decided on it", **c} for s, c in cv.items() if c}
        or None,
        "stage_seconds": stage_seconds, "shared_rows": shared or {},
    }
    problems = check_summary(summary)
    if problems:
        raise RuntimeError(f"summary.json would be incomplete: {problems}")
    write_json(out / "summary.json", summary)
    plot = write_plot(summary, out / "report.png")
    write_atomic(out / "report.md", report(summary, plot))
    return summary


def split_info(qs: dict[str, dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """How the questions were split (checked against each rule) and each ``dataset/subtask``'s train / test count."""
    from .data import split_method

    strata: dict[str, dict[str, int]] = {}
    for r in qs.values():
        c = strata.setdefault(f"{r['dataset']}/{r['subtask']}", {"train": 0, "test": 0, "n": 0})
        c[r["split"]] += 1
        c["n"] += 1
    rows = [{"id": q, "dataset": r["dataset"], "subtask": r["subtask"]} for q, r in qs.items()]
    test = {q for q, r in qs.items() if r["split"] == "test"}
    return {"method": split_method(rows, test, settings), "strata": strata}


def ceiling_info(qs: dict[str, dict[str, Any]], keys: Sequence[str], pairs: dict[str, Any],
                 verdicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The gold-passage ceiling per setting (:func:`.ceiling.reached`), or why its row is absent."""
    per = {s: reached(pairs, s, v["reweighting"]["measured"]) for s, v in verdicts.items()}
    if all(per.values()):
        return {"why_absent": None, "settings": per}
    titles = [qs[q].get("supporting_titles") for q in keys]
    if all(t is None for t in titles):
        why = ("questions.jsonl records no supporting titles: the study's rows predate the gold_passages row (a "
               "fresh study scores it)")
    elif not all(titles):
        why = (f"{sum(not t for t in titles)} of {len(titles)} held-out questions carry no supporting titles (the "
               "data gives none), and the row needs every one")
    else:
        why = "the gold_passages rows were not scored in this study folder (a fresh study scores them)"
    return {"why_absent": why, "settings": {}}


# ----------------------------------------------------------------------------- report.md and report.png
def _f(x: Any, fmt: str = "+.4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _ci(ci: Any, fmt: str = "+.4f") -> str:
    return "-" if not ci else f"[{_f(ci[0], fmt)}, {_f(ci[1], fmt)}]"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def model_name(settings: dict[str, Any]) -> str:
    """The model as a person names it: a GGUF file's stem, else the last part of the name or path."""
    gguf = settings.get("gguf_file")
    return Path(gguf).name.removesuffix(".gguf") if gguf else Path(str(settings.get("model", "?"))).name


def paper_table(s: dict[str, Any]) -> list[str]:
    """Rows = methods, columns = datasets x subtasks and each dataset's total; F1 in %, the best bold."""
    cols = [(d, f"{d}/{sub}", sub) for d, info in s["datasets"].items() for sub in info["subtasks"]
            if len(info["subtasks"]) > 1] + [(d, None, "total") for d in s["datasets"]]
    cols.sort(key=lambda c: (list(s["datasets"]).index(c[0]), c[1] is None))
    rows = [n for n in TABLE_ROWS if n in s["methods"]]

    def f1(n: str, c: tuple[str, str | None, str]) -> Any:
        m = s["methods"][n]
        return (m["by_subtask"].get(c[1]) or {}).get("f1") if c[1] else m["by_dataset"][c[0]]["f1"]

    def n_of(c: tuple[str, str | None, str]) -> int:
        m = s["methods"][rows[0]]
        return m["by_subtask"][c[1]]["n"] if c[1] else m["by_dataset"][c[0]]["n"]

    best = {c: max((_pct(f1(n, c)) for n in rows if f1(n, c) is not None), key=float, default=None) for c in cols}
    lines = ["| method | " + " | ".join(f"{d} {sub}" for d, _, sub in cols) + " |",
             "|---|" + "---|" * len(cols), "| n | " + " | ".join(str(n_of(c)) for c in cols) + " |"]
    for n in rows:  # the best as shown (rounded): rows that print the same figure are bold alike
        cells = [f"**{_pct(f1(n, c))}**" if _pct(f1(n, c)) == best[c] else _pct(f1(n, c)) for c in cols]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def next_command(s: dict[str, Any]) -> tuple[str, str]:
    """``(sentence, command)``: the one command that runs what to run (or, without F1, what ships)."""
    v, st = s["verdict"], s["settings"]
    out = Path(str(st.get("out", "OUT")))
    w = v["what_to_run"]
    ships = [k for k, sv in v["settings"].items() if sv["ship"] != "prag_sum"]
    row = w["row"] if w else ("recommended" + suffix(ships[0]) if ships else "prag_sum")
    prag = "fcprag run prag{} -- src/inference.py ARGS... --inference_method {}"
    if row.startswith("recommended"):
        setting = "param" if row == "recommended" else "combine"
        if st.get("controller_trained", True) and v["settings"][setting]["ship"] == "prag_sum":
            row = "prag_sum" + suffix(setting)  # what ships there is PRAG's sum itself
        else:
            where = out / ("controller" + suffix(setting)) if st.get("controller_trained", True) else \
                st.get("controller")
            method = "prag" if setting == "param" else "combine"
            return (f"Run PRAG through the shim with the controller that ships ({where}):",
                    prag.format(f" --controller {where} --log fusion.jsonl", method))
    if row in ("prag_sum", "prag_sum_combine"):
        method = "prag" if row == "prag_sum" else "combine"
        return (f"Leave PRAG as it is ({'its parametric' if method == 'prag' else 'its Combine'} setting; through "
                "the shim with no controller it runs unchanged):", prag.format("", method))
    if row == "standard_rag":
        return "Run PRAG's standard-RAG setting (the passages in the prompt, no adapter):", prag.format("", "icl")
    return ("No retrieval scores highest here, and PRAG has no setting without passages: before dropping retrieval, "
            "measure it on more questions (the same study, a larger file):",
            f"fcprag study QUESTIONS... --out {out}-more --test-fraction 0.5")


def next_steps(s: dict[str, Any]) -> list[str]:
    """One runnable command, consistent with what to run."""
    sentence, command = next_command(s)
    return ["## Next step", "", sentence, "", "```bash", command, "```", ""]


def verdict_table(s: dict[str, Any]) -> list[str]:
    """What ships per setting: decided on the training questions, then checked on the held-out ones."""
    lines = ["## What ships in each setting", "",
             "| setting | ship | kappa | decided on | training CV: reweighting / scale gain (95% CI) | held out: "
             "scale part | held out: reweighting part | held out: controller vs PRAG's sum | why |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, sv in s["verdict"]["settings"].items():
        cvs = " / ".join(f"{_f(p['gain'], '+.2g')} {_ci(p['ci95'], '+.2g')}" if p else "-"
                         for p in (sv["cv"]["reweighting"], sv["cv"]["scale"]))
        cells = []
        for k in ("scale", "reweighting", "total"):
            p = sv[k]
            if not p["measured"]:
                cells.append(f"not measured: {p.get('why', '-')}")
                continue
            to = "PRAG's sum" if p["rows"][1].startswith("prag_sum") else p["rows"][1]
            eq = f"; equivalent to {to} within ±{p['margin']:g}" if p["equivalent"] else ""
            cells.append(f"{' vs '.join(p['rows'])} {_f(p['delta'])} {_ci(p['ci95'])}{eq}")
        lines.append(f"| {name} | {sv['ship']} | {sv['kappa']:g} | {sv['decided_on']} | {cvs} | "
                     + " | ".join(cells) + f" | {sv['why']} |")
    m = s["policy"]
    if not s["settings"].get("controller_trained", True):
        return lines + ["", "A given controller is measured here, not decided on: it ships as it is.", ""]
    lines += ["", f"A network ships only when its reweighting gain's lower bound lies above +{m['min_gain']:g} gold "
              f"log-lik. per question, a scale only above +{m['min_scale_gain']:g} (`--min-gain`); the held-out "
              "parts measure what was decided, they decide nothing.", ""]
    return lines


def ceiling_lines(s: dict[str, Any]) -> list[str]:
    """How much of the gold-passage ceiling the learned controller reaches, or why there is none."""
    c = s.get("ceiling") or {}
    lines = ["## Ceiling: the supporting passages alone", ""]
    if c.get("why_absent"):
        return lines + [f"No `gold_passages` row: {c['why_absent']}.", ""]
    for name, r in c["settings"].items():
        f1 = _f(r["gold_f1"] and 100 * r["gold_f1"], "+.1f")
        gain = f"{_f(r['gold'])} gold log-lik. ({f1} F1) against PRAG's sum"
        if r["learned"] is None:
            reach = "no network was measured in this setting"
        elif r["share"] is None:
            reach = f"it does not lie above PRAG's sum, so there is nothing to reach (the network: {_f(r['learned'])})"
        elif r["learned"] <= 0:
            reach = f"the learned controller reaches none of it (it does not beat PRAG's sum: {_f(r['learned'])})"
        else:
            reach = f"the learned controller reaches {100 * r['share']:.1f}% of it ({_f(r['learned'])})"
        lines.append(f"- {name}: PRAG's total spread over the supporting passages: {gain}; {reach}.")
    return lines + ["", "`gold_passages` reads the data's supporting titles (a reference, not a method).", ""]


def report(s: dict[str, Any], plot: str | None = None) -> str:
    """``report.md``: the paper's table, what to run, what ships in each setting, then every row."""
    st, v = s["settings"], s["verdict"]
    datasets = ", ".join(f"{d} ({info['n_test']})" for d, info in s["datasets"].items())
    lines = [f"# Study: {model_name(st)} on {', '.join(s['datasets'])}", "",
             f"{s['n_train']} training and {s['n_test']} held-out questions ({datasets}); device {st['device']}, "
             f"dtype {st['dtype']}; controller {'given' if not st.get('controller_trained') else 'trained here'}. "
             f"Split: {s['split']['method']}; held out per dataset/subtask: "
             + ", ".join(f"{k} {c['test']} of {c['n']}" for k, c in s["split"]["strata"].items())
             + ".", ""]
    if st.get("generate") is False:
        lines += ["> **Run with --no-generate**: no greedy answers, so no F1/EM table, no plot and no \"what to "
                  "run\"; the verdict rests on the gold log-lik. alone.", ""]
    if s["n_test"] < SMALL_TEST:
        lines += [f"> **Too few held-out questions for the intervals to mean much** ({s['n_test']}): give about "
                  f"{SMALL_TEST} or more held-out questions.", ""]
    lines += ["## F1 (%) on the held-out questions", ""] + paper_table(s) + [
        "", "vanilla: the question alone, no adapter; standard_rag: the retrieved passages in the prompt, no adapter; "
        "prag_sum: PRAG's sum of the passage adapters; recommended: what this study ships; random_controller: an "
        "untrained controller at the same kappa (the paper's ablation); `_combine`: the passages in the prompt as "
        "well as the adapter.", ""]
    if plot:
        lines += [f"![F1 per row and dataset]({plot})", ""]
    else:
        lines += ["(The plot needs matplotlib: `pip install matplotlib`, or the project's `plot` extra; then run the "
                  "same command again.)", ""]
    lines += ["## What to run", ""]
    w = v["what_to_run"]
    if w is None:
        lines += ["Not decided: it needs greedy answers (F1) of every candidate row (run without --no-generate).", ""]
    else:
        how = ("chosen on the held-out questions themselves (nothing was trained: descriptive, not a test)"
               if w["chosen_on"] != "training" else "chosen by training-question F1, its advantage measured on the "
               "held-out questions")
        lines += [f"**{w['plain']}.**", ""] + [f"- {c['plain']}." for c in v["what_to_run_by_dataset"].values()] + \
            ["", f"Candidates: {', '.join(w['choice_f1'])}; {how}. A tie is said as one; \"equivalent\": the "
             f"interval lies inside ±{100 * w['target_f1']:g} F1 (the target effect); the power figures are at "
             f"each interval's level and {100 * w['power']:g}% power, from the observed SD of the paired "
             "differences.", ""]
    lines += next_steps(s) + verdict_table(s) + ceiling_lines(s)
    lines += ["", "## Every row", "", "| method | gold log-lik. | F1 | EM | acc | against | delta log-lik. [95% CI] | "
              "delta F1 [95% CI] | F1 MDE (95%, 80% power) |", "|---|---|---|---|---|---|---|---|---|"]
    for n, m in s["methods"].items():
        p = s["paired"].get(n, {})
        lines.append(f"| {n} | {_f(m['logprob'], '.4f')} | {_f(m['f1'], '.3f')} | {_f(m['em'], '.3f')} | "
                     f"{_f(m['acc'], '.3f')} | {p.get('against', '-')} | {_f(p.get('delta_logprob'))} "
                     f"{_ci(p.get('ci95_logprob'))} | {_f(p.get('delta_f1'))} {_ci(p.get('ci95_f1'))} | "
                     f"{_f(p.get('mde_f1') and 100 * p['mde_f1'], '.1f')} |")
    notes = ["Deltas are paired against PRAG's sum of the row's setting over the held-out questions (percentile "
             "bootstrap, 2,000 resamples)."]
    notes += [text for row, text in (("oracle", "`oracle` reads the answer (a reference, not a method)."),
                                     ("average", "`average` is 1/N."),
                                     ("arrow", "`arrow` is PEFT's Arrow routing over the same adapters (per token and layer the top 3 adapters by "
                                               "|x . prototype|; tested equal to PEFT's create_arrow_model)."))
              if row in s["methods"]]
    if st.get("arrow") not in ("scored", "off", None):
        notes.append(f"No Arrow row: {st['arrow']}.")
    lines += ["", " ".join(notes), ""]
    tv = s.get("training_verdict")
    if tv:
        lines += ["The trainer's own verdicts (its cross-validation against 0, not against the margin): "
                  + "; ".join(f"{k} {t.get('verdict', '-')}" for k, t in tv.items()), ""]
    lines += ["Stage times of this invocation (s): " + ", ".join(f"{k} {x}" for k, x in s["stage_seconds"].items()),
              ""]
    return "\n".join(lines)


def write_plot(s: dict[str, Any], path: Path) -> str | None:
    """``report.png``: F1 (%) per table row with its 95% CI, one group per dataset; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [n for n in TABLE_ROWS if n in s["methods"]]
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
    ax.set_ylabel("F1 (%), held-out, 95% CI")
    ax.set_title(f"{model_name(s['settings'])}: what each row answers")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# ----------------------------------------------------------------------------- the schema check
def _num(x: Any, null_ok: bool = False) -> bool:
    return (x is None and null_ok) or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))


def _interval(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(_num(v) for v in x) and x[0] <= x[1]


def check_setting(sname: str, sv: Any, trained: bool) -> list[str]:
    """The problems of one verdict ``sv`` (named ``sname``); ``trained``: what ships was decided here, so it must
    agree with the cross-validated gains and margins it records."""
    num, ci = _num, _interval
    if not isinstance(sv, dict) or sv.get("ship") not in STUDY_SHIPS:
        return [f"{sname}.ship: expected one of {list(STUDY_SHIPS)}"]
    bad = [] if num(sv.get("kappa")) and sv["kappa"] > 0 else [f"{sname}.kappa: expected a number > 0"]
    for k in ("scale", "reweighting"):
        p = sv.get(k)
        if not isinstance(p, dict) or not isinstance(p.get("measured"), bool) or "delta" not in p or "ci95" not in p:
            bad.append(f"{sname}.{k}: expected delta, ci95 and measured")
        elif p["measured"] and (not num(p["delta"]) or not ci(p["ci95"])):
            bad.append(f"{sname}.{k}: measured, so delta must be a number and ci95 [lo, hi]")
        elif not p["measured"] and p["delta"] is not None:
            bad.append(f"{sname}.{k}: not measured, so delta must be null")
    margins, cvs = sv.get("margins"), sv.get("cv")
    if not isinstance(sv.get("decided_on"), str) or not isinstance(margins, dict) or not all(
            num(margins.get(k)) for k in ("reweighting", "scale")) or not isinstance(cvs, dict):
        return bad + [f"{sname}: expected decided_on, margins {{reweighting, scale}} and cv"]
    for k, ship in (("reweighting", "network"), ("scale", "scale_only")):
        p = cvs.get(k)
        if trained and sv["ship"] == ship and not (isinstance(p, dict) and ci(p.get("ci95"))
                                                   and p["ci95"][0] > margins[k]):
            bad.append(f"{sname}.ship is '{ship}' but the cross-validated {k} gain's lower bound does not lie "
                       "above its margin")
    return bad


def check_summary(s: Any) -> list[str]:
    """Every field ``summary.json`` must have; returns the problems (empty: complete)."""
    bad: list[str] = []
    num, ci = _num, _interval

    if not isinstance(s, dict):
        return ["summary is not a JSON object"]
    for k in ("n_train", "n_test"):
        if not (isinstance(s.get(k), int) and s[k] >= 0):
            bad.append(f"{k}: expected an integer >= 0")
    st = s.get("settings")
    if not isinstance(st, dict) or not all(isinstance(st.get(k), str) for k in ("model", "device", "dtype")):
        bad.append("settings: expected model, device and dtype (strings)")
    methods, pairs, v = s.get("methods"), s.get("paired"), s.get("verdict")
    if not isinstance(methods, dict):
        return bad + ["methods: expected an object"]
    if not isinstance(v, dict):
        return bad + ["verdict: expected an object"]
    need = [*TABLE_ROWS, "prag_sum"]
    for sname, sv in (v.get("settings") or {}).items():
        if isinstance(sv, dict) and (sv.get("reweighting") or {}).get("measured"):
            need += [f"learned{suffix(sname)}", f"learned_same_total{suffix(sname)}"]
    bad += [f"methods: '{n}' missing" for n in dict.fromkeys(need) if n not in methods]
    for n, m in methods.items():
        if not isinstance(m, dict) or not num(m.get("logprob")) or \
                not all(k in m and num(m[k], null_ok=True) for k in METRICS[1:]):
            bad.append(f"methods['{n}']: expected logprob (a number), f1, em, acc (numbers or null)")
        elif not isinstance(m.get("by_subtask"), dict) or not m["by_subtask"] or not all(
                re.fullmatch(r"[^/]+/.+", k) and isinstance(b, dict) and num(b.get("f1"), True) and num(b.get("em"), True)
                and isinstance(b.get("n"), int) for k, b in m["by_subtask"].items()):
            bad.append(f"methods['{n}'].by_subtask: expected {{'<dataset>/<subtask>': {{f1, em, n}}}}")
    if not isinstance(pairs, dict):
        return bad + ["paired: expected an object"]
    for n in methods:
        if n == host_of(n):
            continue
        p = pairs.get(n)
        if not isinstance(p, dict) or not num(p.get("delta_logprob")) or not ci(p.get("ci95_logprob")) \
                or "delta_f1" not in p or "ci95_f1" not in p:
            bad.append(f"paired['{n}']: expected delta_logprob, ci95_logprob [lo, hi], delta_f1, ci95_f1")
    settings = v.get("settings")
    if not isinstance(settings, dict) or set(settings) != set(SETTINGS):
        return bad + [f"verdict.settings: expected one verdict per setting {list(SETTINGS)}"]
    trained = (st or {}).get("controller_trained", True)
    for sname, sv in [("verdict", v)] + [(f"verdict.settings.{k}", x) for k, x in settings.items()]:
        bad += check_setting(sname, sv, trained)
    w = v.get("what_to_run")
    if w is not None and (not isinstance(w, dict) or w.get("row") not in CANDIDATES or not num(w.get("f1"))
                          or not num(w.get("target_f1"))
                          or not all(ci((w.get(k) or {}).get("ci_f1")) and (w.get(k) or {}).get("reading")
                                     in READINGS for k in ("vs_standard_rag", "vs_host"))):
        bad.append(f"verdict.what_to_run: expected a row of {list(CANDIDATES)} with f1, target_f1 and vs_standard_rag"
                   " / vs_host intervals and readings")
    by = v.get("what_to_run_by_dataset")
    if w is not None and (not isinstance(by, dict) or set(by) != set(s.get("datasets") or {})):
        bad.append("verdict.what_to_run_by_dataset: expected one choice per dataset")
    return bad
