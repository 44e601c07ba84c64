"""Stage 6b: every method on the test split -> ``cache/<dataset>/eval.jsonl`` (one line per question x condition
x prompt mode x method).

Conditions at K = 3 (seeded per question, the same for every method):
- ``clean``: the BM25 top-3;
- ``replace``: one retrieved passage (random position) swapped for the top-ranked passage of another test
  question (random donor), with that passage's adapter;
- ``repeat``: one retrieved passage (random position) appended a second time (n = 4; for the merge its
  weights add up, for the prompt it is listed twice).
Prompt modes: ``param`` (question only: knowledge must come from the fused adapters) and ``combine`` (the
passages also in the prompt). Per question, condition and mode, one mixed batch scores every method and the
n leave-one-out subsets (``loo:i``, PRAG's sum without passage i); the oracles then run on their deltas.
Recorded per row: merge weights, (g, tau), weight share on supporting passages, gold-answer log-likelihood,
prediction, F1, EM. Resumable per (question, condition, mode).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from common import append_jsonl, cache_dir, load_model, read_jsonl, rng, setup_logging, timed, work_dir
from fusion_eval import AdapterCache, FusionScorer, distinct
from methods import random_baseline, controller_weights, fixed_controller, learned_controllers, oracle_weights

CONDITIONS = ("clean", "replace", "repeat")
MODES = ("param", "combine")


def perturb(r: dict[str, Any], condition: str, donors: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict]:
    ps = list(r["passages"])
    if condition == "clean":
        return ps, {}
    j = rng(condition, r["id"]).randrange(len(ps))
    if condition == "repeat":
        return ps + [ps[j]], {"repeated_position": j}
    others = [d for d in donors if d["id"] != r["id"]]
    donor = rng("donor", r["id"]).choice(others)
    used = {p["pid"] for p in ps}
    cand = next(p for p in donor["passages"] if p["pid"] not in used)
    ps[j] = dict(cand, supporting=False)
    return ps, {"replaced_position": j, "donor": donor["id"], "donor_pid": cand["pid"]}


def run(dataset: str, limit: int | None, modes: tuple[str, ...] = MODES, threads: int | None = None,
        shard: tuple[int, int] = (0, 1)) -> None:
    from tqdm import tqdm

    from fcprag_plugin.encoding import TextEncoder

    rows = [r for r in read_jsonl(cache_dir(dataset) / "retrieval.jsonl") if r["split"] == "test"]
    grid = json.loads((cache_dir(dataset) / "grid.json").read_text(encoding="utf-8"))
    enc = TextEncoder(grid["encoder"])
    ctrls = random_baseline(enc.dim, enc.name)
    ctrls["fixed"] = fixed_controller(grid["best"]["g"], grid["best"]["tau"], enc.dim, enc.name)
    learned = learned_controllers(work_dir(dataset) / "controllers")
    if not learned:
        raise SystemExit(f"no trained controllers under {work_dir(dataset) / 'controllers'}: run train_stage.py first")
    for name, c in learned.items():
        if c.config.embed_dim != enc.dim:
            raise SystemExit(f"{name}: trained on {c.config.embed_dim}-d embeddings ('{c.config.embedding_model}'), "
                             f"the study encoder '{enc.name}' gives {enc.dim}-d")
    ctrls.update(learned)
    out_path = cache_dir(dataset) / "eval.jsonl"
    done = {(x["id"], x["condition"], x["mode"]) for x in read_jsonl(out_path)} if out_path.exists() else set()
    items = [(r, c, m) for r in rows[:limit] for c in CONDITIONS for m in modes]
    # a stable interleaved share of ALL items (not of what is left), so workers never overlap whatever they find done
    todo = [it for j, it in enumerate(items) if j % shard[1] == shard[0] and (it[0]["id"], it[1], it[2]) not in done]
    if not todo:
        return
    if threads:
        torch.set_num_threads(threads)
    model, tok = load_model("bfloat16")
    cache = AdapterCache(work_dir(dataset) / "adapters")
    scorer = FusionScorer(model, tok, cache.get(rows[0]["passages"][0]["pid"]))
    with timed(dataset, "evaluate", items=len(todo), modes=list(modes), methods=sorted(ctrls)):
        for r, cond, mode in tqdm(todo, desc="evaluate", unit="item"):
            ps, info = perturb(r, cond, rows)
            texts, pids = [p["text"] for p in ps], [p["pid"] for p in ps]
            sup = torch.tensor([float(p["supporting"]) for p in ps])
            n = len(ps)
            e = enc.encode([r["question"]] + texts)
            named: list[tuple[str, torch.Tensor, dict[str, float]]] = [
                ("prag_sum", torch.ones(n), {}), ("average", torch.full((n,), 1.0 / n), {})]
            for name, c in ctrls.items():
                cw = controller_weights(c, e[0], e[1:])
                named.append((name, cw["w_tilde"], {"g": cw["g"], "tau": cw["tau"]}))
            for i in range(n):
                w = torch.ones(n)
                w[i] = 0.0
                named.append((f"loo:{i}", w, {}))
            results = _score(scorer, cache, r, texts, pids, mode, named)
            by = {nm: res for (nm, _, _), res in zip(named, results)}
            oracles = []
            for metric in ("logprob", "f1"):
                full = getattr(by["prag_sum"], metric)
                deltas = torch.tensor([full - getattr(by[f"loo:{i}"], metric) for i in range(n)])
                oracles.append((f"oracle:{metric}", oracle_weights(deltas), {}))
            named += oracles
            results += _score(scorer, cache, r, texts, pids, mode, oracles)
            lines = []
            for (name, w, extra), res in zip(named, results):
                share = float((w * sup).sum() / w.sum()) if float(w.sum()) > 0 else float("nan")
                lines.append({"id": r["id"], "condition": cond, "mode": mode, "method": name, "n": n,
                              "w_tilde": [round(float(x), 5) for x in w], "supporting": sup.tolist(),
                              "share_supporting": round(share, 5), **{k: round(v, 5) for k, v in extra.items()},
                              "logprob": round(res.logprob, 5), "prediction": res.prediction, "f1": round(res.f1, 5),
                              "em": res.em, **info})
            append_jsonl(out_path, lines)
    scorer.slot.remove()


def _score(scorer: FusionScorer, cache: AdapterCache, r: dict[str, Any], texts: list[str], pids: list[str], mode: str,
           named: list[tuple[str, torch.Tensor, dict]]) -> list[Any]:
    W = torch.stack([w for _, w, _ in named])
    order, Wd = distinct(pids, W)
    return scorer.score(r["question"], texts, r["answer"], mode, [cache.get(p) for p in order], Wd)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--limit", type=int, default=None, help="only the first N test questions (a trial run)")
    p.add_argument("--mode", action="append", choices=MODES,
                   help="only these prompt modes (default: both); e.g. one worker per mode, 1 thread each")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shard", default="0/1", help="K/N: this worker takes every N-th remaining item from K (parallel "
                   "workers append to the same file under a lock)")
    a = p.parse_args(argv)
    setup_logging()
    k, n = (int(x) for x in a.shard.split("/"))
    if not 0 <= k < n:
        raise SystemExit(f"--shard {a.shard}: expected K/N with 0 <= K < N")
    run(a.dataset, a.limit, tuple(a.mode or MODES), a.threads, (k, n))


if __name__ == "__main__":
    main()
