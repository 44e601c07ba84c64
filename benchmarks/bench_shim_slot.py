"""The shims with ``use_slot`` vs the default shim path, per question, side by side in one run.

PRAG: the per-question loop of PRAG's inference (``PeftModel.from_pretrained`` adapter "0" + ``load_adapter`` x
(N-1) + ``add_weighted_adapter(cat)`` + ``set_adapter`` + a forward over the prompt (+ optional greedy tokens) +
``delete_adapter`` + ``unload``): PRAG unpatched, under the default shim, and under ``use_slot=True`` (adapters
read into the shim's store, no PEFT modules, the merge written into the slot at ``set_adapter``). Per-question
overhead = load + merge + cleanup, everything but the forward (+ generation); the bare model's forward of the same
tokens is timed in the same run for reference. On peft < 0.19 the unpatched loop merges fewer adapters from question 2 on (PRAG's stale-config bug).

DyPRAG: DyPRAG's per-question injection (average the N translator outputs, ``delta_inject``, a forward,
``delta_remove``; the MLP adds ``x @ delta.T`` like DyPRAG's modeling code) under the DyPRAG shim, default path
(dense ``delta`` per module) vs ``use_slot=True`` (the low-rank update in the slot). Translator outputs are
precomputed random factors and the passage-embedding forwards are left out: both are the same in both paths.

Model: a Llama with the Llama-3.2-1B layer shape (hidden 2048, intermediate 8192, 32 heads / 8 KV heads) and
``--layers`` layers (default 4; every per-question cost here grows about linearly with the layer count), a small
vocabulary, random weights; adapters r=2, alpha=32 on gate/up/down_proj, fp32 (PRAG's layout). Blocks of
``--questions`` questions alternate default / slot for ``--rounds`` rounds (one warm-up question per block is not
counted). Prints per-question medians, the ratio slot / default, and the largest logit difference between the
two paths.

    OMP_NUM_THREADS=1 .venv/latest/bin/python benchmarks/bench_shim_slot.py            # ~1-2 minutes
    OMP_NUM_THREADS=1 .venv/latest/bin/python benchmarks/bench_shim_slot.py --layers 2 --questions 2   # smoke
    PYTHONPATH=src python benchmarks/bench_shim_slot.py --device cuda --dtype bfloat16 --layers 16 --new-tokens 64

``--device`` / ``--dtype``: the model, the prompt and DyPRAG's translator outputs live there; every time stamp is
taken after a CUDA synchronisation.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

import _timing

from fcprag_plugin import LoraAdapter, LoraModule
from fcprag_plugin.compat import package_version
from fcprag_plugin.hosts import dyprag, prag

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark, also when imported
from bench_fusion import fill_from_pool  # noqa: E402

TARGETS = ("gate_proj", "up_proj", "down_proj")
PRAG_PATHS = ("unpatched", "default", "slot")
DEVICE, DTYPE = torch.device("cpu"), torch.float32  # set from --device / --dtype in main()


def stamp() -> float:
    """``time.perf_counter()`` after the device's queued work has finished."""
    _timing.sync(DEVICE)
    return time.perf_counter()
SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8)


def build_model(layers: int, vocab: int) -> torch.nn.Module:
    """A Llama-3.2-1B-shaped model with ``layers`` layers; weights tiled from one random pool (fast to build)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=512,
                      tie_word_embeddings=True, **SHAPE_1B)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = fill_from_pool(model.to_empty(device="cpu").eval())
    with torch.no_grad():
        theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        for name, b in model.named_buffers():  # rotary inv_freq: recompute (to_empty left it uninitialised)
            if name.endswith("inv_freq"):
                dim = b.numel() * 2
                b.copy_(1.0 / (float(theta or 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)))
    return model.to(DEVICE, DTYPE)


def mlp_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules()
            if n.split(".")[-1] in TARGETS and isinstance(m, torch.nn.Linear)}


def write_adapters(model: torch.nn.Module, root: Path, questions: int, n: int) -> list[list[Path]]:
    """``questions`` x ``n`` PRAG-layout adapters (every question has its own passages, as in PRAG)."""
    g = torch.Generator().manual_seed(1)
    shapes = mlp_shapes(model)
    out = []
    for q in range(questions):
        dirs = []
        for i in range(n):
            mods = {k: LoraModule(torch.randn(2, fi, generator=g) * 0.05, torch.randn(fo, 2, generator=g) * 0.05,
                                  16.0) for k, (fo, fi) in shapes.items()}
            cfg = {"r": 2, "lora_alpha": 32, "target_modules": list(TARGETS), "task_type": "CAUSAL_LM"}
            dirs.append(LoraAdapter(mods, cfg, f"q{q}p{i}").save_pretrained(root / f"data_{q}" / f"passage_{i}"))
        out.append(dirs)
    return out


def summarize(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


# ----------------------------------------------------------------------------- PRAG
def prag_question(model: Any, dirs: list[Path], ids: torch.Tensor, new_tokens: int, t: dict[str, list[float]]
                  ) -> tuple[Any, torch.Tensor]:
    from peft import PeftModel

    names = [str(i) for i in range(len(dirs))]
    prag.set_context("a question about the passages", [f"passage {i}" for i in names])
    t0 = stamp()
    pm = PeftModel.from_pretrained(model, str(dirs[0]), adapter_name="0", is_trainable=False)
    for name, d in zip(names[1:], dirs[1:]):
        pm.load_adapter(str(d), adapter_name=name)
    t1 = stamp()
    pm.add_weighted_adapter(adapters=names, weights=[1] * len(names), adapter_name="merge", combination_type="cat")
    pm.set_adapter("merge")
    t2 = stamp()
    with torch.no_grad():
        logits = pm(input_ids=ids).logits[0, -1].clone()
        if new_tokens:
            pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    t3 = stamp()
    pm.delete_adapter("merge")
    model = pm.unload()
    t4 = stamp()
    for k, v in (("load", t1 - t0), ("merge", t2 - t1), ("forward", t3 - t2), ("cleanup", t4 - t3),
                 ("total", t4 - t0), ("fusion", (t2 - t1) + (t4 - t3))):
        t[k].append(v)
    return model, logits


def bench_prag(model: torch.nn.Module, adapters: list[list[Path]], args: argparse.Namespace) -> dict[str, Any]:
    ids = (torch.arange(1, args.tokens + 1).unsqueeze(0) % args.vocab).to(DEVICE)
    with torch.no_grad():
        bare = model(input_ids=ids).logits[0, -1].clone()
    keys = ("load", "merge", "forward", "cleanup", "fusion", "total")
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in PRAG_PATHS}
    times_bare: list[float] = []
    logits: dict[str, list[torch.Tensor]] = {m: [] for m in PRAG_PATHS}
    for r in range(args.rounds):
        for path in PRAG_PATHS:
            shim = (contextlib.nullcontext() if path == "unpatched" else
                    prag.installed(controller=None, use_slot=path == "slot"))
            with shim:
                scratch = {k: [] for k in keys}
                model, _ = prag_question(model, adapters[-1], ids, args.new_tokens, scratch)  # warm-up (slot install)
                gc.collect()
                for q in range(args.questions):
                    model, lg = prag_question(model, adapters[q], ids, args.new_tokens, times[path])
                    if r == 0:
                        logits[path].append(lg)
            print(f"   PRAG round {r + 1}: {path} done", flush=True)
        for q in range(args.questions):  # the same forward (+ generation) on the bare model: the floor
            t0 = stamp()
            with torch.no_grad():
                model(input_ids=ids)
                if args.new_tokens:
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            times_bare.append(stamp() - t0)
    floor = summarize(times_bare)
    with torch.no_grad():
        after = model(input_ids=ids).logits[0, -1]
    res = report({False: times["default"], True: times["slot"]}, {False: logits["default"], True: logits["slot"]},
                 bare, after)
    res["ms"]["unpatched"] = {k: summarize(v) for k, v in times["unpatched"].items()}
    for ms in res["ms"].values():
        ms["overhead"] = ms["load"] + ms["merge"] + ms["cleanup"]  # everything but the forward / generation
    res["ms_bare_forward"] = floor
    res["max_abs_logit_diff_unpatched_vs_default"] = max(
        float((a - b).abs().max()) for a, b in zip(logits["unpatched"], logits["default"]))
    return res


# ----------------------------------------------------------------------------- DyPRAG
def dyprag_host() -> tuple[types.ModuleType, types.ModuleType]:
    """DyPRAG-shaped ``utils`` (delta_inject / delta_remove) and ``projector`` (ParameterTranslator) modules."""
    utils = types.ModuleType("bench_dyprag_utils")

    def get(model: Any, dotted: str) -> Any:
        for part in dotted.split("."):
            model = getattr(model, part)
        return model

    def delta_inject(model: Any, adapter_weights: dict[str, torch.Tensor]) -> None:
        for module in {k.rsplit(".", 2)[0] for k in adapter_weights}:
            a, b = adapter_weights[module + ".lora_A.weight"], adapter_weights[module + ".lora_B.weight"]
            get(model, module).delta = (b @ a).to(torch.float32)

    def delta_remove(model: Any, adapter_weights: dict[str, torch.Tensor]) -> None:
        for module in {k.rsplit(".", 2)[0] for k in adapter_weights}:
            delattr(get(model, module), "delta")

    utils.delta_inject, utils.delta_remove = delta_inject, delta_remove
    projector = types.ModuleType("bench_dyprag_projector")

    class ParameterTranslator(torch.nn.Module):
        """Returns precomputed factor dicts in turn (the real translator's cost is the same in both paths)."""

        def __init__(self, outputs: list[dict[str, torch.Tensor]]) -> None:
            super().__init__()
            self.outputs, self.i = outputs, 0

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            out = self.outputs[self.i % len(self.outputs)]
            self.i += 1
            return out

    projector.ParameterTranslator = ParameterTranslator
    return utils, projector


def _proj(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = layer(x)
    delta = getattr(layer, "delta", None)
    return y if delta is None else y + x @ delta.to(x.dtype).T


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:  # DyPRAG's modified MLP, written from its description
    return _proj(self.down_proj, self.act_fn(_proj(self.gate_proj, x)) * _proj(self.up_proj, x))


def bench_dyprag(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig, TaskType, get_peft_model

    shapes = mlp_shapes(model)
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)
    pm = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, target_modules=list(TARGETS), r=2,
                                          lora_alpha=32, lora_dropout=0.0))
    g = torch.Generator().manual_seed(2)
    outputs = []
    for _ in range(args.questions * args.n):
        out = {}
        for name, (fo, fi) in shapes.items():
            out[f"base_model.model.{name}.lora_A.weight"] = (torch.randn(2, fi, generator=g) * 0.2).to(DEVICE, DTYPE)
            out[f"base_model.model.{name}.lora_B.weight"] = (torch.randn(fo, 2, generator=g) * 0.2).to(DEVICE, DTYPE)
        outputs.append(out)
    utils, projector = dyprag_host()
    translator = projector.ParameterTranslator(outputs)
    ids = (torch.arange(1, args.tokens + 1).unsqueeze(0) % args.vocab).to(DEVICE)
    with torch.no_grad():
        bare = pm(input_ids=ids).logits[0, -1].clone()
    keys = ("inject", "forward", "remove", "total")
    times = {False: {k: [] for k in keys}, True: {k: [] for k in keys}}
    logits: dict[bool, list[torch.Tensor]] = {False: [], True: []}

    def question(q: int, t: dict[str, list[float]]) -> torch.Tensor:
        translator.i = q * args.n
        with torch.no_grad():
            all_deltas = [translator(None) for _ in range(args.n)]
        dyprag.set_context("a question about the passages", [f"passage {i}" for i in range(args.n)])
        t0 = stamp()
        merged = {k: torch.stack([d[k] for d in all_deltas]).mean(dim=0) for k in all_deltas[0]}
        utils.delta_inject(pm, merged)
        t1 = stamp()
        with torch.no_grad():
            lg = pm(input_ids=ids).logits[0, -1].clone()
        t2 = stamp()
        utils.delta_remove(pm, merged)
        t3 = stamp()
        for k, v in (("inject", t1 - t0), ("forward", t2 - t1), ("remove", t3 - t2), ("total", t3 - t0)):
            t[k].append(v)
        return lg

    for r in range(args.rounds):
        for use_slot in (False, True):
            with dyprag.installed(mode=args.dyprag_mode, utils=utils, projector=projector, use_slot=use_slot):
                question(args.questions - 1, {k: [] for k in keys})  # warm-up (slot install)
                gc.collect()
                for q in range(args.questions):
                    lg = question(q, times[use_slot])
                    if r == 0:
                        logits[use_slot].append(lg)
            print(f"   DyPRAG round {r + 1}: {'slot' if use_slot else 'default'} done", flush=True)
    with torch.no_grad():
        after = pm(input_ids=ids).logits[0, -1]
    pm.unload()
    return {**report(times, logits, bare, after), "mode": args.dyprag_mode}


# ----------------------------------------------------------------------------- report
def report(times: dict[bool, dict[str, list[float]]], logits: dict[bool, list[torch.Tensor]], bare: torch.Tensor,
           after: torch.Tensor) -> dict[str, Any]:
    """Medians per phase, the largest slot-vs-default logit difference, how much the merges move the logits
    (so a zero difference means something), and whether the bare model is bit-identical after the run."""
    return {
        "ms": {("slot" if s else "default"): {k: summarize(v) for k, v in d.items()} for s, d in times.items()},
        "max_abs_logit_diff": max(float((a - b).abs().max()) for a, b in zip(logits[False], logits[True])),
        "max_abs_merge_effect": max(float((a - bare).abs().max()) for a in logits[False]),
        "base_bit_identical_after": bool(torch.equal(after, bare)),
    }


def prag_table(res: dict[str, Any]) -> str:
    u, d, s = res["ms"]["unpatched"], res["ms"]["default"], res["ms"]["slot"]
    lines = ["PRAG: median ms per question (PRAG unpatched | default shim | use_slot | unpatched / slot | default / slot)"]
    for k in u:
        lines.append(f"  {k:<8} {u[k]:10.2f} | {d[k]:10.2f} | {s[k]:10.2f} | {u[k] / s[k]:7.1f}x | {d[k] / s[k]:7.1f}x")
    lines.append(f"  overhead = load + merge + cleanup (everything but the forward / generation); fusion = merge + "
                 f"cleanup; the bare model's own forward (+ generation): {res['ms_bare_forward']:.2f} ms")
    lines.append(f"  max |logit diff| slot vs default: {res['max_abs_logit_diff']:.3g}, unpatched vs default: "
                 f"{res['max_abs_logit_diff_unpatched_vs_default']:.3g} (the merges move the logits by up to "
                 f"{res['max_abs_merge_effect']:.3g}); bare model bit-identical after the run: "
                 f"{res['base_bit_identical_after']}")
    return "\n".join(lines)


def table(name: str, res: dict[str, Any]) -> str:
    d, s = res["ms"]["default"], res["ms"]["slot"]
    lines = [f"{name}: median ms per question (default shim | use_slot | slot / default)"]
    for k in d:
        ratio = s[k] / d[k] if d[k] > 0 else float("nan")
        lines.append(f"  {k:<8} {d[k]:10.2f} | {s[k]:10.2f} | {ratio:6.3f}")
    lines.append(f"  max |logit diff| slot vs default: {res['max_abs_logit_diff']:.3g} (the merges move the logits "
                 f"by up to {res['max_abs_merge_effect']:.3g}); bare model bit-identical after the run: "
                 f"{res['base_bit_identical_after']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the 1B-shaped model (1B has 16)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--n", type=int, default=3, help="passages (adapters) per question")
    p.add_argument("--questions", type=int, default=4, help="timed questions per block")
    p.add_argument("--rounds", type=int, default=2, help="default/slot block pairs")
    p.add_argument("--tokens", type=int, default=32, help="prompt length of the per-question forward")
    p.add_argument("--new-tokens", type=int, default=0, help="PRAG: also greedy-generate this many tokens")
    p.add_argument("--dyprag-mode", default="separate", choices=list(dyprag.MODES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip", choices=["prag", "dyprag"], help="leave one shim out")
    p.add_argument("--out", help="also write the results as JSON here")
    _timing.add_device_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    global DEVICE, DTYPE
    DEVICE, DTYPE = _timing.device_of(args), _timing.dtype_of(args)
    print(f"torch {torch.__version__}, transformers {package_version('transformers')}, peft {package_version('peft')}, "
          f"threads {torch.get_num_threads()}; 1B layer shape x {args.layers} layers, N={args.n}", flush=True)
    t = stamp()
    model = build_model(args.layers, args.vocab)
    results: dict[str, Any] = {"args": vars(args), "env": _timing.env(DEVICE, DTYPE)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.skip != "prag":
            adapters = write_adapters(model, Path(tmp), args.questions, args.n)
            print(f"   model + adapters built in {stamp() - t:.1f} s", flush=True)
            results["prag"] = bench_prag(model, adapters, args)
        if args.skip != "dyprag":
            results["dyprag"] = bench_dyprag(model, args)
    print()
    if "prag" in results:
        print(prag_table(results["prag"]))
    if "dyprag" in results:
        print(table(f"DyPRAG shim (mode {args.dyprag_mode})", results["dyprag"]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
