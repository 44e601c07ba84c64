"""``report.md`` from ``summary.json``'s content (every figure read from it): the paper's table, what to run and the
next command, what ships in each setting, the ceiling, every row; and the sentences of what to run that
``summary.json`` records (``plain``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .records import suffix
from .tables import TABLE_ROWS

SMALL_TEST = 30  # fewer held-out questions: the report warns that its intervals mean little


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
