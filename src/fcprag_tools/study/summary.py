"""The study's result: ``summary.json`` (fields checked by :func:`check_summary`), ``report.md`` and
``controller/`` (what it recommends).

The verdict rests on held-out measurements only (real forwards on the test questions):

- ``scale``: PRAG's sum times the controller's ``kappa`` (``scale:<kappa>``; for a given controller that
  reweights, its same-total twin) against ``prag_sum``;
- ``reweighting``: the learned network against its same-total twin (every passage at the mean of its ``w~``).

``ship``: ``network`` only when the reweighting's 95% CI lies above 0 (and the network beats ``prag_sum`` on
average), else ``scale_only`` when the scale part's CI lies above 0, else ``prag_sum``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fcprag_plugin.fileio import write_atomic, write_json
from fcprag_plugin.training.stats import Z95
from .stats import paired

METRICS = ("logprob", "f1", "em", "acc")
REQUIRED_METHODS = ("prag_sum", "recommended")
SHIPS = ("prag_sum", "scale_only", "network")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def table(results: dict[str, dict[str, Any]], qids: list[str], names: list[str]) -> tuple[list[str], dict[str, Any],
                                                                                           dict[str, Any]]:
    """``(questions used, methods, paired)`` over the questions that have every method."""
    keys = [q for q in qids if all(f"{q}|{n}" in results for n in names)]
    methods = {n: {m: _mean([float(results[f"{q}|{n}"][m]) for q in keys if m in results[f"{q}|{n}"]])
                   for m in METRICS} for n in names}
    pairs: dict[str, Any] = {}
    for n in names:
        if n == "prag_sum":
            continue
        pairs[n] = {"against": "prag_sum"}
        for m in METRICS:
            diffs = [float(results[f"{q}|{n}"][m]) - float(results[f"{q}|prag_sum"][m]) for q in keys
                     if m in results[f"{q}|{n}"] and m in results[f"{q}|prag_sum"]]
            d, ci = paired(diffs, m) if diffs else (None, None)  # one resampling per metric for every row
            pairs[n][f"delta_{m}"], pairs[n][f"ci95_{m}"] = d, ci
    return keys, methods, pairs


def part(results: dict[str, dict[str, Any]], keys: list[str], a: str, b: str) -> dict[str, Any]:
    """``a`` against ``b`` in gold log-lik. over ``keys``: ``{"delta", "ci95", "measured", "rows"}``."""
    if a == b:
        return {"delta": 0.0, "ci95": [0.0, 0.0], "measured": True, "rows": [a, b]}
    d, ci = paired([results[f"{q}|{a}"]["logprob"] - results[f"{q}|{b}"]["logprob"] for q in keys], "logprob")
    return {"delta": d, "ci95": ci, "measured": True, "rows": [a, b]}


def decide(scale: dict[str, Any], reweighting: dict[str, Any], learned_delta: float | None) -> tuple[str, str]:
    """``(ship, why)`` from the measured parts."""
    def ci(p: dict[str, Any]) -> str:
        return f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}]"

    if reweighting["measured"] and reweighting["ci95"][0] > 0 and (learned_delta or 0) > 0:
        return "network", (f"the network beats its same-total twin on held-out questions: reweighting "
                           f"{reweighting['delta']:+.4f} {ci(reweighting)}")
    rw = ("the reweighting is not measured (no network)" if not reweighting["measured"] else
          f"the reweighting's CI {ci(reweighting)} does not lie above 0")
    if scale["ci95"][0] > 0:
        return "scale_only", f"{rw}; scaling PRAG's sum by kappa helps: {scale['delta']:+.4f} {ci(scale)}"
    return "prag_sum", f"{rw}; the scale part's CI {ci(scale)} does not lie above 0"


def rule_starved(args: dict[str, Any], n_train: int) -> int | None:
    """The training questions the risk rule in trainer ``args`` needs before it can allow any scale, when
    ``n_train`` is fewer (else None). The rule applies with kappa "auto" and the share's upper bound; at zero losses
    the 95% Wilson upper bound of the loss share, ``z^2 / (n + z^2)``, exceeds the share below the need (35 at 0.1)."""
    share = args.get("scale_max_loss_share")
    if args.get("kappa") != "auto" or args.get("scale_bound") != "upper" or not share or not 0 < share < 1:
        return None
    need = math.ceil(Z95 ** 2 * (1 - share) / share)
    return need if n_train < need else None


def finish(study: Any, qs: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]], ctrl: Any,
           learned_dir: Path, kappa: float, settings: dict[str, Any]) -> dict[str, Any]:
    """Compare, decide, write ``controller/``, the ``recommended`` rows, ``summary.json`` and ``report.md``."""
    from fcprag_plugin import FusionController
    from fcprag_tools.options import write_dir_atomically

    test = [q for q, r in qs.items() if r["split"] == "test"]
    given = study.o.controller is not None
    names = [n for n in study.methods(qs[test[0]], ctrl, kappa) if not n.startswith("loo:")] + ["oracle"]
    if all(f"{q}|arrow" in results for q in test):
        names.append("arrow")
    keys, _, _ = table(results, test, names)
    learned = "learned" in names
    sname = f"scale:{kappa:g}" if kappa != 1.0 else "prag_sum"
    scale = part(results, keys, "learned_same_total" if (given and learned) else sname, "prag_sum")
    reweighting = part(results, keys, "learned", "learned_same_total") if learned else \
        {"delta": None, "ci95": None, "measured": False, "rows": []}
    learned_delta = part(results, keys, "learned", "prag_sum")["delta"] if learned else None
    ship, why = decide(scale, reweighting, learned_delta)
    n_train = sum(r["split"] == "train" for r in qs.values())
    cfg = ctrl.config
    args_file = Path(learned_dir) / "training_args.json"  # the risk rule the trainer applied, as it recorded it
    targs = {} if given or not args_file.is_file() else json.loads(args_file.read_text(encoding="utf-8"))
    need = rule_starved(targs, n_train) if kappa == 1.0 else None
    if need:
        why += (f"; with {n_train} training questions the risk rule cannot allow any scale (the 95% upper bound of "
                f"the loss share stays above {targs['scale_max_loss_share']:g} even if no question loses): it needs "
                f"about {need}")
    shipped = {"network": lambda: ctrl,
               "scale_only": lambda: FusionController.scale_only(kappa, embed_dim=cfg.embed_dim,
                                                                 embedding_model=cfg.embedding_model),
               "prag_sum": lambda: FusionController.uniform(cfg.embed_dim, cfg.embedding_model)}[ship]()
    if ship != "network":  # the best scale belongs to the adapter recipe too: its check warns on other adapters
        shipped.config.trained_for = cfg.trained_for
    train_ids = sorted(q for q, r in qs.items() if r["split"] == "train")

    def save(tmp: Path) -> None:
        shipped.save_pretrained(tmp)
        if train_ids:  # `fcprag study --controller` leaves these out of what it evaluates
            write_json(tmp / "train_question_ids.json", {"ids": train_ids})

    write_dir_atomically(study.out / "controller", save)
    # the recommended row: the given controller, or what the study ships; its weights equal a scored row's
    rec_row = ("learned" if learned else sname) if given else {"network": "learned", "scale_only": sname,
                                                               "prag_sum": "prag_sum"}[ship]
    rec_ctrl = FusionController.from_pretrained(Path(study.o.controller) if given else study.out / "controller").eval()
    for q in test:
        w = study.methods(qs[q], rec_ctrl, float(rec_ctrl.config.kappa)).get("learned") \
            or [float(rec_ctrl.config.kappa)] * len(qs[q]["passages"])
        src = results.get(f"{q}|{rec_row}")
        if src is None or any(abs(a - b) > 1e-5 for a, b in zip(src["w"], w)):
            raise RuntimeError(f"question {q}: the recommended controller's weights {w} are not row {rec_row}'s")
        results[f"{q}|recommended"] = {**src, "id": f"{q}|recommended"}
    names.insert(1, "recommended")
    keys, methods, pairs = table(results, test, names)
    study.load_model()  # (a resumed run with nothing left to score has not loaded it) for its device and dtype
    out = {
        "n_train": n_train, "n_test": len(keys),
        "settings": {**settings, "device": study.device,
                     "dtype": str(next(study.model.parameters()).dtype).removeprefix("torch."),
                     "arrow": "scored" if "arrow" in names else getattr(study, "arrow_why", None) or "off",
                     "controller_trained": not given, "learned_dir": str(learned_dir)},
        "methods": methods, "paired": pairs,
        "verdict": {"ship": ship, "kappa": kappa if ship != "prag_sum" else 1.0, "kappa_learned": kappa,
                    "scale": scale, "reweighting": reweighting, "why": why,
                    "recommended_row": rec_row},
        "training_verdict": {"note": "first order, from the training labels (fcprag train's cross-validation); "
                                     "not a measurement, shown for comparison", **(cfg.cv or {})} if cfg.cv else None,
        "stage_seconds": {k: round(v, 1) for k, v in study.times.items()},
    }
    problems = check_summary(out)
    if problems:
        raise RuntimeError(f"summary.json would be incomplete: {problems}")
    write_json(study.out / "summary.json", out)
    write_atomic(study.out / "report.md", report(out))
    return out


def _f(x: Any, fmt: str = "+.4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _ci(ci: Any) -> str:
    return "-" if not ci else f"[{_f(ci[0])}, {_f(ci[1])}]"


def report(s: dict[str, Any]) -> str:
    """``report.md``: what to ship and why, then the tables."""
    v = s["verdict"]
    what = {"network": "the learned network (its per-passage reweighting measurably helps)",
            "scale_only": f"PRAG's sum times kappa = {v['kappa']:g} (a scale-only controller; no network)",
            "prag_sum": "PRAG's sum as it is (no learned part measurably helps)"}[v["ship"]]
    lines = [f"# Study: {Path(s['settings']['questions']).name} on {s['settings']['model']}", "",
             f"{s['n_train']} training and {s['n_test']} held-out questions; device {s['settings']['device']}, "
             f"dtype {s['settings']['dtype']}.", "", f"**Ship: {v['ship']}**: {what}. Why: {v['why']}.", "",
             "`controller/` holds it (loadable by `fuse()`, `fcprag fuse` and both shims).", "",
             "| part (held-out, real forwards) | rows | delta gold log-lik. | 95% CI |", "|---|---|---|---|"]
    for k in ("scale", "reweighting"):
        p = v[k]
        lines.append(f"| {k} | {' vs '.join(p['rows']) or '-'} | {_f(p['delta'])} | {_ci(p['ci95'])} |")
    lines += ["", "| method | gold log-lik. | F1 | EM | acc | delta log-lik. [95% CI] | delta F1 [95% CI] |",
              "|---|---|---|---|---|---|---|"]
    for n, m in s["methods"].items():
        p = s["paired"].get(n, {})
        lines.append(f"| {n} | {_f(m['logprob'], '.4f')} | {_f(m['f1'], '.3f')} | {_f(m['em'], '.3f')} | "
                     f"{_f(m['acc'], '.3f')} | {_f(p.get('delta_logprob'))} {_ci(p.get('ci95_logprob'))} | "
                     f"{_f(p.get('delta_f1'))} {_ci(p.get('ci95_f1'))} |")
    lines += ["", "Deltas are paired against `prag_sum` over the held-out questions (percentile bootstrap, 2,000 "
              "resamples). `oracle` reads the answer (a reference, not a method); `average` is 1/N; `arrow` is "
              "PEFT's Arrow router over the same adapters.", ""]
    tv = s.get("training_verdict")
    if tv:
        lines += [f"The trainer's own verdict (first order, training labels, not a measurement): "
                  f"{tv.get('verdict', '-')}", ""]
    lines += ["Stage times (s): " + ", ".join(f"{k} {v}" for k, v in s.get("stage_seconds", {}).items()), ""]
    return "\n".join(lines)


def check_summary(s: Any) -> list[str]:
    """Every field ``summary.json`` must have (issue 35); returns the problems (empty: complete)."""
    bad: list[str] = []

    def num(x: Any, null_ok: bool = False) -> bool:
        return (x is None and null_ok) or (isinstance(x, (int, float)) and not isinstance(x, bool)
                                           and math.isfinite(x))

    def ci(x: Any) -> bool:
        return isinstance(x, list) and len(x) == 2 and all(num(v) for v in x) and x[0] <= x[1]

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
    need = list(REQUIRED_METHODS) + [n for n in ("learned", "learned_same_total")
                                     if isinstance(v, dict) and (v.get("reweighting") or {}).get("measured")]
    need += [] if any(n.startswith("scale:") for n in methods) else ["scale:<s>"]
    bad += [f"methods: '{n}' missing" for n in need if n not in methods]
    for n, m in methods.items():
        if not isinstance(m, dict) or not num(m.get("logprob")) or \
                not all(k in m and num(m[k], null_ok=True) for k in METRICS[1:]):
            bad.append(f"methods['{n}']: expected logprob (a number), f1, em, acc (numbers or null)")
    if not isinstance(pairs, dict):
        return bad + ["paired: expected an object"]
    for n in methods:
        if n == "prag_sum":
            continue
        p = pairs.get(n)
        if not isinstance(p, dict) or not num(p.get("delta_logprob")) or not ci(p.get("ci95_logprob")) \
                or "delta_f1" not in p or "ci95_f1" not in p:
            bad.append(f"paired['{n}']: expected delta_logprob, ci95_logprob [lo, hi], delta_f1, ci95_f1")
    if not isinstance(v, dict):
        return bad + ["verdict: expected an object"]
    if v.get("ship") not in SHIPS:
        bad.append(f"verdict.ship: expected one of {list(SHIPS)}")
    if not num(v.get("kappa")) or v["kappa"] <= 0:
        bad.append("verdict.kappa: expected a number > 0")
    for k in ("scale", "reweighting"):
        p = v.get(k)
        if not isinstance(p, dict) or not isinstance(p.get("measured"), bool) or "delta" not in p or "ci95" not in p:
            bad.append(f"verdict.{k}: expected delta, ci95 and measured")
        elif p["measured"] and (not num(p["delta"]) or not ci(p["ci95"])):
            bad.append(f"verdict.{k}: measured, so delta must be a number and ci95 [lo, hi]")
    if not bad:  # what ships agrees with the measured held-out parts
        rw, sc = v["reweighting"], v["scale"]
        if v["ship"] == "network" and not (rw["measured"] and rw["ci95"][0] > 0):
            bad.append("verdict.ship is 'network' but the measured reweighting's CI does not lie above 0")
        if v["ship"] == "scale_only" and not (sc["measured"] and sc["ci95"][0] > 0):
            bad.append("verdict.ship is 'scale_only' but the measured scale part's CI does not lie above 0")
    return bad
