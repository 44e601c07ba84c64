"""fcprag-plugin quickstart (what `make demo` runs): uniform vs weighted fusion of real passage adapters, offline.

For each demo question (``adapters/demo/manifest.json``: 3 HotpotQA questions, 3 BM25-retrieved passages each,
one LoRA per passage for SmolLM2-135M-Instruct), it fuses the passage adapters

- with PRAG's uniform merge (``controller=None``: ``w~ = [1, 1, 1]``),
- with a controller *trained right here* (a minute or two) with ``fcprag_plugin.training.train_controller`` and
  the efficacy study's recommended recipe (``RECIPE``) from the shipped label file
  ``examples/data/efficacy_train_labels.jsonl``: the study's leave-one-out labels of 126 HotpotQA and
  2WikiMultihopQA training questions (``benchmarks/efficacy/``; the demo questions are in its test split), with
  the passages' retrieval ranks, BM25 scores and adapter statistics. The training prints its cross-validated
  verdict. ``adapters/demo/controller/``, when present, is used instead; ``--no-train`` skips training;
- with a *fixed cosine baseline* (one global g and tau, scores ``(1 + cos(e_q, e_p)) / 2``; not trained),
- with a seeded random (untrained) controller, for contrast,

and prints the merge weights ``w~``, the gate g and temperature tau, and the greedy answers of each fused model
next to the base model's answer (no adapter). The question is asked without the passages in the prompt, so the
knowledge has to come from the adapters (parametric RAG). Each fused adapter is applied with forward hooks
(``fcprag_plugin.activate``) and removed afterwards; the base weights are checked to be unchanged.

Run: ``.venv/latest/bin/python examples/quickstart.py`` (or ``make demo``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before tqdm is first imported (it reads TQDM_* once): no model-loading bars
    os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demo_common when run as a script

from demo_common import (  # noqa: E402
    DEMO_DIR,
    DemoModelError,
    configure_stdout,
    generate_answer,
    load_manifest,
    load_model,
)

# Hand-picked illustration values for the untrained fixed baseline (not tuned on any data).
FIXED_G = 0.5
FIXED_TAU = 0.05
RANDOM_SEED = 0
LABELS = Path(__file__).resolve().parent / "data" / "efficacy_train_labels.jsonl"
# The efficacy study's recommended recipe (its configuration chosen by grouped CV on the training labels alone,
# benchmarks/efficacy/controller/config.json): the risk objective, a global scale tuned on the labels, and the
# passages' side features; CV trains at most 3 epochs (docs/results/efficacy-plan.md).
RECIPE: dict[str, Any] = {"objective": "risk", "kappa": "auto", "epochs": 3,
                          "side_features": ["retrieval_rank", "retrieval_score", "adapter_stats"]}
TRAIN_OUT = Path(__file__).resolve().parent.parent / "runs" / "demo-controller"


def train_demo_controller(encoder: Any, labels: Path = LABELS, out_dir: Path = TRAIN_OUT, out=print,
                          cache_dir: str | None = "") -> Any:
    """Train a controller on the shipped label file (``RECIPE``, seed 0) and return it.

    ``cache_dir``: the embedding cache; ``""`` (the default here, for tests) none, ``None`` the library's default
    ($FCPRAG_CACHE_DIR or ~/.cache/fcprag/embeddings), which `make demo` uses: a second demo, or a later
    `fcprag train` on the same labels, then does not encode the texts again.
    """
    from fcprag_plugin.training import train_controller

    t0 = time.perf_counter()
    res = train_controller(str(labels), out_dir, encoder=encoder, overwrite=True, progress=False, seed=0,
                           cache_dir=cache_dir, **RECIPE)
    out(f"trained a controller on {labels.name} ({res.n_train} train / {res.n_val} validation queries) "
        f"in {time.perf_counter() - t0:.0f}s -> {out_dir}")
    for line in res.table.splitlines():
        out(f"  {line}")
    return res.controller


def build_methods(demo_dir: Path, encoder: Any, *, train: bool = True, out=print,
                  train_out: Path = TRAIN_OUT, cache_dir: str | None = "") -> list[tuple[str, Any]]:
    """(label, controller) pairs; ``None`` is the uniform merge."""
    from fcprag_plugin import FusionController

    methods: list[tuple[str, Any]] = [("uniform (PRAG)", None)]
    ctrl_dir = demo_dir / "controller"
    if ctrl_dir.is_dir():
        ctrl = FusionController.from_pretrained(ctrl_dir)
        if ctrl.config.embed_dim != encoder.dim:
            out(f"note: {ctrl_dir} expects {ctrl.config.embed_dim}-d embeddings ({ctrl.config.embedding_model}) "
                f"but the encoder '{encoder.name}' gives {encoder.dim}-d; not using it")
        else:
            methods.append((f"trained controller ({ctrl_dir.name}/)", ctrl))
    elif train:
        ctrl = train_demo_controller(encoder, out_dir=train_out, out=out, cache_dir=cache_dir)
        methods.append((f"learned controller (trained now on {LABELS.name})", ctrl))
    methods.append((f"fixed cosine baseline, g={FIXED_G} tau={FIXED_TAU} (not trained)",
                    FusionController.fixed(g=FIXED_G, tau=FIXED_TAU, embed_dim=encoder.dim, scorer="cosine",
                                           embedding_model=encoder.name)))
    methods.append((f"random controller (seed {RANDOM_SEED}, untrained)",
                    FusionController.random(embed_dim=encoder.dim, seed=RANDOM_SEED, embedding_model=encoder.name)))
    return methods


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def contains_gold(answer: str, gold: str) -> bool:
    """Loose check for display: the normalized gold answer occurs in the normalized generated answer."""
    g = _norm(gold)
    return bool(g) and f" {g} " in f" {_norm(answer)} "


def run(demo_dir: Path = DEMO_DIR, *, questions: int | None = None, max_new_tokens: int = 20, out=print,
        model: Any = None, tokenizer: Any = None, encoder: Any = None, train: bool = True,
        train_out: Path = TRAIN_OUT, cache_dir: str | None = "") -> list[dict[str, Any]]:
    """Run the demo; print with ``out``; return one record per question (weights and answers per method).

    ``model``/``tokenizer``/``encoder`` default to SmolLM2 and ``TextEncoder()`` (passed in by the tests).
    """
    from fcprag_plugin import LoraAdapter, TextEncoder, fuse
    from fcprag_plugin import activate

    t0 = time.perf_counter()
    timing: dict[str, float] = {}  # seconds per part, printed at the end (README's demo figures come from it)
    manifest = load_manifest(demo_dir)
    model, tok = (model, tokenizer) if model is not None else load_model()
    timing["model load"] = time.perf_counter() - t0
    # The paper's bge-base when cached locally, else the packaged all-MiniLM-L6-v2 (offline).
    encoder = encoder if encoder is not None else TextEncoder()
    timing["encoder load"] = time.perf_counter() - t0 - sum(timing.values())
    methods = build_methods(Path(demo_dir), encoder, train=train, out=out, train_out=train_out, cache_dir=cache_dir)
    timing["controller training"] = time.perf_counter() - t0 - sum(timing.values())
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out(f"model: {manifest['model']['name']} ({manifest['model']['gguf_file']}), encoder: {encoder.name} "
        f"({encoder.dim}-d); model, encoder and controllers ready after {time.perf_counter() - t0:.0f}s")
    out("The question is asked WITHOUT the passages in the prompt: knowledge must come from the adapters.")

    records = []
    for qi, q in enumerate(manifest["questions"][:questions]):
        passages = [p["text"] for p in q["passages"]]
        adapters = [LoraAdapter.from_pretrained(p["adapter_path"]) for p in q["passages"]]
        base_answer = generate_answer(model, tok, q["question"], max_new_tokens)
        results = []
        for label, ctrl in methods:
            res = fuse(adapters, q["question"], passages, controller=ctrl, encoder=encoder,
                       retrieval_ranks=[p["rank"] for p in q["passages"]],
                       retrieval_scores=[p["bm25_score"] for p in q["passages"]])
            with activate(model, res.adapter):
                answer = generate_answer(model, tok, q["question"], max_new_tokens)
            results.append((label, res, answer))
        cos = torch.mv(encoder.encode(passages), encoder.encode([q["question"]])[0]).tolist()
        record = {"id": q["id"], "question": q["question"], "gold_answer": q["gold_answer"],
                  "base_answer": base_answer, "cosine": cos,
                  "methods": [{"label": lb, "merge_weights": r.merge_weights, "g": r.g, "tau": r.tau,
                               "scores": r.scores, "answer": a} for lb, r, a in results]}
        records.append(record)
        print_question(qi, q, record, out)
    timing[f"{len(records)} questions x {len(methods) + 1} greedy answers"] = time.perf_counter() - t0 - sum(
        timing.values())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, snapshot[k])]
    out(f"base model weights unchanged after all fusions: {'yes' if not changed else 'NO: ' + ', '.join(changed[:3])}")
    out(f"total time: {time.perf_counter() - t0:.0f}s (" + ", ".join(f"{k} {v:.0f}s" for k, v in timing.items()) + ")")
    if changed:
        raise SystemExit("a fusion changed the base model's weights")
    return records


def print_question(qi: int, q: dict[str, Any], rec: dict[str, Any], out=print) -> None:
    methods = rec["methods"]
    short = [f"M{j + 1}" for j in range(len(methods))]
    width = 44
    out("")
    out("=" * 100)
    out(f"Q{qi + 1} [{q['id']}] {q['question']}")
    out(f"gold answer (shown for reference only, never trained on): {q['gold_answer']}")
    for s, m in zip(short, methods):
        out(f"  {s} = {m['label']}")
    head = f"  {'#':<2} {'passage (BM25 rank order)':<{width}} {'role':<10} {'cos':>6}"
    out(head + "".join(f" {'w~ ' + s:>8}" for s in short))
    for i, p in enumerate(q["passages"]):
        title = p["title"] if len(p["title"]) <= width else p["title"][: width - 3] + "..."
        kind = "support" if p["supporting"] else "distract"
        row = f"  {i + 1:<2} {title:<{width}} {kind:<10} {rec['cosine'][i]:>6.3f}"
        out(row + "".join(f" {m['merge_weights'][i]:>8.4f}" for m in methods))
    pad = " " * (5 + width + 1 + 10 + 1 + 6)
    out(pad + "".join(f" {'g ' + format(m['g'], '.3f'):>8}" for m in methods))
    out(pad + "".join(f" {_fmt_tau(m['tau']):>8}" for m in methods))
    for s, m in zip(short, methods):
        spread = max(abs(w - 1.0) for w in m["merge_weights"])
        if m["g"] > 0 and spread < 1e-2:  # e.g. the untrained random net: its scores are all close to 0.5
            out(f"  note: {s}'s weights are within {spread:.1e} of uniform (its scores are nearly equal), "
                "so it behaves almost like M1 (uniform)")
    out("  answers (greedy):")
    rows = [("base model, no adapter", rec["base_answer"])] + [(f"{s} {m['label']}", m["answer"])
                                                              for s, m in zip(short, methods)]
    lw = max(len(r[0]) for r in rows)
    for label, ans in rows:
        mark = "  [contains gold]" if contains_gold(ans, q["gold_answer"]) else ""
        out(f"    {label:<{lw}} : {ans!r}{mark}")


def _fmt_tau(tau: float) -> str:
    return "tau -" if tau != tau else f"t {tau:.3f}"  # NaN: the uniform merge has no temperature


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fcprag-plugin offline demo: uniform vs weighted adapter fusion")
    p.add_argument("--demo-dir", default=str(DEMO_DIR), help="folder with manifest.json and the adapters")
    p.add_argument("--questions", type=int, default=None, help="only the first N questions")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--no-train", action="store_true", help="do not train a controller from the shipped labels")
    args = p.parse_args(argv)
    configure_stdout()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:  # quieter model loading (progress bars, deprecation notes)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    try:
        run(Path(args.demo_dir), questions=args.questions, max_new_tokens=args.max_new_tokens,
            train=not args.no_train, cache_dir=None)
    except DemoModelError as e:
        raise SystemExit(str(e)) from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
