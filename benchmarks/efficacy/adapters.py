"""Stage 3: one LoRA adapter per retrieved passage (PRAG's recipe) -> ``work/<dataset>/adapters/<pid>/``.

Recipe: PEFT-format LoRA r = 2, alpha = 32 on gate/up/down_proj, AdamW lr 3e-4 (no weight decay), 1 epoch, batch size 1
per adapter as in PRAG, on the frozen SmolLM2-135M-Instruct (bf16 compute, float32 LoRA weights, saved float32).
Training samples per passage, in this order, for ``--epochs`` epochs:
  1. the passage text (loss on every token, cut to ``--max-tokens``),
  2. the model's rewrite of it (stage 2; skipped when the rewrite was dropped),
  3-5. its three QA pairs, each as the ``param`` prompt of the label builder / evaluation
     (``fcprag_plugin.labels.prompts``) followed by the answer (loss on the answer tokens only).
The question under study and its gold answer are never used. Adapters train ``--group`` at a time with
:mod:`multilora` (exactly equivalent to training each alone). Per-adapter losses (at the training step, and after training) go
to ``cache/<dataset>/adapters.jsonl``. Resumable: finished adapters are skipped.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from common import MODEL_NAME, append_jsonl, cache_dir, load_model, logger, read_jsonl, setup_logging, timed, work_dir
from multilora import MultiLora, StackedAdamW, lm_losses

LORA = {"r": 2, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj", "down_proj"], "lora_dropout": 0.0}
LEARNING_RATE = 3e-4
KINDS = ("passage", "rewrite", "qa0", "qa1", "qa2")
AFTER_KINDS = ("passage", "qa0")  # re-measured after training (the report shows these two)


def samples_for(tok: Any, aug: dict[str, Any], max_tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """``{kind: (input ids, labels)}`` for one passage (kinds absent when there is no such sample)."""
    from fcprag_plugin.labels.prompts import PromptTemplate, answer_ids, render_prompt

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
    batch = pad_batch([data[b][kind] for b in active], tok.pad_token_id)
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
    finally:
        ml.remove()
    return ml, stats


def run(dataset: str, group_size: int, epochs: int, max_tokens: int, limit: int | None) -> None:
    from tqdm import tqdm

    augs = {r["pid"]: r for r in read_jsonl(cache_dir(dataset) / "augment.jsonl")}
    needed = []
    for r in read_jsonl(cache_dir(dataset) / "retrieval.jsonl"):
        for p in r["passages"]:
            if p["pid"] not in augs:
                raise SystemExit(f"passage {p['pid']} of question {r['id']} has no augmentation: run augment.py first")
            needed.append(p["pid"])
    needed = list(dict.fromkeys(needed))
    root = work_dir(dataset) / "adapters"
    log_path = cache_dir(dataset) / "adapters.jsonl"
    logged = {r["pid"] for r in read_jsonl(log_path)} if log_path.exists() else set()
    todo = [pid for pid in needed if not ((root / pid / "adapter_model.safetensors").is_file() and pid in logged)]
    if limit is not None:
        todo = todo[:limit]
    if not todo:
        logger.info("%s: all %d adapters exist", dataset, len(needed))
        return
    model, tok = load_model("bfloat16")
    torch.manual_seed(0)
    lengths = {pid: len(tok(augs[pid]["passage"], add_special_tokens=False)["input_ids"]) for pid in todo}
    todo.sort(key=lambda pid: lengths[pid])  # similar lengths per group: less padding
    config = dict(LORA, task_type="CAUSAL_LM", base_model_name_or_path=MODEL_NAME)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with timed(dataset, "adapters", adapters=len(todo), group=group_size, epochs=epochs) as info:
        for s in tqdm(range(0, len(todo), group_size), desc="adapters", unit="group"):
            pids = todo[s:s + group_size]
            seeds = [int(pid[:8], 16) for pid in pids]  # the seed follows the passage, not the group
            ml, stats = train_group(model, tok, [augs[p] for p in pids], seeds, epochs, max_tokens)
            rows = []
            for b, pid in enumerate(pids):
                ml.adapter(b, config).save_pretrained(root / pid, dtype=torch.float32)
                rows.append({"pid": pid, "seed": seeds[b], **stats[b]})
            append_jsonl(log_path, rows)
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, snapshot[k])]
        if changed:  # training must never write the base model
            raise SystemExit(f"base model weights changed during adapter training: {changed[:3]}")
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
