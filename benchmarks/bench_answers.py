"""The study's evaluation on the real SmolLM2-135M: answers that stop at PRAG's cut and prompts read once, against
the evaluation of ``--baseline`` (a git revision: its ``src`` runs as it was, every answer to ``--max-new-tokens``
and each prompt read twice), side by side in one run.

Each setting runs in its own process (the baseline's with that revision's ``src`` first on the path), one after the
other, on the same questions: the first ``--n`` questions of ``--questions`` (one more before them warms up, not
timed), their first 3 passages, one random PRAG-layout adapter (r 2, alpha 32, gate/up/down_proj; ``B`` small, so
the answers are the model's own) per passage, and per question the rows ``vanilla``, ``standard_rag``,
``prag_sum``, ``learned`` (fixed non-uniform ``w~``), ``prag_sum_combine`` and ``learned_combine``: both prompt
kinds, with and without adapters, through ``scoring.score`` as the study calls it (8 questions per slot and call,
``--batch-size`` sequences per forward). Printed: seconds per question of three settings (new at 16 and at 64
tokens, the baseline at 16) with the load average around each, the 64-token over the 16-token evaluation, and
whether predictions agree (all rows against the baseline at 16 tokens; the 64-token against the 16-token rows
wherever the 16-token answer reached a cut). ``--split``: also the new code with each prompt read twice, and
with answers to full length, to tell the two changes apart.

Usage::

    python benchmarks/bench_answers.py --questions ../shared/data/hotpotqa_dev_sample.jsonl --n 12
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROWS = {"vanilla": ("param", [0.0] * 3), "standard_rag": ("combine", [0.0] * 3), "prag_sum": ("param", [1.0] * 3),
        "learned": ("param", [1.6, 1.3, 1.2]), "prag_sum_combine": ("combine", [1.0] * 3),
        "learned_combine": ("combine", [1.6, 1.3, 1.2])}
CHUNK = 8  # the study's --chunk: questions per slot and score call


def questions(files: list[str], n: int) -> dict[str, dict[str, Any]]:
    from fcprag_tools.study import data

    qs = data.read_question_files(files)[:n + 1]
    return {q["id"]: {**q, "passages": [{"pid": f"{q['id']}-{i}", "text": t} for i, t in enumerate(q["passages"][:3])]}
            for q in qs}


def adapters(model: Any, qs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import torch

    from fcprag_plugin.adapter import LoraAdapter, LoraModule
    from fcprag_tools.study.adapters import target_linears

    targets = ["gate_proj", "up_proj", "down_proj"]
    lins = target_linears(model, targets)
    g = torch.Generator().manual_seed(5)
    out = {}
    for q in qs.values():
        for p in q["passages"]:
            mods = {nm: LoraModule(torch.randn(2, m.in_features, generator=g) / m.in_features ** 0.5,
                                   torch.randn(m.out_features, 2, generator=g) * 0.01, 16.0) for nm, m in lins.items()}
            out[p["pid"]] = LoraAdapter(mods, {"r": 2, "lora_alpha": 32, "target_modules": targets}, p["pid"])
    return out


def worker(a: argparse.Namespace) -> None:
    """One setting: prints one JSON line with its seconds, load averages and rows."""
    import torch

    from fcprag_plugin.slot import FusedSlot
    from fcprag_tools.lm.model_io import load_model
    from fcprag_tools.study import scoring

    torch.set_num_threads(a.threads)
    model, tok = load_model("smollm2", dtype="float32", device="cpu", progress=False)
    qs = questions(a.questions, a.n)
    ads = adapters(model, qs)
    kw: dict[str, Any] = {"max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size}
    if "until_cut" in inspect.signature(scoring.score).parameters:
        kw["until_cut"] = not a.full_length
    if a.two_reads:  # the new code with each prompt read twice (once for the gold answer, once for the answer)
        scoring.score_rows = functools.partial(scoring.score_rows, share_prompt=False)

    def run(qids: list[str]) -> list[dict[str, Any]]:
        out = []
        for i in range(0, len(qids), CHUNK):
            chunk = qids[i:i + CHUNK]
            pids = [p["pid"] for q in chunk for p in qs[q]["passages"]]
            slot = FusedSlot.for_model(model, ads[pids[0]], max_adapters=len(pids), max_rank=2)
            try:
                rows = [scoring.Row(q, nm, [p["pid"] for p in qs[q]["passages"]], w, prompt)
                        for q in chunk for nm, (prompt, w) in ROWS.items()]
                out += scoring.score(model, tok, slot, rows, qs, ads.__getitem__, **kw)
            finally:
                slot.remove()
        return out

    ids = list(qs)
    with torch.no_grad():
        run(ids[:1])  # warm-up
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        res = run(ids[1:])
        secs = time.perf_counter() - t0
    print("RESULT " + json.dumps({"seconds": secs, "load": [load0, os.getloadavg()], "questions": len(ids) - 1,
                                  "rows": res}))


def setting(a: argparse.Namespace, src: Path, max_new: int, *flags: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--questions", *a.questions, "--n", str(a.n), "--max-new-tokens",
           str(max_new), "--batch-size", str(a.batch_size), "--threads", str(a.threads)]
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd + list(flags), env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"setting {src} {max_new}: failed\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def same(x: dict[str, Any], y: dict[str, Any], only_cut: bool = False) -> tuple[int, int, float]:
    """(rows compared, rows with equal predictions, max |logprob difference|)."""
    from fcprag_tools.lm.metrics import reaches_cut

    pairs = [(r, s) for r, s in zip(x["rows"], y["rows"]) if not only_cut or reaches_cut(s["generation"])]
    return (len(pairs), sum(r["prediction"] == s["prediction"] for r, s in pairs),
            max(abs(r["logprob"] - s["logprob"]) for r, s in zip(x["rows"], y["rows"])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", nargs="+", required=True)
    p.add_argument("--n", type=int, default=12, help="questions measured (one more warms up)")
    p.add_argument("--baseline", default="1d3fdd0", help="git revision whose evaluation is today's")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per scoring forward (the CPU default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--full-length", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--two-reads", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--split", action="store_true",
                   help="also the new code with each prompt read twice, and with answers to full length")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    import peft
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="bench_answers_") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.baseline, "src"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        new, old = ROOT / "src", Path(tmp) / "src"
        print(f"CPU, {a.threads} torch thread(s); torch {torch.__version__}, transformers {transformers.__version__}, "
              f"peft {peft.__version__}; the real SmolLM2-135M (fp32); {a.n} questions of "
              f"{', '.join(Path(q).name for q in a.questions)}, {len(ROWS)} rows each ({', '.join(ROWS)}); "
              f"baseline {a.baseline}; batch {a.batch_size}\n")
        print("| setting | s / question | total s | load average (1, 5, 15 min) before -> after |\n|---|---|---|---|",
              flush=True)
        runs = {}
        split = (("new, 16 tokens, two reads", new, 16, "--two-reads"),
                 ("new, 16 tokens, full length", new, 16, "--full-length")) if a.split else ()
        for name, src, max_new, *flags in (("new, 16 tokens", new, 16), ("new, 64 tokens", new, 64),
                                           ("today (baseline), 16 tokens", old, 16), *split):
            r = runs[name] = setting(a, src, max_new, *flags)
            before, after = (", ".join(f"{v:.1f}" for v in x) for x in r["load"])
            print(f"| {name} | {r['seconds'] / r['questions']:.2f} | {r['seconds']:.1f} | {before} -> {after} |",
                  flush=True)
    n16, n64, o16 = (runs[k] for k in ("new, 16 tokens", "new, 64 tokens", "today (baseline), 16 tokens"))
    print(f"\nnew 64 / new 16 tokens: {n64['seconds'] / n16['seconds']:.3f}x; today / new at 16 tokens: "
          f"{o16['seconds'] / n16['seconds']:.2f}x")
    for what, x, y, cut in (("new vs today, 16 tokens", n16, o16, False),
                            ("new 64 vs new 16 where the 16-token answer reached a cut", n64, n16, True)):
        n, eq, d = same(x, y, cut)
        print(f"{what}: same prediction {eq}/{n} rows; max |d logprob| {d:.1e}")
    from fcprag_tools.lm.metrics import reaches_cut

    reached = sum(reaches_cut(r["generation"]) for r in n16["rows"])
    print(f"16-token answers that reached a cut: {reached}/{len(n16['rows'])}")


if __name__ == "__main__":
    main()
