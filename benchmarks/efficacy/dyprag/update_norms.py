"""How large DyPRAG's generated update is beside PRAG's sum, per held-out question of the committed study: the
Frobenius norm of ``mean(B) @ mean(A)`` (DyPRAG's rule, summed over the MLP projections of every layer) against that
of PRAG's sum ``sum_i (alpha/r) B_i A_i``, from the study's own translator and adapters (its run folder, not
committed: ``runs/dyprag-table``). Prints the median ratio and its quartiles.

    python benchmarks/efficacy/dyprag/update_norms.py runs/dyprag-table [--questions 10]
"""

import argparse
import json
import math
import statistics
from pathlib import Path

from fcprag_plugin.adapter import LoraAdapter
from fcprag_tools.lm.model_io import load_model
from fcprag_tools.translator import dyprag_adapter, generate_adapters, load_translator, update_inner

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("study", type=Path, help="the study's run folder (translator/, adapters/, questions.jsonl)")
p.add_argument("--questions", type=int, default=10, help="the first N held-out questions")
a = p.parse_args()

model, tok = load_model("smollm2", dtype="float32", device="cpu", progress=False)
rec = json.loads((a.study / "translator" / "translator.json").read_text())
translator = load_translator(a.study / rec["export"], model.config)
qs = [json.loads(x) for x in (a.study / "questions.jsonl").read_text().splitlines() if x.strip()]
held = [q for q in qs if q["split"] == "test"][: a.questions]
ratios = []
for q in held:
    texts = {pp["pid"]: pp["text"] for pp in q["passages"]}
    generated, _ = generate_adapters(model, tok, translator, texts)
    dy = dyprag_adapter([generated[pid] for pid in texts])
    prag = [LoraAdapter.from_pretrained(a.study / "adapters" / pid) for pid in texts]
    prag_sq = sum(update_inner(x, y) for x in prag for y in prag)  # ||sum_i s B_i A_i||^2
    ratio = math.sqrt(update_inner(dy, dy) / prag_sq)
    ratios.append(ratio)
    print(f"{q['id']}: |DyPRAG| / |PRAG's sum| = {ratio:.3g}")
qt = statistics.quantiles(ratios, n=4)
print(f"median {statistics.median(ratios):.3g} (quartiles {qt[0]:.3g} to {qt[2]:.3g}) over {len(ratios)} questions")
