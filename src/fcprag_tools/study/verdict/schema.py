"""The schema check of ``summary.json``: every field it must have, and a trained verdict that agrees with the
cross-validated gains and margins it records."""

from __future__ import annotations

import math
import re
from typing import Any

from fcprag_plugin.training import SHIPS
from .choice import ALPHA, READINGS, VS
from .records import METRICS, SETTINGS, suffix
from .tables import CANDIDATES, TABLE_ROWS, host_of

def _num(x: Any, null_ok: bool = False) -> bool:
    return (x is None and null_ok) or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))


def _interval(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(_num(v) for v in x) and x[0] <= x[1]


def check_setting(sname: str, sv: Any, trained: bool) -> list[str]:
    """The problems of one verdict ``sv`` (named ``sname``); ``trained``: what ships was decided here, so it must
    agree with the cross-validated gains and margins it records."""
    num, ci = _num, _interval
    if not isinstance(sv, dict) or sv.get("ship") not in SHIPS:
        return [f"{sname}.ship: expected one of {list(SHIPS)}"]
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
    need = [*TABLE_ROWS]
    for sname, sv in (v.get("settings") or {}).items():
        if isinstance(sv, dict) and (sv.get("reweighting") or {}).get("measured"):
            need += [f"learned{suffix(sname)}", f"learned_same_total{suffix(sname)}"]
    bad += [f"methods: '{n}' missing" for n in dict.fromkeys(need) if n not in methods]
    for n, m in methods.items():
        if not isinstance(m, dict) or not num(m.get("logprob")) or \
                not all(k in m and num(m[k], null_ok=True) for k in METRICS[1:]):
            bad.append(f"methods['{n}']: expected logprob (a number), f1, em, acc (numbers or null)")
        elif not isinstance(m.get("by_subtask"), dict) or not m["by_subtask"] or not all(
                re.fullmatch(r"[^/]+/.+", k) and isinstance(b, dict) and num(b.get("f1"), True)
                and num(b.get("em"), True)
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
    if s.get("f1_unit") != "fraction":
        bad.append("f1_unit: expected 'fraction' (F1 as a fraction of 1, as PRAG's scorer)")
    if "dyprag" in methods and "dyprag" not in s:
        bad.append("dyprag: expected DyPRAG's section where its rows are in the table")
    return bad + check_what_to_run(v, s.get("datasets") or {}) + check_dyprag(s.get("dyprag"))


def check_dyprag(d: Any) -> list[str]:
    """The problems of the optional ``dyprag`` section (absent: none): the plan's comparisons made, each against
    another row with its reading, F1 and gold log-lik. intervals, at one level over those made; the translator (or
    why not), the cosines and the cost as objects; the fusion and ceiling rows each against DyPRAG's own row."""
    if d is None:
        return []
    num, ci = _num, _interval
    p = d.get("primary") if isinstance(d, dict) else None
    if not isinstance(p, dict) or not isinstance(p.get("comparisons"), list) or \
            p.get("n_comparisons") != len(p["comparisons"]):
        return ["dyprag.primary: expected comparisons and n_comparisons, how many were made"]
    m = p["n_comparisons"]
    bad = [] if not m or math.isclose(p.get("level", 0), 1 - ALPHA / m) else \
        [f"dyprag.primary: expected level 1 - {ALPHA:g}/{m} (Bonferroni over the comparisons made)"]
    for c in p["comparisons"]:
        if not isinstance(c, dict) or c.get("row") in (None, c.get("against")) or c.get("reading") not in READINGS \
                or not ci(c.get("ci_f1")) or not num(c.get("delta_logprob")) or not ci(c.get("ci_logprob")):
            bad.append(f"dyprag.primary: {c.get('key') if isinstance(c, dict) else c}: expected another row, a reading "
                       f"of {list(READINGS)}, ci_f1 and delta_logprob with ci_logprob")
    if d.get("translator") is None and not isinstance(d.get("why"), str):
        bad.append("dyprag.translator: expected the translator's record, or why there is none")
    bad += [f"dyprag.{k}: expected an object or null" for k in ("translator", "diversity", "cost")
            if d.get(k) is not None and not isinstance(d[k], dict)]
    for k in ("fusion", "ceiling"):
        parts = d.get(k)
        if not isinstance(parts, dict) or not all(isinstance(x, dict) and x.get("against") == host_of(x.get("row", ""))
                                                  for x in parts.values()):
            bad.append(f"dyprag.{k}: expected per setting a row paired against DyPRAG's own row of its setting")
    return bad


def check_choice(name: str, w: Any) -> list[str]:
    """The problems of one what-to-run choice ``w``: its row, F1 and target, its runner-up's lead and interval,
    and each held-out comparison (an interval, a reading, never the choice itself; standard RAG and PRAG's sum
    always but for themselves)."""
    num, ci = _num, _interval
    if not isinstance(w, dict) or w.get("row") not in CANDIDATES or not num(w.get("f1")) or not num(w.get("target_f1")):
        return [f"{name}: expected a row of {list(CANDIDATES)} with f1 and target_f1"]
    bad = []
    ru = w.get("runner_up")
    if ru is not None and not (isinstance(ru, dict) and ru.get("row") not in (None, w["row"]) and num(ru.get("lead_f1"))
                               and ci(ru.get("ci_f1"))):
        bad.append(f"{name}.runner_up: expected another row with lead_f1 and ci_f1 [lo, hi]")
    vo = w.get("vs_overall")
    if vo is not None and not (isinstance(vo, dict) and vo.get("row") not in (None, w["row"]) and num(vo.get("lead_f1"))
                               and ci(vo.get("ci_f1")) and w.get("follow") in (w["row"], vo["row"])):
        bad.append(f"{name}.vs_overall: expected the overall row with lead_f1 and ci_f1 [lo, hi], and follow one of "
                   "the two rows")
    for k in VS:
        c = w.get(k)
        need = k in ("vs_standard_rag", "vs_prag_sum") and w["row"] != k[3:]
        if c is None and not need:
            continue
        if not isinstance(c, dict) or not ci(c.get("ci_f1")) or c.get("reading") not in READINGS \
                or c.get("row") == w["row"]:
            bad.append(f"{name}.{k}: expected an interval ci_f1, a reading of {list(READINGS)} and another row")
    return bad


def check_what_to_run(v: dict[str, Any], datasets: Any) -> list[str]:
    """What to run overall and per dataset, and one level over every held-out comparison made."""
    w, by = v.get("what_to_run"), v.get("what_to_run_by_dataset")
    if w is None:
        return []
    bad = check_choice("verdict.what_to_run", w)
    if not isinstance(by, dict) or not by or not set(by) <= set(datasets):
        return bad + ["verdict.what_to_run_by_dataset: expected a choice per dataset"]
    for d, c in by.items():
        bad += check_choice(f"verdict.what_to_run_by_dataset.{d}", c)
    if bad:
        return bad
    m = sum(k in c for c in [w, *by.values()] for k in VS)
    if any(c.get("n_comparisons") != m or not math.isclose(c.get("level", 0), 1 - ALPHA / max(m, 1))
           for c in [w, *by.values()]):
        bad.append(f"verdict.what_to_run: expected n_comparisons {m} (the held-out comparisons made) and level "
                   f"1 - {ALPHA:g}/{m}")
    return bad
