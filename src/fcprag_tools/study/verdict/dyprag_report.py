"""``report.md``'s DyPRAG parts, every figure read from ``summary.json``'s ``dyprag`` section
(:mod:`.dyprag_section`): the section itself (the translator and how to run it in DyPRAG, the plan's three
comparisons, how different the passages' updates are, the cost), the fusion and the ceiling over DyPRAG's LoRAs in
the ceiling section, and the words the table and "Every row" add where a study has DyPRAG's rows."""

from __future__ import annotations

from typing import Any

from .words import interval, pts, reading_text, signed, step

LEGEND = ("dyprag: DyPRAG's rule, the translator's LoRA factors of the passages averaged (`mean(B) @ mean(A)`), the "
          "question alone; dyprag_combine: the same with the passages in the prompt (DyPRAG-Combine); "
          "dyprag_recommended: what this study ships, over the translator's LoRAs (`u = w~/N`).")
PAIRED = ("DyPRAG's fusion and ceiling rows (`dyprag_recommended`, `dyprag_gold_passages` and their Combine twins) "
          "are paired against DyPRAG's own row of their setting, `dyprag` and `dyprag_combine` against PRAG's sum "
          "(the `against` column).")


def _secs(x: Any) -> str:
    """Seconds with the digits that matter: one decimal from 10 s, two from 0.1 s, else three significant."""
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


def _ci(ci: Any) -> str:
    return "-" if not ci else f"[{signed(ci[0])}, {signed(ci[1])}]"


def _trained(t: dict[str, Any]) -> str:
    """A translator trained here, in words: its passages, options, steps, seconds and first and last loss."""
    o, tr = t.get("options") or {}, t.get("training") or {}
    loss = (f"; its training loss {tr['first_loss']:.4g} at the first step, {tr['last_loss']:.4g} at the last"
            if tr.get("first_loss") is not None and tr.get("last_loss") is not None else "")
    epochs = o.get("epochs")
    return (f"trained here with DyPRAG's recipe on the {tr.get('passages', '-')} passages of the training questions "
            f"({epochs} epoch{'' if epochs == 1 else 's'}, learning rate {o.get('learning_rate', '-')}, hypernet "
            f"width {o.get('width', '-')}; {tr.get('steps', '-')} steps in {_secs(tr.get('seconds'))} s{loss})")


def translator_lines(s: dict[str, Any]) -> list[str]:
    """What the translator is (rows of another translator said first), and the commands that run it in DyPRAG's own
    script."""
    d = s["dyprag"]
    t = d["translator"]
    if t is None:
        return [f"The translator is not known: {d['why']}.", ""]
    what = _trained(t) if t["source"] == "trained" else \
        f"given (`--dyprag-translator {t['file']}`): nothing was trained here"
    other = d.get("other_translator") or {}
    lines = [f"> **Rows of another translator**: {other['rows']} of the {other['of']} DyPRAG rows this report reads "
             "record another translator than this one (a row is valid for its translator only); run the study's "
             "command again to score them with this one.", ""] if other.get("rows") else []
    lines += [f"The translator: {what}. Its export in DyPRAG's format is `{t['export']}` in the study folder (sha256 "
              f"`{t['sha256']}`, which each DyPRAG row records). To run DyPRAG with it (`--inference_method "
              "dyprag_combine`: with the passages in the prompt too):", ""]
    sentence, command, cannot = step(s, "dyprag", list(s["datasets"]))
    return lines + ["```bash", command, "```", "", f"{sentence[0].upper()}{sentence[1:]}. {cannot}", ""]


def primary_lines(d: dict[str, Any]) -> list[str]:
    """The plan's comparisons, each read and sized as the what-to-run comparisons are."""
    p = d["primary"]
    if not p["n_comparisons"]:
        return ["**The plan's three comparisons**: none could be made: " + "; ".join(
            f"`{k}`: {why}" for k, why in p["not_made"].items()) + ".", ""]
    lines = [f"**The plan's comparisons** (held out, {p['n']} questions, F1 in points, paired per question, "
             f"percentile bootstrap with 10,000 resamples; {100 * p['level']:.2f}% intervals: 0.05 split "
             f"(Bonferroni) over the {p['n_comparisons']} comparisons made; the gold log-lik. difference beside each "
             "at the same level):", ""]
    for c in p["comparisons"]:
        said = reading_text({**c, "row": c["against"]}, p["n"], p["target_f1"], p["power"])
        lines.append(f"- {c['question'][0].upper()}{c['question'][1:]} `{c['row']}` {said}; gold log-lik. "
                     f"{signed(c['delta_logprob'])} {_ci(c['ci_logprob'])}.")
    lines += [f"- `{k}`: not made ({why})." for k, why in p["not_made"].items()]
    return lines + [""]


def _spread(x: dict[str, Any] | None) -> str:
    if not x or x.get("mean") is None:
        return "none measured"
    return (f"mean {x['mean']:.3f}, median {x['median']:.3f} (quartiles {x['q1']:.3f} to {x['q3']:.3f}, "
            f"{x['n']} questions)")


def diversity_lines(d: dict[str, Any]) -> list[str]:
    """How different the passages' updates are, and what that leaves a reweighting."""
    v = d["diversity"]
    head = "**How different the passages' updates are**"
    if v is None:
        return [f"{head}: not known ({d['why'] or 'no cosines recorded'}).", ""]
    if v["parallel"] is None:
        reading = "no DyPRAG cosine was recorded"
    elif v["parallel"]:
        reading = (f"DyPRAG's are (median at least {v['parallel_at']:g}), so a reweighting of its LoRAs has little "
                   "to work with beyond that scale")
    else:
        reading = (f"DyPRAG's are not (median below {v['parallel_at']:g}), so a reweighting of its LoRAs has "
                   "directions to choose between")
    return [f"{head} (per held-out question, the mean pairwise cosine of its passages' updates: 1, the same "
            f"direction; about 0, unrelated): DyPRAG's generated updates {_spread(v['dyprag'])}; PRAG's adapters "
            f"{_spread(v['prag'])}. When the passages' updates are nearly parallel, any weighting of them is close "
            f"to a global scale of one update: {reading}.", ""]


def cost_lines(d: dict[str, Any]) -> list[str]:
    """The translator's training against PRAG's per-passage work, and after how many passages it pays for itself."""
    c = d["cost"]
    if c is None:
        return [f"**The cost**: not known ({d['why'] or 'no cost recorded'}).", ""]
    if c["source"] == "trained":
        train = (f"Training the translator took {_secs(c['train_seconds'])} s (the PRAG adapters and augmentations "
                 "of its training passages, which it learns from, are the study's anyway and not counted). ")
    else:
        train = "The translator was given: its training was done elsewhere and its seconds are not known here. "
    ratio = (f"; {c['prag_seconds'] / c['generation_seconds']:.0f} times as long" if c["prag_seconds"] is not None
             and c["generation_seconds"] else "")
    if not c["passages_generated"]:  # dyprag_generated.jsonl holds no line of this translator: no figure
        return [f"**The cost.** {train}Per passage, its generation seconds are not known: the study's "
                "`dyprag_generated.jsonl` holds no line of this translator (its sha256), so nothing is compared with "
                f"the {_secs(c['prag_seconds'])} s of a PRAG adapter's training here.", ""]
    per = (f"Per passage, generating its update took {_secs(c['generation_seconds'])} s (the median over "
           f"{c['passages_generated']} held-out passages: the passage's forward and the translator) against "
           f"{_secs(c['prag_seconds'])} s to train its PRAG adapter (the median over {c['prag_adapters']}{ratio}) "
           f"and {_secs(c['augment_seconds'])} s of PRAG's augmentation per passage, which DyPRAG skips too.")
    if c["break_even"] is not None:
        paid = (f" The translator has paid for itself after about {c['break_even']} passages against the adapter "
                "training alone" + (f" ({c['break_even_with_augmentation']} counting the augmentation)"
                                    if c["break_even_with_augmentation"] is not None else "") + ".")
    elif c["source"] == "trained" and c["break_even_with_augmentation"] is not None:
        paid = (" Generating took no less than a PRAG adapter's training here; counting the augmentation, the "
                f"translator has paid for itself after about {c['break_even_with_augmentation']} passages.")
    elif c["source"] == "trained":
        paid = " Per passage it saves no time here, so it never pays for itself on this machine."
    else:
        paid = ""
    return [f"**The cost.** {train}{per}{paid}", ""]


def dyprag_lines(s: dict[str, Any]) -> list[str]:
    """The report's DyPRAG section (none without DyPRAG's rows)."""
    d = s.get("dyprag")
    if not d:
        return []
    return (["## DyPRAG", ""] + translator_lines(s) + primary_lines(d) + diversity_lines(d) + cost_lines(d)
            + ["The fusion over DyPRAG's LoRAs and the supporting passages alone over them: under the ceiling "
               "below.", ""])


def _kappa_words(f: dict[str, Any]) -> str:
    if f["same"]:
        return "what ships here is PRAG's sum, so this fusion is DyPRAG's own row"
    k = f["kappa"]
    if f["ship"] == "scale_only":
        return (f"what ships is PRAG's sum times {k:g}, which on DyPRAG's separate averages multiplies its update by "
                f"{k * k:g} (kappa acts squared)")
    return (f"what ships is the network, whose weights average kappa {k:g} per passage: both of DyPRAG's averaged "
            f"factors carry them, so the update grows about as kappa squared (x{k * k:g})")


def _ceiling_words(g: dict[str, Any], f: dict[str, Any] | None) -> str:
    """The ceiling over DyPRAG's LoRAs against DyPRAG's row, and how much of it the fusion ``f`` reaches."""
    if f is None:
        reach = ""
    elif g["share"] is None:
        reach = "; it does not lie above DyPRAG's row, so there is nothing to reach"
    elif f["delta_logprob"] <= 0:
        reach = "; the fusion reaches none of it"
    else:
        reach = f"; the fusion reaches {100 * g['share']:.1f}% of it"
    return (f"the supporting passages alone over them (`{g['row']}`, their factors averaged): "
            f"{signed(g['delta_logprob'])} {_ci(g['ci_logprob'])} gold log-lik. ({pts(g['delta_f1'])} F1 points "
            f"{interval(g['ci_f1'])}){reach}")


def ceiling_lines(s: dict[str, Any]) -> list[str]:
    """DyPRAG's lines of the ceiling section: per setting the fusion that ships over the translator's LoRAs against
    DyPRAG's row, and the supporting passages alone over them (none without DyPRAG's rows)."""
    d = s.get("dyprag")
    if not d or not (d["fusion"] or d["ceiling"]):
        return []
    lines = []
    for name in dict.fromkeys([*d["fusion"], *d["ceiling"]]):
        f, g = d["fusion"].get(name), d["ceiling"].get(name)
        parts = []
        if f:
            parts.append(f"the fusion that ships over the translator's LoRAs (`{f['row']}`, `u = w~/N`) against "
                         f"`{f['against']}`: {signed(f['delta_logprob'])} {_ci(f['ci_logprob'])} gold log-lik. "
                         f"({pts(f['delta_f1'])} F1 points {interval(f['ci_f1'])}); {_kappa_words(f)}")
        if g:
            parts.append(_ceiling_words(g, f))
        lines.append(f"- DyPRAG, {name}: " + "; ".join(parts) + ".")
    gold = " `dyprag_gold_passages` reads the data's supporting titles (a reference, not a method)." if d["ceiling"] \
        else ""
    return lines + ["", "Over DyPRAG's LoRAs: the paired table's 95% intervals, against DyPRAG's own row of the "
                    f"setting.{gold}", ""]
