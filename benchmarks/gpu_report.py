"""The issue-33 table from one ``gpu_check.sh`` run: reads the JSON reports in OUTDIR and writes ``gpu_table.md``.

    python benchmarks/gpu_report.py OUTDIR

Every figure comes from the reports of that one run (each benchmark measures its columns side by side); a report
that is missing (a step that failed or was skipped) is named instead of its rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(folder: Path, name: str) -> dict[str, Any] | None:
    p = folder / name
    return json.loads(p.read_text()) if p.is_file() else None


def ms(d: dict[str, Any] | None, key: str = "median_ms") -> str:
    if not d or key not in d:
        return "-"
    v = d[key]
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.3f}"


def generation(g: dict[str, Any]) -> list[str]:
    e = g["env"]
    names = {"base": "base", "hooks": "slot on, hooks", "weights": "slot on, fused weights (route weights)",
             "auto": "slot on, default route (auto)", "peft": "PEFT LoRA on (PRAG's generation)"}
    bs = list(g["batches"])
    out = [f"Generation: {e['layers']} layers of the Llama-3.2-1B shape (vocab {e['vocab']}), {e['dtype']}, "
           f"{e['prompt']}-token prompt, {e['new_tokens']} new tokens, greedy; `with fuse_into(model, ...): "
           f"generate` (the fuse_into call included), medians of {_rounds(g)} interleaved rounds. "
           f"Fused-weight copy: {e['fused_weights_bytes'] / 2**30:.2f} GiB.", "",
           "| ms (x base) | " + " | ".join(f"batch {b}" for b in bs) + " |", "|---" * (1 + len(bs)) + "|"]
    for k, label in names.items():
        cells = []
        for b in bs:
            t = g["batches"][b]["timings"].get(k)
            cells.append("-" if t is None else f"{t['median_ms']:.0f} ({t['ratio_to_base']:.3f}x)")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    errs = "; ".join(f"batch {b}: hooks {r['logits']['hooks']['rel_err']:.1e}, fused weights "
                     f"{r['logits']['weights']['rel_err']:.1e} (route auto on fused weights: "
                     f"{r['logits']['auto']['on_weights']}), the update itself "
                     f"{r['logits']['base_vs_reference']['rel_err']:.1e}"
                     for b, r in g["batches"].items())
    out += ["", f"Logits of a decoding step vs the float64 dense reference `W + sum_i w_i s_i B_i A_i` "
                f"(max |diff| / max |ref|): {errs}. Base weights bit-identical, the original Parameter objects, "
                f"after the run: {g['base_weights_bit_identical']}."]
    return out


def _rounds(g: dict[str, Any]) -> int:
    first = next(iter(g["batches"].values()))["timings"]
    return next(iter(first.values()))["repeats"]


def fusion(f: dict[str, Any]) -> list[str]:
    out = ["Per question (PRAG's setting: PRAG-layout adapters r=2, gate/up/down_proj), medians, side by side:", "",
           "| shape | N | PRAG's PEFT path | PEFT hotswap from state dict (merged ahead) | slot write (warm store) | "
           "device copy of the same bytes | slot / copy |", "|---|---|---|---|---|---|---|"]
    for r in f.get("fusion", []):
        pe = r.get("peers", {})
        out.append(f"| {r['shape']} | {r['n']} | {ms(r['a_peft'])} ms | {ms(pe.get('h_peft_hotswap_mem'))} ms | "
                   f"{ms(r['b_slot_warm'])} ms | {ms(r['d_memcpy'])} ms | {r['ratios']['b_over_d']:.1f}x |")
    mx = f.get("mixed")
    if mx:
        out += ["", f"Mixed batch (SmolLM2-135M shape, {mx['batch']} samples x {mx['tokens']} tokens, each its own "
                    f"{mx['n_per_sample']} of {mx['union']} adapters, one scoring forward): batched "
                    f"{mx['batched']['median_ms']:.1f} ms vs one sample at a time {mx['looped']['median_ms']:.1f} ms "
                    f"({mx['speedup']:.1f}x); one shared merge for the whole batch "
                    f"{mx['shared_merge_batched']['median_ms']:.1f} ms; max |logit diff| {mx['max_abs_diff']:.1e}."]
    return out


def labels(lab: dict[str, Any]) -> list[str]:
    r = lab["records_per_s"]
    return [f"Label builder ({lab['model']}; {lab['records']} records x N={lab['n']}, answer log-prob"
            + (f" + {lab['max_new_tokens']} generated tokens" if lab["generate"] else "") + "), records/s, best of "
            "the rounds:", "",
            "| sequential (hooks) | sequential (slot) | batched | forward floor (no adapters) | floor / batched |",
            "|---|---|---|---|---|",
            f"| {r['sequential (hooks)']:.2f} | {r['sequential (slot)']:.2f} | {r['batched']:.2f} | {r['floor']:.2f} | "
            f"{r['floor'] / r['batched']:.2f}x |", "",
            f"Batched vs sequential labels: max |log-prob diff| {lab['max_logprob_diff']:.1e}; greedy texts "
            f"identical: {lab['greedy_texts_identical']}."]


def shims(s: dict[str, Any]) -> list[str]:
    out = []
    a = s["args"]
    if "prag" in s:
        p = s["prag"]["ms"]
        out += [f"PRAG's loop per question ({a['layers']} layers, N={a['n']}, {a['tokens']}-token prompt, "
                f"{a['new_tokens']} generated tokens), ms: unpatched {p['unpatched']['total']:.0f}, default shim "
                f"{p['default']['total']:.0f}, `--use-slot` {p['slot']['total']:.0f} (of which the forward + "
                f"generation {p['slot']['forward']:.0f}; the bare model's {s['prag']['ms_bare_forward']:.0f}); base "
                f"bit-identical after: {s['prag']['base_bit_identical_after']}."]
    if "dyprag" in s:
        d = s["dyprag"]["ms"]
        out += ["", f"DyPRAG's injection per question (mode {s['dyprag']['mode']}), ms: default "
                    f"{d['default']['total']:.1f}, use_slot {d['slot']['total']:.1f}; max |logit diff| "
                    f"{s['dyprag']['max_abs_logit_diff']:.1e}."]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_report.py OUTDIR", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    g, f, lab, s = (load(folder, n) for n in ("bench_generate.json", "bench_fusion.json", "labels.json",
                                               "shims.json"))
    env = (g or f or lab or s or {}).get("env", {})
    lines = [f"# One GPU check ({env.get('gpu', env.get('device', '?'))}; torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}, peft {env.get('peft')})", ""]
    for name, part, fn in (("bench_generate.json", g, generation), ("bench_fusion.json", f, fusion),
                           ("labels.json", lab, labels), ("shims.json", s, shims)):
        lines += (fn(part) if part else [f"({name} missing: that step failed or was skipped; see check.log)"]) + [""]
    (folder / "gpu_table.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
