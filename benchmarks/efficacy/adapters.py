"""Stage 3: one LoRA adapter per retrieved passage (PRAG's recipe) -> ``work/<dataset>/adapters/<pid>/``.

Recipe: PEFT-format LoRA r = 2, alpha = 32 on gate/up/down_proj, AdamW lr 3e-4 (no weight decay), 1 epoch, batch size 1
per adapter as in PRAG, on the frozen SmolLM2-135M-Instruct (float32 compute, see ``DTYPE``; float32 LoRA weights, saved float32).
Training samples per passage, in this order, for ``--epochs`` epochs:
  1. the passage text (loss on every token, cut to ``--max-tokens``),
  2. the model's rewrite of it (stage 2; skipped when the rewrite was dropped),
  3-5. its three QA pairs, each as the ``param`` prompt of the label builder / evaluation
     (``fcprag_tools.label_builder.prompts``) followed by the answer (loss on the answer tokens only).
The question under study and its gold answer are never used. Adapters train ``--group`` at a time with
:mod:`multilora` (exactly equivalent to training each alone). Per-adapter losses (at the training step, and after training) go
to ``cache/<dataset>/adapters.jsonl``. Resumable: finished adapters are skipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from common import MODEL_NAME, append_jsonl, cache_dir, load_model, logger, read_jsonl, setup_logging, timed, work_dir
from multilora import MultiLora, StackedAdamW, lm_losses

LORA = {"r": 2, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj", "down_proj"], "lora_dropout": 0.0}
LEARNING_RATE = 3e-4
# float32 compute: on this study's CPU (AVX2, no bf16 units) a bf16 matmul ran 7x slower than float32
# (2.8 vs 19.9 GFLOP/s, 128x576 @ 576x1536, one thread); the earlier 200-question study used bf16
DTYPE = "float32"
KINDS = ("passage", "rewrite", "qa0", "qa1", "qa2")
AFTER_KINDS = ("passage", "qa0")  # re-measured after training (the report shows these two)


def samples_for(tok: Any, aug: dict[str, Any], max_tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """``{kind: (input ids, labels)}`` for one passage (kinds absent when there is no such sample)."""
    from fcprag_tools.label_builder.prompts import PromptTemplate, answer_ids, render_prompt

    out: dict[str, tuple[list[int], list[int]]] = {}
    for kind, text in (("passage", aug["passage"]), ("rewrite", aug.get("rewrite"))):
        if text:
            ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
            out[kind] = (ids, list(ids))
    tpl = PromptTemplate()
    for j, pair in enumerate(aug["qa_pairs"][:3]):
        prompt = render_prompt(tok, tpl, pair["question"], None, "param")
        ans = answer_ids(tok, prompt, pair["answer"])[:48]
        out[f"qa{j}"] = (prompt.ids + ans, [-100] * len(prompt.ids) + ans)
    return out


def pad_batch(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(s[0]) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lb) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(lb)] = torch.tensor(lb)
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _kind_losses(model: Any, tok: Any, ml: MultiLora, data: list[dict[str, Any]], kind: str
                 ) -> tuple[list[int], torch.Tensor | None]:
    """Per-adapter losses ``[b]`` on sample ``kind`` for the adapters that have one (and their indices)."""
    active = [b for b, d in enumerate(data) if kind in d]
    if not active:
        return active, None
    ml.select(active)
    batch = {k: v.to(ml.device) for k, v in pad_batch([data[b][kind] for b in active], tok.pad_token_id).items()}
    return active, lm_losses(model, batch["input_ids"], batch["attention_mask"], batch["labels"])


def train_group(model: Any, tok: Any, group: list[dict[str, Any]], seeds: list[int], epochs: int,
                max_tokens: int) -> tuple[MultiLora, list[dict[str, Any]]]:
    data = [samples_for(tok, aug, max_tokens) for aug in group]
    ml = MultiLora(model, len(group), r=LORA["r"], alpha=LORA["lora_alpha"], targets=LORA["target_modules"],
                   seeds=seeds)
    opt = StackedAdamW(ml.parameters(), len(group), lr=LEARNING_RATE)
    stats = [{"steps": 0, "loss_at_step": {}, "loss_after": {}} for _ in group]
    try:
        for epoch in range(epochs):
            for kind in KINDS:
                active, losses = _kind_losses(model, tok, ml, data, kind)
                if not active:
                    continue
                losses.sum().backward()
                opt.step(active)
                opt.zero_grad()
                for j, b in enumerate(active):
                    stats[b]["steps"] += 1
                    if epoch == 0:  # the loss before this sample's first update (for 'passage': the base model's)
                        stats[b]["loss_at_step"][kind] = round(float(losses[j].detach()), 4)
        with torch.no_grad():  # what the adapter learned: the same samples after training
            for kind in AFTER_KINDS:
                active, losses = _kind_losses(model, tok, ml, data, kind)
                for j, b in enumerate(active):
                    stats[b]["loss_after"][kind] = round(float(losses[j]), 4)
        for key, v in ml.factor_norms().items():
            for b in range(len(group)):
                stats[b].setdefault("norm", {})[key] = round(float(v[b]), 5)
    finally:
        ml.remove()
    return ml, stats


def study_order(retrieval: dict[str, list[dict[str, Any]]], top: int = 3) -> list[tuple[str, str]]:
    """Every ``(dataset, pid)`` the study needs, once, in the order that completes useful subsets first.

    1. the test questions' BM25 top-``top`` (the evaluation's clean condition), datasets interleaved by question;
    2. the training questions' whole retrieved list (every subset label of a question needs all of them),
       question by question, datasets interleaved, so the labels can start on the first finished questions;
    3. the test questions' remaining passages (the evaluation's second subset).
    """
    def interleave(lists: list[list[Any]]) -> list[Any]:
        out: list[Any] = []
        for i in range(max((len(x) for x in lists), default=0)):
            for x in lists:
                if i < len(x):
                    out.append(x[i])
        return out

    def tier(split: str, lo: int, hi: int | None) -> list[tuple[str, str]]:
        # one question at a time from each dataset in turn (a question's passages stay together)
        per_question = [[[(ds, p["pid"]) for p in r["passages"][lo:hi]] for r in rows if r["split"] == split]
                        for ds, rows in retrieval.items()]
        return [x for q in interleave(per_question) for x in q]

    return list(dict.fromkeys(tier("test", 0, top) + tier("train", 0, None) + tier("test", top, None)))


def places(dataset: str, root: Path | None = None) -> tuple[Path, Path]:
    """(adapter folder, log file) of ``dataset``: the study's ``work/<ds>/adapters/`` and
    ``cache/<ds>/adapters.jsonl``, or ``root/adapters/`` and ``root/adapters.jsonl`` (``run_all.py``)."""
    if root is not None:
        return Path(root) / "adapters", Path(root) / "adapters.jsonl"
    return work_dir(dataset) / "adapters", cache_dir(dataset) / "adapters.jsonl"


def done_adapters(dataset: str, root: Path | None = None) -> set[str]:
    """The pids of ``dataset`` whose adapter is saved and logged (a restart skips them)."""
    folder, log_path = places(dataset, root)
    logged = {r["pid"] for r in read_jsonl(log_path)} if log_path.exists() else set()
    return {pid for pid in logged if (folder / pid / "adapter_model.safetensors").is_file()}


def make_groups(items: list[tuple[str, str]], lengths: dict[tuple[str, str], int], group: int, block: int
                ) -> list[list[tuple[str, str]]]:
    """Groups of ``group`` items: the order is kept at ``block`` granularity (so early items finish first), and
    within a block items are sorted by token length (similar lengths per group: less padding)."""
    out = []
    for s in range(0, len(items), block):
        blk = sorted(items[s:s + block], key=lambda it: (lengths[it], it))
        out += [blk[g:g + group] for g in range(0, len(blk), group)]
    return out


def build(items: list[tuple[str, str]], augs: dict[str, dict[str, dict[str, Any]]], group_size: int, block: int,
          epochs: int, max_tokens: int, model: Any = None, tok: Any = None, save: bool = True,
          root: Path | None = None, base_model: str = MODEL_NAME) -> list[dict[str, Any]]:
    """Train (and, with ``save``, write and log) one adapter per ``(dataset, pid)`` item, ``group_size`` at a
    time, on ``model`` wherever it lives (its device; its dtype for the frozen weights' compute, the LoRA factors
    float32 master copies, saved float32; ``base_model`` is the name written into each ``adapter_config.json``). Each group's adapters go to ``work/<dataset>/adapters/<pid>/`` and their log rows (steps, losses,
    norms, the group's wall-clock) to ``cache/<dataset>/adapters.jsonl`` as soon as the group finishes (under
    ``root`` instead when given: :func:`places`).
    Returns the log rows."""
    import time

    from tqdm import tqdm

    if model is None:
        model, tok = load_model(DTYPE)
    torch.manual_seed(0)
    lengths = {it: min(max_tokens, len(tok(augs[it[0]][it[1]]["passage"], add_special_tokens=False)["input_ids"]))
               for it in items}
    config = dict(LORA, task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    rows_all: list[dict[str, Any]] = []
    groups = make_groups(items, lengths, group_size, block)
    for gi, grp in enumerate(tqdm(groups, desc="adapters", unit="group", mininterval=30)):
        t0 = time.perf_counter()
        seeds = [int(pid[:8], 16) for _, pid in grp]  # the seed follows the passage, not the group
        ml, stats = train_group(model, tok, [augs[ds][pid] for ds, pid in grp], seeds, epochs, max_tokens)
        secs = round(time.perf_counter() - t0, 2)
        rows = [{"pid": pid, "dataset": ds, "seed": seeds[b], **stats[b], "group_size": len(grp),
                 "group_seconds": secs, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
                for b, (ds, pid) in enumerate(grp)]
        if save:
            for b, (ds, pid) in enumerate(grp):
                ml.adapter(b, config).save_pretrained(places(ds, root)[0] / pid, dtype=torch.float32)
            for ds in dict.fromkeys(d for d, _ in grp):
                append_jsonl(places(ds, root)[1], [r for r in rows if r["dataset"] == ds])
        rows_all += rows
        if gi % 25 == 24 or gi == len(groups) - 1:  # training must never write the base model
            changed = [k for k, v in model.state_dict().items() if not torch.equal(v, snapshot[k])]
            if changed:
                raise SystemExit(f"base model weights changed during adapter training: {changed[:3]}")
    return rows_all


def load_augs(datasets: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    return {ds: {r["pid"]: r for r in read_jsonl(cache_dir(ds) / "augment.jsonl")} for ds in datasets}


def run(dataset: str, group_size: int, epochs: int, max_tokens: int, limit: int | None) -> None:
    """One dataset's adapters (every retrieved passage), skipping finished ones."""
    augs = load_augs([dataset])
    needed = []
    for r in read_jsonl(cache_dir(dataset) / "retrieval.jsonl"):
        for p in r["passages"]:
            if p["pid"] not in augs[dataset]:
                raise SystemExit(f"passage {p['pid']} of question {r['id']} has no augmentation: run augment.py first")
            needed.append((dataset, p["pid"]))
    done = done_adapters(dataset)
    todo = [it for it in dict.fromkeys(needed) if it[1] not in done]
    if limit is not None:
        todo = todo[:limit]
    if not todo:
        logger.info("%s: all %d adapters exist", dataset, len(needed))
        return
    with timed(dataset, "adapters", adapters=len(todo), group=group_size, epochs=epochs) as info:
        build(todo, augs, group_size, len(todo), epochs, max_tokens)
        info["base_model_unchanged"] = True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--group", type=int, default=16, help="adapters trained together")
    p.add_argument("--epochs", type=int, default=1, help="PRAG trains 1 epoch")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None)
    a = p.parse_args(argv)
    setup_logging()
    run(a.dataset, a.group, a.epochs, a.max_tokens, a.limit)


if __name__ == "__main__":
    main()
