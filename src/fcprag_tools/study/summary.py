"""The study's result, a function of the scored rows and the verdicts it is given: ``summary.json`` (fields
checked by :func:`check_summary`), ``report.md`` (every figure read from the summary) and ``report.png``.

Two settings, each with its own controller: ``param`` (PRAG's prompt, the question only) and ``combine`` (the
passages in the prompt too, the paper's "Combine"); a row's Combine twin carries the suffix ``_combine``. Per
setting the verdict rests on held-out measurements only (real forwards on the test questions):

- ``scale``: PRAG's sum times the controller's ``kappa`` (for a given controller that reweights, its same-total
  twin) against PRAG's sum of that setting; not measured when kappa is 1;
- ``reweighting``: the learned network against its same-total twin (every passage at the mean of its ``w~``).

``ship``: ``network`` only when the reweighting's 95% CI lies above 0 (and the network beats PRAG's sum on
average), else ``scale_only`` when the scale part's CI lies above 0, else ``prag_sum``.

"What to run" (``verdict.what_to_run``, ``verdict.what_to_run_by_dataset``): among :data:`CANDIDATES`, the row
with the highest mean F1 on the training questions (ties: the earlier, the cheaper), overall and per dataset; its
F1 against ``standard_rag`` and against the host's own row of its setting on the held-out questions, paired
percentile-bootstrap intervals Bonferroni-corrected over every interval of the choice. With a given controller
nothing is trained: the choice is made on the evaluated questions themselves and says so (descriptive).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any, Sequence

from fcprag_plugin.fileio import write_atomic, write_json
from fcprag_plugin.training import SHIPS, Z95
from .stats import paired

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
SMALL_TEST = 30  # fewer held-out questions: the report warns that its intervals mean little


def suffix(setting: str) -> str:
    """A row's or file's name suffix for ``setting``: none for ``param`` (PRAG's), ``_combine``."""
    return "" if setting == "param" else f"_{setting}"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------- the verdict of one setting
def part(results: dict[str, dict[str, Any]], keys: list[str], a: str, b: str) -> dict[str, Any]:
    """``a`` against ``b`` in gold log-lik. over ``keys``: ``{"delta", "ci95", "measured", "rows"}``."""
    d, ci = paired([results[f"{q}|{a}"]["logprob"] - results[f"{q}|{b}"]["logprob"] for q in keys], "logprob")
    return {"delta": d, "ci95": ci, "measured": True, "rows": [a, b]}


def not_measured(why: str) -> dict[str, Any]:
    return {"delta": None, "ci95": None, "measured": False, "rows": [], "why": why}


def decide(scale: dict[str, Any], reweighting: dict[str, Any], learned_delta: float | None) -> tuple[str, str]:
    """``(ship, why)`` from the measured parts."""
    def ci(p: dict[str, Any]) -> str:
        return f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}]"

    if reweighting["measured"] and reweighting["ci95"][0] > 0 and (learned_delta or 0) > 0:
        return "network", (f"the network beats its same-total twin on held-out questions: reweighting "
                           f"{reweighting['delta']:+.4f} {ci(reweighting)}")
    rw = ("the reweighting is not measured (no network)" if not reweighting["measured"] else
          f"the reweighting's CI {ci(reweighting)} does not lie above 0")
    if not scale["measured"]:
        return "prag_sum", f"{rw}; {scale['why']}"
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


def complete_keys(results: dict[str, dict[str, Any]], qids: Sequence[str], names: Sequence[str]) -> list[str]:
    """The questions of ``qids`` that have every row of ``names``."""
    return [q for q in qids if all(f"{q}|{n}" in results for n in names)]


def setting_verdict(results: dict[str, dict[str, Any]], test: Sequence[str], setting: str, ctrl: Any, *,
                    given: bool, trainer_args: dict[str, Any] | None, n_train: int) -> dict[str, Any]:
    """What ships in ``setting`` from its held-out parts, and the row that measures it (``recommended_row``)."""
    sfx, kappa = suffix(setting), float(ctrl.config.kappa)
    learned = all(f"{q}|learned{sfx}" in results for q in test)
    sname = f"scale:{kappa:g}{sfx}" if kappa != 1.0 else f"prag_sum{sfx}"
    names = [f"prag_sum{sfx}", sname] + ([f"learned{sfx}", f"learned_same_total{sfx}"] if learned else [])
    keys = complete_keys(results, test, names)
    if given and learned:
        scale = part(results, keys, f"learned_same_total{sfx}", f"prag_sum{sfx}")
    elif kappa != 1.0:
        scale = part(results, keys, sname, f"prag_sum{sfx}")
    else:
        scale = not_measured("kappa is 1 (PRAG's sum): no scale to measure")
    reweighting = part(results, keys, f"learned{sfx}", f"learned_same_total{sfx}") if learned else \
        not_measured("no network")
    learned_delta = part(results, keys, f"learned{sfx}", f"prag_sum{sfx}")["delta"] if learned else None
    ship, why = decide(scale, reweighting, learned_delta)
    need = rule_starved(trainer_args or {}, n_train) if kappa == 1.0 and not given else None
    if need:
        why += (f"; with {n_train} training questions the risk rule cannot allow any scale (the 95% upper bound of "
                f"the loss share stays above {trainer_args['scale_max_loss_share']:g} even if no question loses): "
                f"it needs about {need}")
    if given:  # the recommended row is the given controller itself
        rec = f"learned{sfx}" if learned else sname
    else:
        rec = {"network": f"learned{sfx}", "scale_only": sname, "prag_sum": f"prag_sum{sfx}"}[ship]
    return {"setting": setting, "ship": ship, "kappa": kappa if ship != "prag_sum" else 1.0, "kappa_learned": kappa,
            "scale": scale, "reweighting": reweighting, "why": why, "recommended_row": rec, "n": len(keys)}


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


def paired_table(results: dict[str, dict[str, Any]], keys: Sequence[str], names: Sequence[str]) -> dict[str, Any]:
    """Each row against the host's row of its setting (``against``), every metric, paired over ``keys``."""
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
    return pairs


# ----------------------------------------------------------------------------- what to run
def what_to_run(results: dict[str, dict[str, Any]], qs: dict[str, dict[str, Any]], test: Sequence[str],
                train: Sequence[str], *, descriptive: bool) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(overall, {dataset: choice})``: the candidate with the highest training F1 and its held-out advantage."""
    choose_on = list(test) if descriptive else list(train)
    if not choose_on or not all(results.get(f"{q}|{c}", {}).get("f1") is not None for q in choose_on
                                for c in CANDIDATES):
        return None, {}
    datasets = list(dict.fromkeys(qs[q]["dataset"] for q in test))
    scopes = [None] + datasets
    level = 1 - 0.05 / (2 * len(scopes))  # Bonferroni over every interval of the choice

    def one(dataset: str | None) -> dict[str, Any]:
        inside = lambda qids: [q for q in qids if dataset is None or qs[q]["dataset"] == dataset]  # noqa: E731
        cq, hq = inside(choose_on), inside(test)
        means = {c: _mean([float(results[f"{q}|{c}"]["f1"]) for q in cq]) for c in CANDIDATES}
        best = max(CANDIDATES, key=lambda c: (means[c], -CANDIDATES.index(c)))
        out: dict[str, Any] = {"row": best, "chosen_on": "held-out (descriptive)" if descriptive else "training",
                               "n_choice": len(cq), "choice_f1": means, "n": len(hq), "level": level,
                               "f1": _mean([float(results[f"{q}|{best}"]["f1"]) for q in hq])}
        for key, other in (("vs_standard_rag", "standard_rag"), ("vs_host", HOST_ROW[best])):
            d, ci = paired([float(results[f"{q}|{best}"]["f1"]) - float(results[f"{q}|{other}"]["f1"]) for q in hq],
                           f"what_to_run:{dataset}:{other}", level, WHAT_TO_RUN_BOOT) if best != other \
                else (0.0, [0.0, 0.0])
            out[key] = {"row": other, "delta_f1": d, "ci_f1": ci, "shown": best != other and ci[0] > 0}
        out["plain"] = plain(out, dataset)
        return out

    return one(None), {d: one(d) for d in datasets}


def plain(c: dict[str, Any], dataset: str | None) -> str:
    """The choice in one sentence a user acts on."""
    where = f"on {dataset}" if dataset else "overall"
    pct = lambda x: f"{100 * x:+.1f}"  # noqa: E731
    vs = []
    for k in ("vs_standard_rag", "vs_host"):
        v = c[k]
        if v["row"] == c["row"] or (k == "vs_host" and v["row"] == c["vs_standard_rag"]["row"]):
            continue
        vs.append(f"{pct(v['delta_f1'])} F1 [{pct(v['ci_f1'][0])}, {pct(v['ci_f1'][1])}] against {v['row']} "
                  f"({'shown' if v['shown'] else 'not shown: the interval reaches 0'})")
    lead = {"vanilla": "no retrieval at all (the question alone) answers best",
            "standard_rag": "standard RAG (the passages in the prompt, no adapter) answers best"}.get(
        c["row"], f"`{c['row']}` answers best")
    held = c["chosen_on"] == "training"  # else chosen and measured on the same questions: descriptive
    measured = "held out" if held else "on the same questions"
    n = f"{c['n']} held-out questions" if held else f"{c['n']} questions"
    return f"{where}: {lead}" + (f"; {measured}: {'; '.join(vs)}" if vs else "") + \
        f" ({n}, {100 * c['level']:.2f}% intervals{'' if held else '; chosen on them: descriptive, not a test'})"


# ----------------------------------------------------------------------------- the whole summary
def finish(qs: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]], verdicts: dict[str, dict[str, Any]],
           *, given: bool, settings: dict[str, Any], cv: dict[str, Any], stage_seconds: dict[str, float],
           out: Path, shared: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The ``recommended`` rows, ``summary.json``, ``report.md`` and ``report.png`` (when matplotlib is there).
    ``shared``: the rows scored once for another (``{row: {the row it shares: questions}}``)."""
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
    overall, by_dataset = what_to_run(results, qs, keys, train, descriptive=given)
    param = verdicts["param"]
    summary = {
        "n_train": len(train), "n_test": len(keys), "settings": settings,
        "datasets": {d: {"n_test": sum(qs[q]["dataset"] == d for q in keys),
                         "subtasks": sorted({qs[q]["subtask"] for q in keys if qs[q]["dataset"] == d})}
                     for d in dict.fromkeys(qs[q]["dataset"] for q in keys)},
        "methods": methods, "paired": paired_table(results, keys, names),
        "verdict": {**{k: param[k] for k in ("ship", "kappa", "kappa_learned", "scale", "reweighting", "why",
                                             "recommended_row")},
                    "settings": verdicts, "what_to_run": overall, "what_to_run_by_dataset": by_dataset},
        "training_verdict": {s: {"note": "first order, from the training labels (fcprag train's cross-validation); "
                                         "not a measurement, shown for comparison", **c} for s, c in cv.items() if c}
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


def next_steps(s: dict[str, Any]) -> list[str]:
    """The commands that use what the study recommends."""
    out = Path(str(s["settings"].get("out", "OUT")))
    v, w = s["verdict"], s["verdict"]["what_to_run"]
    lines = ["## Next step", ""]
    if w and w["row"] in ("vanilla", "standard_rag"):
        lines += [f"On these questions {'no retrieval' if w['row'] == 'vanilla' else 'standard RAG'} answers best "
                  "(chosen on the training questions): run that; no parametric row beat it here.", ""]
    ships = {k: sv for k, sv in v["settings"].items() if sv["ship"] != "prag_sum"}
    if not ships:
        lines += ["In neither setting did a fusion measurably beat PRAG's sum: run PRAG as it is (`controller/` and "
                  "`controller_combine/` hold PRAG's sum, kappa 1).", ""]
        return lines
    for k, sv in ships.items():
        where = out / ("controller" + suffix(k))
        prompt = "PRAG's prompt" if k == "param" else "the passages in the prompt as well (Combine)"
        lines.append(f"- {k}: `{where}` ships **{sv['ship']}** (kappa {sv['kappa']:g}), for {prompt}.")
    where = out / ("controller" + ("" if "param" in ships else "_combine"))
    lines += ["", "```bash", f"fcprag run prag --controller {where} --log fusion.jsonl -- src/inference.py ARGS...",
              f"fcprag fuse --controller {where} --adapter DIR ... --passage TEXT ... --query TEXT --out fused",
              "```", "", f"Or at the top of PRAG's `src/inference.py`: `from fcprag_plugin.hosts import prag; "
              f"prag.install(controller=\"{where}\")`.", ""]
    return lines


def report(s: dict[str, Any], plot: str | None = None) -> str:
    """``report.md``: the paper's table, what to run, what ships in each setting, then every row."""
    st, v = s["settings"], s["verdict"]
    datasets = ", ".join(f"{d} ({info['n_test']})" for d, info in s["datasets"].items())
    lines = [f"# Study: {model_name(st)} on {', '.join(s['datasets'])}", "",
             f"{s['n_train']} training and {s['n_test']} held-out questions ({datasets}); device {st['device']}, "
             f"dtype {st['dtype']}; controller {'given' if not st.get('controller_trained') else 'trained here'}.",
             ""]
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
            ["", f"Candidates: {', '.join(CANDIDATES)}; {how}.", ""]
    lines += next_steps(s)
    lines += ["## What ships in each setting", "", "| setting | ship | kappa | scale part (rows, delta gold log-lik., "
              "95% CI) | reweighting part | why |", "|---|---|---|---|---|---|"]
    for name, sv in v["settings"].items():
        cells = []
        for k in ("scale", "reweighting"):
            p = sv[k]
            cells.append(f"{' vs '.join(p['rows'])} {_f(p['delta'])} {_ci(p['ci95'])}" if p["measured"]
                         else f"not measured: {p.get('why', '-')}")
        lines.append(f"| {name} | {sv['ship']} | {sv['kappa']:g} | {cells[0]} | {cells[1]} | {sv['why']} |")
    lines += ["", "## Every row", "", "| method | gold log-lik. | F1 | EM | acc | against | delta log-lik. [95% CI] | "
              "delta F1 [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for n, m in s["methods"].items():
        p = s["paired"].get(n, {})
        lines.append(f"| {n} | {_f(m['logprob'], '.4f')} | {_f(m['f1'], '.3f')} | {_f(m['em'], '.3f')} | "
                     f"{_f(m['acc'], '.3f')} | {p.get('against', '-')} | {_f(p.get('delta_logprob'))} "
                     f"{_ci(p.get('ci95_logprob'))} | {_f(p.get('delta_f1'))} {_ci(p.get('ci95_f1'))} |")
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
        lines += ["The trainer's own verdicts (first order, training labels, not a measurement): "
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
def check_summary(s: Any) -> list[str]:
    """Every field ``summary.json`` must have; returns the problems (empty: complete)."""
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
    for sname, sv in [("verdict", v)] + [(f"verdict.settings.{k}", x) for k, x in settings.items()]:
        if not isinstance(sv, dict) or sv.get("ship") not in STUDY_SHIPS:
            bad.append(f"{sname}.ship: expected one of {list(STUDY_SHIPS)}")
            continue
        if not num(sv.get("kappa")) or sv["kappa"] <= 0:
            bad.append(f"{sname}.kappa: expected a number > 0")
        for k in ("scale", "reweighting"):
            p = sv.get(k)
            if not isinstance(p, dict) or not isinstance(p.get("measured"), bool) or "delta" not in p or "ci95" not in p:
                bad.append(f"{sname}.{k}: expected delta, ci95 and measured")
            elif p["measured"] and (not num(p["delta"]) or not ci(p["ci95"])):
                bad.append(f"{sname}.{k}: measured, so delta must be a number and ci95 [lo, hi]")
            elif not p["measured"] and p["delta"] is not None:
                bad.append(f"{sname}.{k}: not measured, so delta must be null")
        rw, sc = sv.get("reweighting") or {}, sv.get("scale") or {}
        if sv["ship"] == "network" and not (rw.get("measured") and rw["ci95"][0] > 0):
            bad.append(f"{sname}.ship is 'network' but the measured reweighting's CI does not lie above 0")
        if sv["ship"] == "scale_only" and not (sc.get("measured") and sc["ci95"][0] > 0):
            bad.append(f"{sname}.ship is 'scale_only' but the measured scale part's CI does not lie above 0")
    w = v.get("what_to_run")
    if w is not None and (not isinstance(w, dict) or w.get("row") not in CANDIDATES or not num(w.get("f1"))
                          or not all(ci((w.get(k) or {}).get("ci_f1")) for k in ("vs_standard_rag", "vs_host"))):
        bad.append(f"verdict.what_to_run: expected a row of {list(CANDIDATES)} with f1 and vs_standard_rag / vs_host "
                   "intervals")
    by = v.get("what_to_run_by_dataset")
    if w is not None and (not isinstance(by, dict) or set(by) != set(s.get("datasets") or {})):
        bad.append("verdict.what_to_run_by_dataset: expected one choice per dataset")
    return bad
