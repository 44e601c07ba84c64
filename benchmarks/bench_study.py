"""``fcprag study``'s stages, throughput side by side with the one-at-a-time way, on random weights.

A random Llama of Llama-3.2-1B's shape (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads, vocab
128256; ``--shape smollm2``: SmolLM2-135M's, the CPU study's model; ``--layers`` fewer for a quick look, ``--shape
tiny`` for a CPU smoke run), on ``--device`` in ``--dtype``,
CUDA-synchronised around every timer. Per stage it prints both rates and their ratio:

- adapters: PRAG's recipe (r 2, alpha 32, gate/up/down_proj, AdamW 3e-4, 4 samples of ``--tokens`` tokens each)
  trained stacked (``fcprag_tools.study.adapters``, ``--stack`` per step) vs one PEFT adapter at a time (PRAG's
  way), in adapters/s; the stacked adapters equal the PEFT ones (``tests/tools/study/test_adapters.py``);
- labels: records of 3 adapters (the 4 leave-one-out subsets and 2 scales, with a greedy answer each) through the
  label builder's batched scorer (``score_rows``, mixed batches) vs one subset at a time (slot write + forward +
  generate), in records/s;
- evaluation: questions, each with its own 3 adapters and ``--new-tokens`` greedy tokens, in one mixed batch vs one
  at a time, in questions/s, with the largest log-prob difference between the two;
- augmentation: PRAG's two prompts per passage (rewrite, QA; ``--aug-prompt-tokens`` tokens each) answered by greedy
  generation of ``--aug-new-tokens`` tokens, ``--aug-batch`` passages per ``generate`` (the study's
  ``batched_greedy``) vs one prompt at a time (PRAG's way), in passages/s. Random weights never stop early, so both
  generate every token; a real model's batch waits for its longest answer.

Usage::

    python benchmarks/bench_study.py --device cuda --dtype bfloat16 [--quick]
    python benchmarks/bench_study.py --shape tiny --quick          # CPU smoke run
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

SHAPES = {"1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
          "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048),
          "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)}
TARGETS = ["gate_proj", "up_proj", "down_proj"]


class Tok:
    """What the scorer asks of a tokenizer: pad / eos ids and ``decode``."""

    pad_token_id, eos_token_id = 0, 1

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def timed(dev: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0, out


def make_model(shape: str, layers: int | None, dev: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(SHAPES[shape], bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if layers:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: generate exactly the asked-for tokens
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def bench_adapters(model: Any, a: argparse.Namespace, dev: torch.device) -> tuple[float, float]:
    from peft import LoraConfig, get_peft_model

    from fcprag_tools.study import adapters as ad

    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)

    def sample() -> tuple[list[int], list[int]]:
        ids = torch.randint(3, V, (a.tokens,), generator=g).tolist()
        return ids, ids

    data = [{k: sample() for k in ("passage", "rewrite", "qa0", "qa1")} for _ in range(a.stack)]
    tok = Tok()
    ad.train_stacked(model, tok, data[:2], [0, 1])  # warm-up
    t_stack, _ = timed(dev, lambda: ad.train_stacked(model, tok, data, list(range(a.stack))))

    def peft_one(d: dict[str, tuple[list[int], list[int]]]) -> None:
        pm = get_peft_model(model, LoraConfig(r=2, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.0)
        for ids, _ in d.values():
            x = torch.tensor([ids], device=dev)
            pm(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        pm.unload()

    peft_one(data[0])  # warm-up
    t_peft, _ = timed(dev, lambda: [peft_one(d) for d in data[:a.peft]])
    return a.stack / t_stack, a.peft / t_peft


def _rows(model: Any, n_q: int, per_q: list[list[float]], a: argparse.Namespace, dev: torch.device) -> tuple:
    from fcprag_plugin.adapter import LoraAdapter, LoraModule
    from fcprag_tools.lm.batched import ScoreRow
    from fcprag_tools.study.adapters import target_linears

    g = torch.Generator().manual_seed(2)
    lins = target_linears(model, TARGETS)

    def adapter() -> LoraAdapter:
        mods = {n: LoraModule((torch.randn(2, m.in_features, generator=g) * 0.01).to(dev),
                              (torch.randn(m.out_features, 2, generator=g) * 0.01).to(dev), 16.0)
                for n, m in lins.items()}
        return LoraAdapter(mods, {"r": 2, "lora_alpha": 32, "target_modules": TARGETS})

    V = model.config.vocab_size
    rows = []
    for _ in range(n_q):
        ads = [adapter() for _ in range(3)]
        prompt = torch.randint(3, V, (a.prompt_tokens,), generator=g).tolist()
        gold = [torch.randint(3, V, (5,), generator=g).tolist()]
        for w in per_q:
            keep = [(x, wi) for x, wi in zip(ads, w) if wi]
            rows.append(ScoreRow(prompt, gold, [x for x, _ in keep], [wi for _, wi in keep], gen_prompt_ids=prompt))
    return rows


def bench_scoring(model: Any, rows: list, per_unit: int, a: argparse.Namespace, dev: torch.device) -> tuple:
    """``(units/s mixed, units/s one at a time, max |logprob difference|)``; a unit is ``per_unit`` rows."""
    from fcprag_plugin.slot import FusedSlot
    from fcprag_tools.lm.batched import score_rows

    tok = Tok()
    union = {id(x): x for r in rows for x in r.adapters}
    slot = FusedSlot.for_model(model, next(iter(union.values())), max_adapters=len(union), max_rank=2)
    try:
        score_rows(model, tok, slot, rows[:per_unit], batch_size=a.batch, max_new_tokens=2)  # warm-up
        t_mix, mixed = timed(dev, lambda: score_rows(model, tok, slot, rows, batch_size=a.batch,
                                                     max_new_tokens=a.new_tokens))
        t_one, alone = timed(dev, lambda: [score_rows(model, tok, slot, [r], batch_size=1,
                                                      max_new_tokens=a.new_tokens)[0] for r in rows])
    finally:
        slot.remove()
    n = len(rows) / per_unit
    return n / t_mix, n / t_one, max(abs(x.logprob - y.logprob) for x, y in zip(mixed, alone))


def bench_augment(model: Any, a: argparse.Namespace, per_call: int, n: int, dev: torch.device) -> tuple[float, float]:
    """``(passages/s batched, passages/s one prompt at a time)`` over ``n`` passages (2 prompts each),
    ``per_call`` passages per ``generate``."""
    from fcprag_tools.lm.batched import batched_greedy

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.config.vocab_size, (a.aug_prompt_tokens,), generator=g).tolist()
               for _ in range(2 * n)]
    tok, new = Tok(), a.aug_new_tokens
    batched_greedy(model, tok, prompts[:2], 2)  # warm-up
    step = 2 * per_call
    t_mix, _ = timed(dev, lambda: [batched_greedy(model, tok, prompts[i:i + step], new)
                                   for i in range(0, len(prompts), step)])
    n_one = max(1, min(4, n // 8))
    t_one, _ = timed(dev, lambda: [batched_greedy(model, tok, [q], new) for q in prompts[:2 * n_one]])
    return n / t_mix, n_one / t_one


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, help="fewer layers than the shape's (same layer shapes)")
    p.add_argument("--quick", action="store_true", help="fewer adapters and questions (< 90 s on a GPU)")
    p.add_argument("--tokens", type=int, default=160, help="tokens per adapter training sample")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per evaluation row")
    p.add_argument("--batch", type=int, default=64, help="sequences per scoring forward")
    p.add_argument("--aug-batch", default="8",
                   help="passages per augmentation generate, a list (the study's default: 8 on a CPU, 64 on a GPU)")
    p.add_argument("--aug-prompt-tokens", type=int, default=220, help="tokens of one augmentation prompt")
    p.add_argument("--aug-new-tokens", type=int, default=128, help="greedy tokens per augmentation prompt")
    p.add_argument("--stages", default="adapters,labels,evaluation,augment", help="a subset, comma-separated")
    a = p.parse_args()
    a.stack, a.peft = (16, 4) if a.quick else (64, 16)
    n_eval, n_label = (8, 4) if a.quick else (32, 16)
    if a.quick:
        a.new_tokens = min(a.new_tokens, 32)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.set_grad_enabled(True)
    model = make_model(a.shape, a.layers, dev, dtype)
    cfg = model.config
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; random Llama ({a.shape}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab "
          f"{cfg.vocab_size}), {a.dtype}")
    stages = set(a.stages.split(","))
    if "adapters" in stages:
        stacked, peft = bench_adapters(model, a, dev)
        print(f"adapters    stacked x{a.stack}: {stacked:8.2f} adapters/s   PEFT one at a time: {peft:8.2f} "
              f"adapters/s   ratio {stacked / peft:6.1f}x", flush=True)
    with torch.no_grad():
        if "labels" in stages:
            loo = [[1, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 0], [2, 2, 2], [4, 4, 4]]
            mix, one, diff = bench_scoring(model, _rows(model, n_label, loo, a, dev), len(loo), a, dev)
            print(f"labels      batched: {mix:8.2f} records/s   one subset at a time: {one:8.2f} records/s   "
                  f"ratio {mix / one:6.1f}x   max |d logprob| {diff:.2e}", flush=True)
        if "evaluation" in stages:
            mix, one, diff = bench_scoring(model, _rows(model, n_eval, [[1, 1, 1]], a, dev), 1, a, dev)
            print(f"evaluation  mixed batch: {mix:8.2f} questions/s   one at a time: {one:8.2f} questions/s   "
                  f"ratio {mix / one:6.1f}x   max |d logprob| {diff:.2e}", flush=True)
        for per_call in (int(x) for x in a.aug_batch.split(",")) if "augment" in stages else ():
            n_aug = (2 if a.quick else 4) * per_call
            mix, one = bench_augment(model, a, per_call, n_aug, dev)
            print(f"augment     x{per_call} passages per generate: {mix:8.2f} passages/s   one prompt at a time: "
                  f"{one:8.2f} passages/s   ratio {mix / one:6.1f}x", flush=True)


if __name__ == "__main__":
    main()
