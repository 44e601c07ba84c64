"""The adapters stage: a PRAG-recipe LoRA adapter per passage, trained in stacked groups (``adapters/<pid>/``,
``adapters.jsonl``: a row an adapter)."""

from __future__ import annotations

import time
from typing import Any

from ...progress import moves_inside
from .. import adapters as ad
from ..augment import forward_steps
from ..options import Batching
from ..run import StudyRun
from .retrieval import Questions


def train_adapters(run: StudyRun, qs: Questions, augs: dict[str, dict[str, Any]], batching: Batching) -> None:
    """Train and save the adapter of every passage of ``qs`` that has none saved yet, from its augmentation in
    ``augs`` (samples of ``batching.max_tokens``), ``batching.group`` at a time (passages of similar sample lengths
    together)."""
    t0 = time.perf_counter()
    st = run.store("adapters")
    folder = run.out / "adapters"
    done = {pid for pid in st.done() if (folder / pid / "adapter_model.safetensors").is_file()}
    pids = list(dict.fromkeys(p["pid"] for q in qs.values() for p in q["passages"]))
    todo = [p for p in pids if p not in done]
    run.kept("adapters", len(pids), len(pids) - len(todo), "adapters")
    if todo:
        run.load_model()
    samples = {p: ad.samples_for(run.tok, augs[p], batching.max_tokens) for p in todo}
    todo.sort(key=lambda p: (max(len(s[0]) for s in samples[p].values()), p))  # similar lengths per step
    mine = run.mine(todo)
    group = (batching.group or run.sizes().group) if mine else 1
    groups = [mine[i:i + group] for i in range(0, len(mine), group)]
    run.barrier()
    config = dict(ad.LORA, task_type="CAUSAL_LM", base_model_name_or_path=run.lm.model)
    with run.bar("adapters", len(pids), len(pids) - len(todo), "adapter", sum(map(len, groups)),
                 fraction=True) as bar:
        for g in groups:
            tg = time.perf_counter()
            seeds = [ad.seed_of(p) for p in g]
            step, finish = moves_inside(bar, len(g), len({k for p in g for k in samples[p]}))  # a step per kind
            with forward_steps(run.model.get_decoder(), step):
                ml, stats = ad.train_stacked(run.model, run.tok, [samples[p] for p in g], seeds)
            secs = round(time.perf_counter() - tg, 3)
            for b, p in enumerate(g):
                ad.save_adapter(ml.adapter(b, config), folder / p)
            st.append([{"id": p, "seed": seeds[b], **stats[b], "group": len(g), "group_seconds": secs}
                       for b, p in enumerate(g)])
            finish()
    run.barrier("adapters")
    run.timed("adapters", t0, adapters=sum(map(len, groups)), group=group, device=run.device())
