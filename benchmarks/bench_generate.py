"""Generating with a fusion on vs the base model, side by side in one run.

A random-weight Llama-3.2-1B-shaped model (hidden 2048, intermediate 8192, 32 heads / 8 kv heads, vocab 128256)
with ``--layers`` layers and three PRAG-layout adapters (r=2, alpha=32, gate/up/down_proj). Per batch size it
times, interleaved round by round, one greedy ``generate`` of ``--new-tokens`` tokens (exactly that many):

  base      the model with no fusion (the slot's hooks detached)
  hooks     ``with fuse_into(model, ...): generate`` with ``slot.route = "hooks"`` (the update added by
            forward hooks)
  weights   the same call with ``slot.route = "weights"`` (fused weights from the write on)
  auto      the same call as users make it (the default route: on an accelerator, hooks for the prefill and fused
            weights from the first decoding step; on the CPU the hooks)
  peft      PRAG's generation: a PeftModel (a copy of the model) with the cat merge of the adapters as its active
            LoRA adapter

The fused timings include the ``fuse_into`` call. Then two checks: a decoding step's logits with the fusion on (routes
``hooks``, ``weights`` and ``auto``, after a prefill) against a float64 dense reference
``W + sum_i w_i s_i B_i A_i`` (max |diff| / max |ref|), and the base weights bit-identical (``torch.equal`` with
a clone taken first, and the same ``Parameter`` objects) after everything.

    PYTHONPATH=src python benchmarks/bench_generate.py                   # CPU: 2 layers, batch 4, 128 + 32 tokens
    PYTHONPATH=src python benchmarks/bench_generate.py --device cuda --dtype bfloat16 --layers 16 \\
        --batches 1,8 --prompt 256 --new-tokens 64
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

import _timing as T
from fcprag_plugin import FusionController, LoraAdapter, LoraModule, fuse_into
from fcprag_plugin.merge import merge_adapters
from fcprag_plugin.slot import FusedSlot

TARGETS = ("gate_proj", "up_proj", "down_proj")
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256, tie_word_embeddings=True)
QUERY, PASSAGES = "what is the capital of france", ["paris is in france", "bananas are yellow", "the eiffel tower"]
VARIANTS = ("base", "hooks", "weights", "auto", "peft")


def build_model(layers: int, vocab: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights (transformers' own init, seed 0), built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=4096, num_hidden_layers=layers, **{**SHAPE, "vocab_size": vocab})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def adapters(model: torch.nn.Module, n: int = 3, seed: int = 0) -> list[LoraAdapter]:
    """PRAG-layout adapters: r=2, alpha=32 (scaling 16), gate/up/down_proj, on the model's device and dtype."""
    g = torch.Generator().manual_seed(seed)
    p = next(model.parameters())
    out = []
    for i in range(n):
        mods = {name: LoraModule((torch.randn(2, m.in_features, generator=g) * 0.02).to(p.device, p.dtype),
                                 (torch.randn(m.out_features, 2, generator=g) * 0.02).to(p.device, p.dtype), 16.0)
                for name, m in model.named_modules() if name.split(".")[-1] in TARGETS}
        out.append(LoraAdapter(mods, {"r": 2, "lora_alpha": 32, "target_modules": list(TARGETS)}, f"bench-{i}"))
    return out


def peft_model(model: torch.nn.Module, ads: list[LoraAdapter], w: list[float]) -> torch.nn.Module:
    """A PeftModel on a copy of ``model`` whose active adapter is the cat merge (PRAG's generation)."""
    from peft import LoraConfig, get_peft_model

    merged = merge_adapters(ads, w, "cat").adapter
    r = next(iter(merged.modules.values())).rank
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=r, target_modules=list(TARGETS),
                                                         lora_dropout=0.0))
    table = dict(pm.named_modules())
    with torch.no_grad():
        for name, mod in merged.modules.items():
            layer = table["base_model.model." + name]
            layer.lora_A["default"].weight.copy_(mod.A * mod.scaling)
            layer.lora_B["default"].weight.copy_(mod.B)
    return pm.eval()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


def dense_logits(model: torch.nn.Module, ads: list[LoraAdapter], w: list[float], ids: torch.Tensor) -> torch.Tensor:
    """Last-position logits of a float64 copy with ``W + sum_i w_i s_i B_i A_i`` written into it."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        m._forward_hooks.clear()
    ref = ref.to(torch.float64)
    table = dict(ref.named_modules())
    with torch.no_grad():
        for name in ads[0].modules:
            upd = sum(wi * a.modules[name].scaling * (a.modules[name].B.double() @ a.modules[name].A.double())
                      for wi, a in zip(w, ads))
            table[name].weight += upd
        out = ref(ids).logits[:, -1]
    del ref
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    T.add_device_args(p)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"])
    p.add_argument("--batches", default="4")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--scale", type=float, default=1.5, help="the scale_only controller's scale (w~ = scale)")
    p.add_argument("--out", default=None, help="JSON results (and a .md table beside it)")
    args = p.parse_args(argv)
    dev, dt = T.device_of(args), T.dtype_of(args)
    variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        p.error(f"--variants: unknown {bad}; expected some of {list(VARIANTS)}")

    model = build_model(args.layers, args.vocab, dev, dt)
    ads = adapters(model)
    ctrl = FusionController.scale_only(args.scale)
    w = [args.scale] * len(ads)
    before = {n: (q, q.detach().clone()) for n, q in model.named_parameters()}
    pm = peft_model(model, ads, w) if "peft" in variants else None
    with fuse_into(model, ads, QUERY, PASSAGES, controller=ctrl):
        pass  # installs the slot
    slot = FusedSlot.of(model)
    env = T.env(dev, dt)
    env.update(layers=args.layers, vocab=args.vocab, prompt=args.prompt, new_tokens=args.new_tokens,
               fused_weights_bytes=slot.weights_nbytes, slot_bytes=slot.nbytes)
    print(json.dumps(env), flush=True)

    results: dict[str, Any] = {"env": env, "batches": {}}
    g = torch.Generator().manual_seed(1)
    for b in [int(x) for x in args.batches.split(",")]:
        ids = torch.randint(0, args.vocab, (b, args.prompt), generator=g).to(dev)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)

        def gen(m: torch.nn.Module = model) -> torch.Tensor:
            with torch.no_grad():
                return m.generate(ids, **kw)

        def base() -> Any:
            slot._hooks.detach()  # the bare model: no hook of the (switched off) slot on the modules
            try:
                return gen()
            finally:
                slot._hooks.attach()

        def fused(route: str) -> Any:
            def run() -> Any:
                slot.route = route
                with fuse_into(model, ads, QUERY, PASSAGES, controller=ctrl):
                    out = gen()
                slot.route = "auto"
                return out
            return run

        fns = {"base": base, "hooks": fused("hooks"), "weights": fused("weights"), "auto": fused("auto"),
               "peft": lambda: gen(pm)}
        fns = {k: fns[k] for k in variants}
        res = T.interleaved(fns, args.rounds, warmup=1, device=dev)
        for k, v in res.items():
            v["ratio_to_base"] = v["median_ms"] / res["base"]["median_ms"] if "base" in res else None
        row: dict[str, Any] = {"timings": res}
        # the checks: the fusion's logits against the dense float64 reference, on the first prompt row
        x = ids[:1, : min(args.prompt, 64)]
        want = dense_logits(model, ads, w, x.cpu() if dev.type == "cpu" else x)
        errs = {}
        for route in ("hooks", "weights", "auto"):
            slot.route = route
            with torch.no_grad(), fuse_into(model, ads, QUERY, PASSAGES, controller=ctrl) as r:
                out = model(x[:, :-1])  # a generate's prefill ...
                step = model(x[:, -1:], past_key_values=out.past_key_values)  # ... and first decoding step
                got = step.logits[:, -1]  # route auto: on fused weights from this step (on an accelerator)
                errs[route] = {"rel_err": rel_err(got, want), "on_weights": r.slot.on_weights}
        slot.route = "auto"
        with torch.no_grad():
            errs["base_vs_reference"] = {"rel_err": rel_err(model(x).logits[:, -1], want)}  # the update's size
        row["logits"] = errs
        results["batches"][str(b)] = row
        print(f"batch {b}: " + "  ".join(f"{k} {v['median_ms']:.1f} ms ({v['ratio_to_base']:.3f}x)"
                                          if v["ratio_to_base"] is not None else f"{k} {v['median_ms']:.1f} ms"
                                          for k, v in res.items()), flush=True)
        print(f"   logits vs float64 dense reference (max|diff|/max|ref|): hooks {errs['hooks']['rel_err']:.2e}, "
              f"fused weights {errs['weights']['rel_err']:.2e}, auto {errs['auto']['rel_err']:.2e} (on fused "
              f"weights: {errs['auto']['on_weights']}); the base model differs by "
              f"{errs['base_vs_reference']['rel_err']:.2e}", flush=True)
    same = all(dict(model.named_parameters())[n] is q and torch.equal(q, c) for n, (q, c) in before.items())
    results["base_weights_bit_identical"] = same
    print(f"base weights bit-identical and the original Parameter objects afterwards: {same}", flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        out.with_suffix(".md").write_text(markdown(results))
    return 0 if same else 1


def markdown(res: dict[str, Any]) -> str:
    e = res["env"]
    lines = [f"Generation, {e.get('gpu', e['device'])}, {e['dtype']}, torch {e['torch']}, transformers "
             f"{e['transformers']}, peft {e['peft']}; {e['layers']} layers, {e['prompt']}-token prompt, "
             f"{e['new_tokens']} new tokens; fused-weight copy {e['fused_weights_bytes'] / 2**20:.0f} MiB", "",
             "| batch | " + " | ".join(next(iter(res["batches"].values()))["timings"]) + " | logits rel. err (hooks / "
             "fused weights) |", "|---" * (2 + len(next(iter(res["batches"].values()))["timings"])) + "|"]
    for b, row in res["batches"].items():
        cells = [f"{v['median_ms']:.1f} ms ({v['ratio_to_base']:.3f}x)" if v.get("ratio_to_base") else
                 f"{v['median_ms']:.1f} ms" for v in row["timings"].values()]
        lg = row["logits"]
        errs = f"{lg['hooks']['rel_err']:.1e} / {lg['weights']['rel_err']:.1e}"
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {errs} |")
    lines.append(f"\nBase weights bit-identical afterwards: {res['base_weights_bit_identical']}\n")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
