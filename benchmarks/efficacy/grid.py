"""Stage 6a: the best fixed calibration (g, tau) on the train split -> ``cache/<dataset>/grid.json``.

Cosine scores ``s_i = (1 + cos(e_q, e_p_i)) / 2`` with a fixed gate ``g`` and temperature ``tau`` (no learning),
for g in {0.25, 0.5, 0.75, 1} x tau in {0.05, 0.1, 0.2, 0.5, 1, 2}, plus g = 0 (PRAG's uniform sum). Objective:
the mean gold-answer log-likelihood with the ``param`` prompt over the train questions (teacher forcing only,
no generation). All grid points of a question run in one mixed batch.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from common import cache_dir, load_model, read_jsonl, setup_logging, timed, work_dir, write_json
from fusion_eval import AdapterCache, FusionScorer, distinct
from methods import FIXED_G, FIXED_TAU, controller_weights, fixed_controller


def run(dataset: str, limit: int | None) -> None:
    from tqdm import tqdm

    from fcprag_plugin.encoding import TextEncoder

    rows = [r for r in read_jsonl(cache_dir(dataset) / "retrieval.jsonl") if r["split"] == "train"][:limit]
    enc = TextEncoder()
    points = [(0.0, 1.0)] + list(itertools.product(FIXED_G, FIXED_TAU))
    ctrls = [fixed_controller(g, t, enc.dim, enc.name) for g, t in points]
    model, tok = load_model("bfloat16")
    cache = AdapterCache(work_dir(dataset) / "adapters")
    scorer = FusionScorer(model, tok, cache.get(rows[0]["passages"][0]["pid"]))
    sums = torch.zeros(len(points))
    with timed(dataset, "grid", questions=len(rows), points=len(points)):
        for r in tqdm(rows, desc="grid", unit="question"):
            texts = [p["text"] for p in r["passages"]]
            pids = [p["pid"] for p in r["passages"]]
            e = enc.encode([r["question"]] + texts)
            W = torch.stack([controller_weights(c, e[0], e[1:])["w_tilde"] for c in ctrls])
            order, Wd = distinct(pids, W)
            res = scorer.score(r["question"], texts, r["answer"], "param", [cache.get(p) for p in order], Wd,
                               generate=False)
            sums += torch.tensor([x.logprob for x in res])
    means = (sums / len(rows)).tolist()
    best = max(range(len(points)), key=lambda i: means[i])
    write_json(cache_dir(dataset) / "grid.json", {
        "objective": "mean gold-answer log-likelihood, param prompt, train split", "questions": len(rows),
        "encoder": enc.name, "points": [{"g": g, "tau": t, "mean_logprob": round(m, 5)}
                                        for (g, t), m in zip(points, means)],
        "best": {"g": points[best][0], "tau": points[best][1], "mean_logprob": round(means[best], 5)},
    })
    scorer.slot.remove()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--limit", type=int, default=None)
    a = p.parse_args(argv)
    setup_logging()
    run(a.dataset, a.limit)


if __name__ == "__main__":
    main()
