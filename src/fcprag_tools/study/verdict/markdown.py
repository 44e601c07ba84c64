"""``report.md`` from ``summary.json``'s content (every figure read from it, F1 in points, gold log-lik. in nats):
the paper's table, what to run and the next commands, DyPRAG's section where the study has its rows
(:mod:`.dyprag_report`), what ships in each setting and why its kappa, the ceiling, every row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import dyprag_report
from .catalogue import ROWS
from .tables import PAPER_ROWS
from .words import VS, interval, pts, signed, step, what_ships_row

SMALL_TEST = 30  # fewer held-out questions: the report warns that its intervals mean little


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ci(ci: Any, decimals: int = 4) -> str:
    return "-" if not ci else f"[{signed(ci[0], decimals)}, {signed(ci[1], decimals)}]"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def model_name(settings: dict[str, Any]) -> str:
    """The model as a person names it: a GGUF file's stem, else the last part of the name or path."""
    gguf = settings.get("gguf_file")
    return Path(gguf).name.removesuffix(".gguf") if gguf else Path(str(settings.get("model", "?"))).name


def paper_table(s: dict[str, Any]) -> list[str]:
    """Rows = methods, columns = datasets x subtasks and each dataset's total; F1 in points, the best bold."""
    cols = [(d, f"{d}/{sub}", sub) for d, info in s["datasets"].items() for sub in info["subtasks"]
            if len(info["subtasks"]) > 1] + [(d, None, "total") for d in s["datasets"]]
    cols.sort(key=lambda c: (list(s["datasets"]).index(c[0]), c[1] is None))
    rows = [n for n in PAPER_ROWS if n in s["methods"]]

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


def header_lines(s: dict[str, Any]) -> list[str]:
    """The title, the questions and the split, and what the reader must know first (too few questions, rows left
    out, no answers)."""
    st = s["settings"]
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
    left = s["left_out"]
    if left["held_out"]["questions"]:
        lack = ", ".join(f"`{r}` on {k}" for r, k in left["held_out"]["rows"].items())
        lines += [f"> **Incomplete rows**: {left['held_out']['questions']} of {left['held_out']['of']} held-out "
                  f"questions lack a row the summary needs ({lack}) and are left out of every held-out figure.", ""]
    if left["choice"]["questions"]:
        lack = ", ".join(f"`{r}` on {k}" for r, k in (left["choice"].get("rows") or {}).items())
        lines += [f"> **Incomplete rows**: {left['choice']['questions']} of {left['choice']['of']} questions the "
                  f"choice is made on lack a candidate's row ({lack or 'rows not recorded'}) and are left out of "
                  "what to run.", ""]
    return lines


def choice_lines(s: dict[str, Any]) -> list[str]:
    """What to run: the choice with its margin (bold), its held-out comparisons, per dataset, and how to read them."""
    w, by = s["verdict"]["what_to_run"], s["verdict"]["what_to_run_by_dataset"]
    lines = ["## What to run", ""]
    if w is None:
        return lines + ["Not decided: it needs greedy answers (F1) of every candidate row (run without "
                        "--no-generate).", ""]
    lines += [f"**{w['plain']}.** {w['plain_held_out']}", ""]
    lines += [f"- {c['plain']}. {c['plain_held_out']}" for c in by.values()] + [""]
    lines += [x for c in by.values() if c.get("plain_follow") for x in (c["plain_follow"], "")]
    on = "training questions" if w["chosen_on"] == "training" else "held-out questions themselves (nothing was " \
        "trained: descriptive, not a test)"
    count = ", ".join(f"{k} {sum(x in c for x in VS)}" for k, c in [("overall", w), *by.items()])
    same = [f"`{v['recommended_row'].replace('prag_sum', 'recommended')}`" for v in s["verdict"]["settings"].values()
            if v.get("recommended_row", "").startswith("prag_sum")]  # what ships is PRAG's sum: no candidate
    twins = [f"`dyprag_{x[1:]}" for x in same] if "dyprag" in w["choice_f1"] else []  # DyPRAG's fusions likewise
    cands = ", ".join(sorted(w["choice_f1"], key=lambda r: ROWS[r].cost)) + (
        f" ({' and '.join(same)}: PRAG's sum of {'their settings' if len(same) > 1 else 'its setting'} here"
        + (f", and {' and '.join(twins)} DyPRAG's own {'rows' if len(twins) > 1 else 'row'}" if twins else "")
        + f", not {'candidates of their own' if twins else 'a candidate of its own'})" if same else "")
    lines += [f"Candidates, cheapest first: {cands}; the one with the highest F1 on the {on} is chosen (a tie goes "
              "to PRAG's sum when it is tied: nothing changes for a PRAG user; else to the cheapest tied row). Its "
              "lead over the runner-up and over each cheaper candidate is paired on those questions "
              f"({100 * w['runner_up']['level']:g}%, where the choice was made: if anything optimistic); a lead "
              "whose interval reaches 0 is not clear." if w.get("runner_up") else f"Candidates: {cands}.",
              "",
              f"Held-out intervals at {100 * w['level']:.2f}%: 0.05 split (Bonferroni) over the {w['n_comparisons']} "
              f"held-out comparisons made ({count}), none of a row with itself. \"Equivalent\": the interval lies "
              f"inside ±{100 * w['target_f1']:g} points (`--target-f1 {w['target_f1']:g}`); the power figures are "
              f"at each interval's level and {100 * w['power']:g}% power, from the observed SD of the paired "
              "differences.", ""]
    return lines


def next_steps(s: dict[str, Any]) -> list[str]:
    """One command per decision (overall and each dataset; without F1, what ships), with what it cannot know."""
    w, datasets = s["verdict"]["what_to_run"], list(s["datasets"])
    scopes = [("Overall (each dataset in turn)", w["row"], datasets)] if w else \
        [("What ships", what_ships_row(s), datasets)]
    if w:
        scopes += [(f"On {d}" + (" (its own choice; which to follow: What to run)" if c.get("vs_overall") else ""),
                    c["row"], [d]) for d, c in s["verdict"]["what_to_run_by_dataset"].items()]
    lines, unknown, said = ["## Next step", ""], [], {}
    for where, row, ds in scopes:
        sentence, command, cannot = step(s, row, ds)
        if command in said:  # one dataset: its decision is the overall one
            lines += [f"{where}: the same command as {said[command].lower()}.", ""]
            continue
        said[command] = where.split(" (")[0]
        lines += [f"{where}: {sentence}:", "", "```bash", command, "```", ""]
        unknown += [cannot] if cannot not in unknown else []
    return lines + [" ".join(unknown), ""]


def verdict_table(s: dict[str, Any]) -> list[str]:
    """What ships per setting: decided on the training questions, then checked on the held-out ones."""
    lines = ["## What ships in each setting", "",
             "| setting | ship | kappa | decided on | training CV: reweighting / scale gain (95% CI) | held out: "
             "scale part | held out: reweighting part | held out: controller vs PRAG's sum | why |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, sv in s["verdict"]["settings"].items():
        cvs = " / ".join(f"{signed(p['gain'])} {_ci(p['ci95'])}" if p else "-"
                         for p in (sv["cv"]["reweighting"], sv["cv"]["scale"]))
        cells = []
        for k in ("scale", "reweighting", "total"):
            p = sv[k]
            if not p["measured"]:
                cells.append(f"not measured: {p.get('why', '-')}")
                continue
            to = "PRAG's sum" if p["rows"][1].startswith("prag_sum") else p["rows"][1]
            eq = f"; equivalent to {to} within ±{p['margin']:g}" if p["equivalent"] else ""
            cells.append(f"{' vs '.join(p['rows'])} {signed(p['delta'])} {_ci(p['ci95'])}{eq}")
        lines.append(f"| {name} | {sv['ship']} | {sv['kappa']:g} | {sv['decided_on']} | {cvs} | "
                     + " | ".join(cells) + f" | {sv['why']} |")
    m = s["policy"]
    if not s["settings"].get("controller_trained", True):
        return lines + ["", "A given controller is measured here, not decided on: it ships as it is.", ""]
    lines += ["", f"A network ships only when its reweighting gain's lower bound lies above +{m['min_gain']:g} gold "
              f"log-lik. per question, a scale only above +{m['min_scale_gain']:g} (`--min-gain`); the held-out "
              "parts measure what was decided, they decide nothing.", ""]
    return lines


METRIC_WORDS = {"label": "gold log-lik.", "f1": "F1"}  # the rule's metric, as the report says it


def rule_table(fig: dict[str, Any], rule: dict[str, Any]) -> list[str]:
    """The risk rule's figures per kappa."""
    unit = METRIC_WORDS.get(rule["metric"], rule["metric"])
    lines = [f"| kappa | mean gain over PRAG's sum ({unit}) | questions losing more than {rule['loss_margin']:g} | "
             f"share | upper end of its 95% Wilson interval | allowed (at most {100 * rule['max_loss_share']:g}%) |",
             "|---|---|---|---|---|---|"]
    for k in fig["kappas"]:
        chosen = " (chosen)" if k["kappa"] == fig["rule_kappa"] else ""
        lines.append(f"| {k['kappa']:g}{chosen} | {signed(k['mean_gain'])} | {k['losing']} of {fig['questions']} | "
                     f"{_pct(k['share'])}% | {_pct(k['upper_bound'])}% | {'yes' if k['allowed'] else 'no'} |")
    left = fig.get("left_out") or {}
    if left:
        lines += ["", "  Left out (scored on only some of these questions): "
                  + ", ".join(f"`{r}` (missing on {k})" for r, k in left.items()) + "."]
    return lines


def _chose(kr: dict[str, Any]) -> str:
    k, by = kr.get("trainer_kappa"), kr.get("chosen_by")
    if k is None:
        return "the trainer's choice is not recorded"
    how = " on the measured scales" if by == "measured" else f" ({by})" if by else ""
    return f"the trainer chose kappa {k:g}{how}"


def kappa_lines(s: dict[str, Any]) -> list[str]:
    """Why each setting's kappa: the trainer's risk rule and its figures per kappa (or why they are absent), and
    the same rule read on the held-out scale rows (or why it is not)."""
    lines = ["## Why this kappa", ""]
    for name, sv in s["verdict"]["settings"].items():
        kr = sv.get("kappa_rule") or {}
        r = kr.get("rule")
        if r is None:
            lines += [f"- {name}: kappa {sv['kappa_learned']:g}; {kr.get('why_absent') or 'no rule recorded'}.", ""]
            continue
        bound = ("by the upper end of its two-sided 95% Wilson interval" if r["bound"] == "upper" else
                 "by its observed share")
        lines += [f"- {name}: the trainer's risk rule chooses kappa on the training questions' measured scales: the "
                  f"largest mean gain over PRAG's sum among scale 1 and the scales whose share of questions losing "
                  f"more than {r['loss_margin']:g} {METRIC_WORDS.get(r['metric'], r['metric'])} is at most "
                  f"{100 * r['max_loss_share']:g}% {bound}; {_chose(kr)}, and kappa {sv['kappa']:g} ships.", ""]
        lines += (rule_table(kr["training"], r) if kr.get("training") else
                  [f"  Its figures on the training questions cannot be shown: {kr['why_absent']}"
                   + (f" (the rule above is {kr['rule_from']})" if kr.get("rule_from") != "training_args.json" else "")
                   + "."]) + [""]
        if kr.get("held_out"):
            lines += [f"  The same rule read on the {kr['held_out']['questions']} held-out questions' scale rows "
                      "(descriptive: it decided nothing):", ""] + rule_table(kr["held_out"], r) + [""]
        elif kr.get("held_out_why"):
            lines += [f"  No held-out reading of the rule: {kr['held_out_why']}.", ""]
    return lines


def ceiling_lines(s: dict[str, Any]) -> list[str]:
    """How much of the gold-passage ceiling the learned controller reaches, or why there is none; then DyPRAG's fusion
    and ceiling over its LoRAs (:func:`.dyprag_report.ceiling_lines`)."""
    return prag_ceiling_lines(s) + dyprag_report.ceiling_lines(s)


def prag_ceiling_lines(s: dict[str, Any]) -> list[str]:
    """How much of PRAG's gold-passage ceiling the learned controller reaches, or why there is none."""
    c = s.get("ceiling") or {}
    lines = ["## Ceiling: the supporting passages alone", ""]
    if c.get("why_absent"):
        return lines + [f"No `gold_passages` row: {c['why_absent']}.", ""]
    for name, r in c["settings"].items():
        gain = f"{signed(r['gold'])} gold log-lik. ({pts(r['gold_f1'])} F1 points) against PRAG's sum"
        if r["learned"] is None:
            reach = "no network was measured in this setting"
        elif r["share"] is None:
            reach = ("it does not lie above PRAG's sum, so there is nothing to reach (the network: "
                     f"{signed(r['learned'])})")
        elif r["learned"] <= 0:
            reach = f"the learned controller reaches none of it (it does not beat PRAG's sum: {signed(r['learned'])})"
        else:
            reach = f"the learned controller reaches {100 * r['share']:.1f}% of it ({signed(r['learned'])})"
        lines.append(f"- {name}: PRAG's total spread over the supporting passages: {gain}; {reach}.")
    return lines + ["", "`gold_passages` reads the data's supporting titles (a reference, not a method).", ""]


def every_row_lines(s: dict[str, Any]) -> list[str]:
    """Every row: its means (F1, EM and answer presence in points) and its deltas against PRAG's sum."""
    lines = ["## Every row", "", "| method | gold log-lik. | F1 | EM | acc | against | delta log-lik. [95% CI] | "
             "delta F1 [95% CI] | F1 MDE (95%, 80% power) |", "|---|---|---|---|---|---|---|---|---|"]
    for n, m in s["methods"].items():
        p = s["paired"].get(n, {})
        lines.append(f"| {n} | {_f(m['logprob'], '.4f')} | {_pct(m['f1'])} | {_pct(m['em'])} | {_pct(m['acc'])} | "
                     f"{p.get('against', '-')} | {signed(p.get('delta_logprob'))} {_ci(p.get('ci95_logprob'))} | "
                     f"{pts(p.get('delta_f1'))} {interval(p.get('ci95_f1'))} | {_pct(p.get('mde_f1'))} |")
    notes = ["F1, EM and acc (answer presence) in points; deltas are paired against PRAG's sum of the row's setting "
             "over the held-out questions (percentile bootstrap, 2,000 resamples)."]
    notes += [dyprag_report.PAIRED] if s.get("dyprag") else []
    notes += [text for row, text in (("oracle", "`oracle` reads the answer (a reference, not a method)."),
                                     ("average", "`average` is 1/N."),
                                     ("arrow", "`arrow` is PEFT's Arrow routing over the same adapters (per token "
                                               "and layer the top 3 adapters by |x . prototype|; tested equal to "
                                               "PEFT's create_arrow_model)."))
              if row in s["methods"]]
    if s["settings"].get("arrow") not in ("scored", "off", None):
        notes.append(f"No Arrow row: {s['settings']['arrow']}.")
    partial = s["left_out"]["rows_not_in_table"]
    if partial:
        notes.append("Not in the tables (scored on only some held-out questions): "
                     + ", ".join(f"`{r}` (missing on {k})" for r, k in partial.items()) + ".")
    return lines + ["", " ".join(notes), ""]


def report(s: dict[str, Any], plot: str | None = None) -> str:
    """``report.md``: the paper's table, what to run, what ships in each setting, then every row."""
    lines = header_lines(s) + ["## F1 on the held-out questions (points, 0-100)", ""] + paper_table(s) + [
        "", "vanilla: the question alone, no adapter; standard_rag: the retrieved passages in the prompt, no adapter; "
        "prag_sum: PRAG's sum of the passage adapters; recommended: what this study ships; random_controller: an "
        "untrained controller at the same kappa (the paper's ablation); `_combine`: the passages in the prompt as "
        "well as the adapter." + (f" {dyprag_report.LEGEND}" if s.get("dyprag") else ""), ""]
    lines += [f"![F1 per row and dataset]({plot})", ""] if plot else [
        "(The plot needs matplotlib: `pip install matplotlib`, or the project's `plot` extra; then run the same "
        "command again.)", ""]
    lines += choice_lines(s) + next_steps(s) + dyprag_report.dyprag_lines(s) + verdict_table(s) + kappa_lines(s)
    lines += ceiling_lines(s)
    lines += every_row_lines(s)
    tv = s.get("training_verdict")
    if tv:
        lines += ["The trainer's own verdicts (its cross-validation against 0, not against the margin): "
                  + "; ".join(f"{k} {t.get('verdict', '-')}" for k, t in tv.items()), ""]
    times = s["stage_seconds"]
    lines += ["Stage times of this invocation (s): " + ", ".join(f"{k} {x}" for k, x in times.items()) if times else
              "Re-reported by `fcprag report` from the folder's rows (nothing was run; the study's stage times are in "
              "its timings.jsonl).", ""]
    return "\n".join(lines)
