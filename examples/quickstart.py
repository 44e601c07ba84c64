"""fcprag-plugin quickstart (what `make demo` runs): uniform vs weighted fusion of real passage adapters, offline.

For each demo question (``adapters/demo/manifest.json``: 3 HotpotQA questions, 3 BM25-retrieved passages each,
one LoRA per passage for SmolLM2-135M-Instruct), it fuses the passage adapters

- with PRAG's uniform merge (``controller=None``: ``w~ = [1, 1, 1]``),
- with a controller *trained right here* (minutes, with progress bars; see docs/demo.md's timings) with
  ``fcprag_plugin.training.train_controller`` and the efficacy study's recommended recipe (``RECIPE``) from the
  shipped label file ``examples/data/efficacy_train_labels.jsonl.gz``: the study's leave-one-out labels of 126
  HotpotQA and 2WikiMultihopQA training questions (``benchmarks/efficacy/``; the demo questions are in its test
  split), with the passages' retrieval ranks, BM25 scores and adapter statistics. The training prints its
  cross-validated verdict and the numbers of the objective that decides it. The controller is kept in
  ``runs/demo-controller/`` with ``demo_key.json`` (the label file's sha256, the training arguments, the encoder
  and the library version): a later run with the same key reuses it instead of training again (``--retrain``
  forces a new one). ``adapters/demo/controller/``, when present, is used instead; ``--no-train`` skips training;
- with a *fixed cosine baseline* (one global g and tau, scores ``(1 + cos(e_q, e_p)) / 2``; not trained),
- with a seeded random (untrained) controller, for contrast,

and prints the merge weights ``w~``, the gate g and temperature tau, and the greedy answers of each fused model
next to the base model's answer (no adapter). The question is asked without the passages in the prompt, so the
knowledge has to come from the adapters (parametric RAG). Each fused adapter is applied with forward hooks
(``fcprag_plugin.activate``) and removed afterwards; the base weights are checked to be unchanged.

Run: ``.venv/latest/bin/python examples/quickstart.py [--no-train | --retrain]`` (or ``make demo ARGS=...``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demo_common when run as a script

from demo_common import (  # noqa: E402
    DEMO_DIR,
    MODEL_PACKAGE,
    SMOLLM2,
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
LABELS = Path(__file__).resolve().parent / "data" / "efficacy_train_labels.jsonl.gz"

# ======================================================================================= THE DEMO'S TRAINING RECIPE
# The one place that says how the demo trains its controller: every train_controller argument but the paths and
# the encoder. The recommended recipe (docs/results/efficacy-fresh-plan.md, docs/training.md): the
# risk objective, kappa chosen on the labels' measured scales, the side features the hosts can supply (retrieval
# rank, adapter statistics); nested CV trains at most 3 epochs. The demo keeps the learned network
# (keep_network) to show what it does: `fcprag train`'s default saves scale-only, since the network's reweighting
# part is first order, not a measurement. A change here changes demo_key.json, so the next demo trains again.
RECIPE: dict[str, Any] = {"objective": "risk", "kappa": "auto", "epochs": 3, "keep_network": True,
                          "side_features": ["retrieval_rank", "adapter_stats"], "seed": 0}
# ==================================================================================================================

TRAIN_OUT = Path(__file__).resolve().parent.parent / "runs" / "demo-controller"
KEY_NAME = "demo_key.json"  # beside the controller: what it was trained from (see demo_key)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def demo_key(labels: Path, encoder: Any) -> dict[str, Any]:
    """What a trained demo controller depends on: the label file's bytes, the training arguments, the embedding
    model and the library's version. The same key means the same controller: it is reused, not trained again."""
    import fcprag_plugin

    return {"labels": labels.name, "labels_sha256": file_sha256(labels), "train_args": RECIPE,
            "encoder": encoder.name, "fcprag_plugin": fcprag_plugin.__version__}


def reusable(out_dir: Path, key: dict[str, Any]) -> bool:
    """``out_dir`` holds a finished controller trained for ``key`` (and metrics of the training records: a run of
    a version with a validation split trains again)."""
    try:
        saved = json.loads((out_dir / KEY_NAME).read_text(encoding="utf-8"))
        metrics = json.loads((out_dir / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return saved == key and (out_dir / "config.json").is_file() and "train" in metrics


def train_demo_controller(encoder: Any, labels: Path = LABELS, out_dir: Path = TRAIN_OUT, out=print,
                          cache_dir: str | None = "", progress: bool = False, retrain: bool = False) -> Any:
    """The demo's controller: the one in ``out_dir`` when its ``demo_key.json`` matches (and not ``retrain``), else
    one trained now on ``labels`` with ``RECIPE``. Prints the cross-validated verdict and the deciding objective.

    ``cache_dir``: the embedding cache; ``""`` (the default here, for tests) none, ``None`` the library's default
    ($FCPRAG_CACHE_DIR or ~/.cache/fcprag/embeddings), which `make demo` uses: a second training, or a later
    `fcprag train` on the same labels, then does not encode the texts again. ``progress``: the trainer's bars.
    """
    from fcprag_plugin import FusionController
    from fcprag_plugin.fileio import write_json
    from fcprag_plugin.training import train_controller
    from fcprag_tools.train_report import train_table

    key = demo_key(labels, encoder)
    if not retrain and reusable(out_dir, key):
        ctrl = FusionController.from_pretrained(out_dir)
        metrics = json.loads((out_dir / "metrics.json").read_text(encoding="utf-8"))
        out(f"reusing the controller in {out_dir}, trained earlier from the same inputs ({KEY_NAME}: "
            f"{labels.name} sha256 {key['labels_sha256'][:12]}..., the recipe, {encoder.name}, fcprag-plugin "
            f"{key['fcprag_plugin']}); --retrain trains a new one")
        for line in train_table(metrics).splitlines():  # the table the training printed, as it saved it
            out(f"  {line}")
    else:
        (out_dir / KEY_NAME).unlink(missing_ok=True)  # an interrupted training must not look finished
        out(f"training a controller on {labels.name} (recipe: {describe_recipe()}); progress below")
        t0 = time.perf_counter()
        res = train_controller(str(labels), out_dir, encoder=encoder, overwrite=True, progress=progress,
                               cache_dir=cache_dir, **RECIPE)
        out(f"trained a controller on {labels.name} ({res.n_train} training queries) "
            f"in {time.perf_counter() - t0:.0f}s -> {out_dir}")
        for line in train_table(res.metrics).splitlines():
            out(f"  {line}")
        write_json(out_dir / KEY_NAME, key)
        ctrl, metrics = res.controller, res.metrics
    for line in deciding_objective(ctrl, labels, encoder, metrics, cache_dir):
        out(f"  {line}")
    return ctrl


def describe_recipe() -> str:
    return ", ".join(f"{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in RECIPE.items())


def deciding_objective(ctrl: Any, labels: Path, encoder: Any, metrics: dict[str, Any],
                       cache_dir: str | None) -> list[str]:
    """Lines that say which objective decides (the recipe's training objective and the verdict's held-out gain)
    and print its numbers for the learned controller, uniform and random on the training records, side by side (in
    sample: the verdict is the held-out figure).

    The table above also shows KL, the paper's objective; with ``objective='risk'`` a learned KL above uniform's
    is expected and says nothing about the verdict.
    """
    from fcprag_plugin.training import load_labels
    from fcprag_plugin.labels import drop_held_out
    from fcprag_plugin.training.targets import first_order_gain, risk_objective
    from fcprag_tools.evaluate import evaluate_controller

    records = drop_held_out(load_labels(labels).records, str(labels))  # what the trainer trained on
    ev = evaluate_controller(ctrl, records, encoder=encoder, cache_dir=cache_dir)
    objective, lam = metrics["objective"], metrics.get("risk_lambda")
    gain = "sum_i (w~_i - 1) delta_i"
    rows: list[tuple[str, dict[str, float]]] = [(f"gain  {gain}", {})]
    verdict = ("the verdict above is the held-out gain of nested CV: a scale part (measured on the labels' "
               f"scales) plus a reweighting part (first order, {gain.replace('- 1', '- T')})")
    kappa = float(getattr(ctrl.config, "kappa", 1.0))
    if objective == "risk":
        lines = [f"what decides: the recipe trains the network on the risk objective J = {gain} - lambda",
                 f"  sum_i (w~_i - 1)^2 (lambda {lam:.4f}, higher is better) of its weights at PRAG's total, before "
                 f"kappa ({kappa:g}, chosen on measured scales), and {verdict};",
                 "  KL, the paper's objective (the kl rows above), decides neither. Uniform scores 0 on both; the rows "
                 "below are the weights divided by kappa."]
        rows.append((f"risk  J (lambda {lam:.4f})", {}))
    else:
        lines = ["what decides: the recipe trains on KL to softmax(delta / T) (the kl rows above, lower is better),",
                 f"  and {verdict} (uniform: 0)."]
        rows.append(("kl    KL(y || w)", {}))
    for name, o in ev.outputs.items():
        wt = o["wt"].to(torch.float64) / (kappa if name == next(iter(ev.outputs)) else 1.0)
        rows[0][1][name] = float(first_order_gain(wt, ev.data.deltas, ev.data.mask).mean())
        rows[1][1][name] = (float(risk_objective(wt, ev.data.deltas, ev.data.mask, lam).mean())
                            if objective == "risk" else ev.metrics[name]["kl"])
    names = list(ev.outputs)
    width = max(len(r[0]) for r in rows)
    lines.append(f"on the {len(records)} training records, in sample (mean per record):")
    lines.append(f"  {'':<{width}}" + "".join(f" {n:>10}" for n in names))
    for label, vals in rows:
        lines.append(f"  {label:<{width}}" + "".join(f" {vals[n]:>+10.4f}" for n in names))
    return lines


def build_methods(demo_dir: Path, encoder: Any, *, train: bool = True, out=print, train_out: Path = TRAIN_OUT,
                  cache_dir: str | None = "", progress: bool = False, retrain: bool = False
                  ) -> list[tuple[str, Any]]:
    """(label, controller) pairs; ``None`` is the uniform merge."""
    from fcprag_plugin import FusionController

    methods: list[tuple[str, Any]] = [("uniform (PRAG)", None)]
    ctrl_dir = demo_dir / "controller"
    if ctrl_dir.is_dir():
        # fused with the embedding model it was trained with (its config.json), whatever `encoder` is
        methods.append((f"trained controller ({ctrl_dir.name}/)", FusionController.from_pretrained(ctrl_dir)))
    elif train:
        ctrl = train_demo_controller(encoder, out_dir=train_out, out=out, cache_dir=cache_dir, progress=progress,
                                     retrain=retrain)
        methods.append((f"learned controller (trained on {LABELS.name})", ctrl))
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
        train_out: Path = TRAIN_OUT, cache_dir: str | None = "", progress: bool = False,
        retrain: bool = False) -> list[dict[str, Any]]:
    """Run the demo; print with ``out``; return one record per question (weights and answers per method).

    ``model``/``tokenizer``/``encoder`` default to SmolLM2 and the shared default encoder (passed in by the
    tests); a controller trained with another embedding model is fused with its own.
    """
    from fcprag_plugin import LoraAdapter, fuse
    from fcprag_plugin.encoding import get_encoder
    from fcprag_plugin import activate

    timer = PartTimer(out)
    manifest = load_manifest(demo_dir)
    out(f"loading the model and the embedding model (load average {load_average()}) ...")
    model, tok = (model, tokenizer) if model is not None else load_model()
    timer.lap("model load")
    # The paper's bge-base when cached locally, else the packaged all-MiniLM-L6-v2 (offline).
    encoder = encoder if encoder is not None else get_encoder()
    timer.lap("encoder load")
    methods = build_methods(Path(demo_dir), encoder, train=train, out=out, train_out=train_out, cache_dir=cache_dir,
                            progress=progress, retrain=retrain)
    timer.lap("controller" if train else "controllers (no training)")
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out(f"model: {model_line(manifest)}, encoder: {encoder.name} ({encoder.dim}-d); model, encoder and "
        f"controllers ready after {timer.total()[0]:.0f}s")
    out("The question is asked WITHOUT the passages in the prompt: knowledge must come from the adapters.")

    records = []
    for qi, q in enumerate(manifest["questions"][:questions]):
        passages = [p["text"] for p in q["passages"]]
        adapters = [LoraAdapter.from_pretrained(p["adapter_path"]) for p in q["passages"]]
        out(f"question {qi + 1}: generating {len(methods) + 1} greedy answers (base model and each fusion) ...")
        base_answer = generate_answer(model, tok, q["question"], max_new_tokens)
        results = []
        for label, ctrl in methods:
            own = ctrl is not None and ctrl.config.embedding_model not in (None, encoder.name)
            res = fuse(adapters, q["question"], passages, controller=ctrl, encoder=None if own else encoder,
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
    timer.lap(f"{len(records)} questions x {len(methods) + 1} greedy answers")
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, snapshot[k])]
    out(f"base model weights unchanged after all fusions: {'yes' if not changed else 'NO: ' + ', '.join(changed[:3])}")
    out(timer.summary())
    if changed:
        raise SystemExit("a fusion changed the base model's weights")
    return records


def model_line(manifest: dict[str, Any]) -> str:
    """The demo model, named as the tools take it offline: ``--model smollm2`` (a hub name such as the manifest's
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` is not on this machine)."""
    m = manifest["model"]
    return (f"{m['name'].rpartition('/')[2]} offline ({m['gguf_file']} from the {m.get('package', MODEL_PACKAGE)} "
            f"package; `--model {SMOLLM2}` in fcprag study and fcprag labels build)")


def load_average() -> str:
    """The machine's 1-minute load average (``os.getloadavg``; "n/a" where the OS has none): wall times mean little
    without it on a shared machine."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):  # Windows has no load average
        return "n/a"


class PartTimer:
    """Wall and CPU seconds (this process, all its threads) of consecutive parts of the demo, each said with the
    load average as it ends (``out``) and all again at the end; docs/demo.md's timings come from it. CPU seconds say
    how much work a part is whatever else the machine runs."""

    def __init__(self, out=print) -> None:
        self.start = self.last = (time.perf_counter(), time.process_time())
        self.parts: dict[str, tuple[float, float]] = {}
        self.out = out

    def lap(self, name: str) -> None:
        now = (time.perf_counter(), time.process_time())
        self.parts[name] = (now[0] - self.last[0], now[1] - self.last[1])
        self.last = now
        self.out(f"[{name}: {self.parts[name][0]:.0f}s wall, {self.parts[name][1]:.0f}s CPU, load {load_average()}]")

    def total(self) -> tuple[float, float]:
        return time.perf_counter() - self.start[0], time.process_time() - self.start[1]

    def summary(self) -> str:
        wall, cpu = self.total()
        return (f"total time: {wall:.0f}s wall, {cpu:.0f}s CPU, load {load_average()} at the end (" +
                ", ".join(f"{k} {w:.0f}s / {c:.0f}s CPU" for k, (w, c) in self.parts.items()) + ")")


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
    return "tau -" if tau is None else f"t {tau:.3f}"  # None: uniform weights have no temperature


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fcprag-plugin offline demo: uniform vs weighted adapter fusion")
    p.add_argument("--demo-dir", default=str(DEMO_DIR), help="folder with manifest.json and the adapters")
    p.add_argument("--questions", type=int, default=None, help="only the first N questions")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--no-train", action="store_true",
                   help="no learned controller: neither train one nor reuse runs/demo-controller")
    p.add_argument("--retrain", action="store_true",
                   help="train the controller again even when runs/demo-controller was trained from the same inputs")
    args = p.parse_args(argv)
    if args.no_train and args.retrain:
        p.error("--no-train and --retrain contradict each other; pass one")
    configure_stdout()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from fcprag_tools.lm.model_io import choose_threads

    threads, why = choose_threads(option="OMP_NUM_THREADS=N")  # under load 1 thread is several times faster than 2
    torch.set_num_threads(threads)
    print(f"torch threads: {threads} ({why})")
    try:  # quieter model loading (transformers' own bars and deprecation notes; the trainer's bars stay on)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    try:
        run(Path(args.demo_dir), questions=args.questions, max_new_tokens=args.max_new_tokens,
            train=not args.no_train, cache_dir=None, progress=True, retrain=args.retrain)
    except DemoModelError as e:
        raise SystemExit(str(e)) from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
