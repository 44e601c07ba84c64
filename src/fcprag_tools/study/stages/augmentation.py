"""The augmentation stage: PRAG's rewrites and question-answer pairs of every passage, by the model
(``augment.jsonl``, a row a passage)."""

from __future__ import annotations

import time
from typing import Any

from ...progress import moves_inside
from ..augment import augment_batch
from ..options import Batching, Generation
from ..run import StudyRun
from .retrieval import Questions


def augment_passages(run: StudyRun, qs: Questions, gen: Generation, batching: Batching) -> dict[str, dict[str, Any]]:
    """Augment each passage of ``qs`` not augmented yet, shortest first, ``batching.aug_batch`` per generate call
    (this rank's share under a launcher), ``gen.aug_max_new_tokens`` at most; returns ``{pid: augmentation row}`` of
    every passage."""
    t0 = time.perf_counter()
    st = run.store("augment")
    done = st.done()
    texts = {p["pid"]: p["text"] for q in qs.values() for p in q["passages"]}
    todo = sorted((pid for pid in texts if pid not in done), key=lambda p: (len(texts[p]), p))
    run.kept("augmentation", len(texts), len(texts) - len(todo), "passages")
    mine = run.mine(todo)  # shard units first: each rank sizes its batches for its own device
    per = (batching.aug_batch or run.sizes().aug_batch) if mine else 1
    batches = [mine[i:i + per] for i in range(0, len(mine), per)]
    run.barrier()
    if batches:
        run.load_model()
        with run.bar("augment", len(texts), len(texts) - len(todo), "passage", sum(map(len, batches)),
                     fraction=True) as bar:
            for b in batches:
                step, finish = moves_inside(bar, len(b), gen.aug_max_new_tokens)  # a step per token
                st.append(augment_batch(run.model, run.tok, [(p, texts[p]) for p in b], gen.aug_max_new_tokens,
                                        on_step=step))
                finish()
    run.barrier("augment")
    run.timed("augment", t0, passages=sum(map(len, batches)), device=run.device())
    return run.store("augment").done()
