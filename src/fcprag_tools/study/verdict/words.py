"""Figures and sentences in one F1 unit: F1 points (0-100) wherever a person reads them (summary.json and the flags
keep fractions of 1, as PRAG's scorer). The sentences of what to run that ``summary.json`` records (``plain``: the
choice and its margin; ``plain_held_out``: its held-out comparisons) and the next step's commands."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from .catalogue import ROWS
from .choice import VS
from .commands import command
from .records import suffix

FEW_NONZERO = 10  # fewer questions that differ: a paired bootstrap interval rests on them alone (rough ends)
SIGN_DECIMALS = 7  # the rows' log-liks. carry 6 decimals: a mean over questions below 1e-7 is rounding noise


def signed(x: Any, decimals: int = 4) -> str:
    """``x`` with its sign and ``decimals`` decimals, more when that would print a non-zero value as zero (the sign
    of an interval's end stays visible); ``-`` for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    out, d = format(x, f"+.{decimals}f"), decimals
    while x != 0 and float(out) == 0 and d < SIGN_DECIMALS:
        d += 1
        out = format(x, f"+.{d}f")
    return format(x, f"+.{decimals}f") if float(out) == 0 else out  # below 1e-7: rounding noise, shown as 0


def pts(x: Any, sign: bool = True) -> str:
    """A fraction of 1 as F1 points (one decimal, more where the sign needs it)."""
    if x is None:
        return "-"
    return signed(100 * x, 1) if sign else f"{100 * x:.1f}"


def interval(ci: Any) -> str:
    return "-" if not ci else f"[{pts(ci[0])}, {pts(ci[1])}]"


def row_words(row: str) -> str:
    """``row`` and what it is."""
    spec = ROWS.get(row)
    return f"`{row}` ({spec.words})" if spec else f"`{row}`"


def reading_text(v: dict[str, Any], n: int, target: float, power: float) -> str:
    """One held-out comparison in words (F1 points); where it shows nothing, what it could have detected (and the
    questions one planned follow-up at 95% would need); an interval that rests on few questions that differ is
    said to be rough."""
    fig = f"against `{v['row']}` {pts(v['delta_f1'])} {interval(v['ci_f1'])}"
    if v["reading"] == "tie":
        return f"against `{v['row']}` the same F1 on every one of the {n} questions (a tie)"
    k = v.get("n_nonzero")
    differ = f"{k} of {n} questions differ" + ("s" if k == 1 else "")
    few = f"only {differ}, so the interval rests on those few and is rough" if k is not None and k < FEW_NONZERO else None
    if v["reading"] in ("better", "worse"):
        return f"{fig}: {v['reading']}, shown" + (f" ({few})" if few else "")
    if v["reading"] == "equivalent":
        return f"{fig}: equivalent within ±{100 * target:g} points" + (f" ({few})" if few else "")
    single = (f", about {v['n_needed_95']} for one planned follow-up tested alone at 95%"
              if v.get("n_needed_95") not in (None, v["n_needed"]) else "")
    can = (f"with {n} questions only a true difference of about {100 * v['mde_f1']:.1f} points or more would have "
           f"been detected with {100 * power:g}% power; about {v['n_needed']} questions are needed for "
           f"{100 * target:g} points at this level{single}") if v.get("mde_f1") is not None else \
        f"{n} questions are too few to size a test"
    return f"{fig}: not shown ({few or differ}; {can})"


def plain(c: dict[str, Any], dataset: str | None) -> str:
    """The choice and its margin in one sentence a user acts on: a tie said as one, a lead that is not clear said
    so, and the cheaper settings not shown worse named beside it."""
    where = f"on {dataset}" if dataset else "overall"
    on = f"the {c['n_choice']} {'training ' if c['chosen_on'] == 'training' else ''}questions"
    f1 = f"{100 * c['choice_f1'][c['row']]:.1f}"
    if c["tied"]:
        why = "PRAG's own merge, so nothing changes" if c["row"] == "prag_sum" else "the cheapest of them"
        text = f"{', '.join(c['tied'])} tie on {on} (F1 {f1}); run {row_words(c['row'])}, {why}"
    else:
        text = f"run {row_words(c['row'])}: the highest F1 on {on} ({f1})"
        ru = c.get("runner_up")
        if ru:
            lead = f"{pts(ru['lead_f1'])} points {interval(ru['ci_f1'])} ({100 * ru['level']:g}%)"
            text += (f"; it leads the runner-up `{ru['row']}` ({100 * ru['f1']:.1f}) by {lead}" if ru["clear"] else
                     f", but its lead over the runner-up `{ru['row']}` ({100 * ru['f1']:.1f}) is not clear: {lead}")
    near = [x for x in c.get("cheaper") or [] if not x["clear"]]
    ru_row = (c.get("runner_up") or {}).get("row")
    if near:
        text += ("; cheaper and not shown worse there: " + ", ".join(
            f"`{x['row']}`" + (" (the runner-up)" if x["row"] == ru_row and not c["tied"] else
                               f" ({100 * x['f1']:.1f}; the choice's lead {pts(x['lead_f1'])} {interval(x['ci_f1'])})")
            for x in near))
    return f"{where}: {text}"


def follow_text(c: dict[str, Any], dataset: str, overall: dict[str, Any]) -> str | None:
    """When ``dataset``'s choice ``c`` differs from the ``overall`` one: which to follow there and why, in one
    sentence (None when they agree)."""
    v = c.get("vs_overall")
    if not v:
        return None
    lead = f"{pts(v['lead_f1'])} points {interval(v['ci_f1'])}, {100 * v['level']:g}%"
    if c["follow"] == c["row"]:
        return (f"On {dataset} follow its own choice `{c['row']}`, not the overall `{v['row']}`: on its "
                f"{c['n_choice']} {'training ' * (c['chosen_on'] == 'training')}questions it leads `{v['row']}` "
                f"clearly ({lead}).")
    unclear = [x for x in (overall, c) if not (x.get("runner_up") or {}).get("clear")]
    on = "training questions" if c["chosen_on"] == "training" else "questions"
    both = ("; neither choice leads its own runner-up clearly either" if len(unclear) == 2 else
            f"; nor does `{c['row']}` lead its own runner-up there clearly" if unclear == [c] else "")
    return (f"On {dataset} the overall choice `{v['row']}` and the dataset's `{c['row']}` differ: follow the overall "
            f"one there too, since it is chosen on all {overall['n_choice']} {on} (better powered "
            f"than {dataset}'s {c['n_choice']}) and on those {c['n_choice']} `{c['row']}` does not lead it "
            f"clearly ({lead}){both}.")


def plain_held_out(c: dict[str, Any]) -> str:
    """The choice's held-out comparisons in one sentence (or, chosen on them, the same questions: descriptive)."""
    held = c["chosen_on"] == "training"
    vs = [reading_text(c[k], c["n"], c["target_f1"], c["power"]) for k in VS if k in c]
    return (f"{'Held out' if held else 'On the same questions'} ({c['n']} {'held-out ' if held else ''}questions, "
            f"{100 * c['level']:.2f}% intervals{'' if held else '; chosen on them: descriptive, not a test'}): "
            + "; ".join(vs) + ".")


def _sentence(row: str, where: str | None) -> str:
    spec = ROWS[row]
    if spec.controller and spec.host == "dyprag":
        return (f"run DyPRAG with the study's translator through the shim with the controller that ships ({where}; "
                "`--mode separate`, the merge the study scored: on DyPRAG's separate averages kappa acts squared)")
    if spec.controller:
        return f"run PRAG through the shim with the controller that ships ({where})"
    if row in ("prag_sum", "prag_sum_combine"):
        return (f"leave PRAG as it is, in its {'parametric' if row == 'prag_sum' else 'Combine'} setting (through the "
                "shim with no controller it runs unchanged)")
    if row in ("dyprag", "dyprag_combine"):
        return (f"run DyPRAG as it is with the study's translator, in its "
                f"{'parametric' if row == 'dyprag' else 'Combine'} setting (through the shim with no controller it "
                "runs unchanged)")
    return f"run {spec.words}"


def step(s: dict[str, Any], row: str, datasets: list[str]) -> tuple[str, str, str]:
    """``(sentence, command, what it cannot know)`` that runs ``row`` on ``datasets``."""
    st = s["settings"]
    spec = ROWS[row]
    if spec.host is None:
        out = Path(str(st.get("out", "OUT")))
        return ("no retrieval has the highest F1: no host setting runs without passages, so run your model on the "
                "question alone; before dropping retrieval, see whether its lead holds on more questions",
                f"fcprag study MORE_QUESTIONS.jsonl --model {shlex.quote(str(st.get('model_name') or st.get('model')))}"
                + (f" --gguf-file {shlex.quote(st['gguf_file'])}" if st.get("gguf_file") else "")
                + f" --out {shlex.quote(f'{out}-more')}",
                "MORE_QUESTIONS.jsonl: other questions of these datasets, which this study cannot know.")
    where = None
    if spec.controller:
        where = str(Path(str(st.get("out", "OUT"))) / spec.controller) if st.get("controller_trained", True) \
            else str(st.get("controller"))
    if spec.host == "dyprag":  # its command copies the study's translator: the record's export and flags
        st = {**st, "translator": (s.get("dyprag") or {}).get("translator")}
    line, first, unknown = command(spec, st, datasets, where, every=list(s["datasets"]))
    return _sentence(row, where) + (f"; {first}" if first else ""), line, unknown


def what_ships_row(s: dict[str, Any]) -> str:
    """Without F1 (no what to run): the row of what ships (a setting's controller when one is not PRAG's sum)."""
    ships = [k for k, sv in s["verdict"]["settings"].items() if sv["ship"] != "prag_sum"]
    return "recommended" + suffix(ships[0]) if ships else "prag_sum"
