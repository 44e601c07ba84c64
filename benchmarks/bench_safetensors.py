"""Reading PRAG-shaped adapter directories: the slot store's own safetensors header parser vs safetensors' readers,
side by side in one run.

Each reader loads every adapter of a question (``--ns``: 3 and 10 adapters) through
:func:`fcprag_plugin.adapter.load_adapter_dir` (config, key checks) and packs it for the slot
(:func:`fcprag_plugin.slot.store.pack_checked`), as :class:`~fcprag_plugin.slot.AdapterStore` does on a miss:

- ``own``: ``slot/store.py``'s parser (one private memory map, zero-copy typed views);
- ``load_file``: ``safetensors.torch.load_file`` (the library's :func:`~fcprag_plugin.adapter.load_safetensors`);
- ``safe_open``: ``safetensors.safe_open(framework="pt")`` and ``get_tensor`` per key.

Warm: the files are in the page cache. Cold: every file is dropped from the page cache before each read
(``posix_fadvise(DONTNEED)`` after an ``fsync``; no root needed). Adapters: Llama-3.2-1B's 16 layers (``--layers``),
LoRA r=2 on gate/up/down_proj, fp32 (PRAG's layout). Rounds alternate the readers; prints per-question medians
and the ratios to ``own``.

    OMP_NUM_THREADS=1 .venv/latest/bin/python benchmarks/bench_safetensors.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fcprag_plugin.adapter import load_adapter_dir, load_safetensors
from fcprag_plugin.slot.store import _read_mapped, pack_checked

TARGETS = {"gate_proj": (8192, 2048), "up_proj": (8192, 2048), "down_proj": (2048, 8192)}  # (out, in)


def write_adapter(path: Path, layers: int, r: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(layers):
        for name, (out_f, in_f) in TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.mlp.{name}"
            state[f"{key}.lora_A.weight"] = torch.randn(r, in_f, generator=g) * 0.02
            state[f"{key}.lora_B.weight"] = torch.randn(out_f, r, generator=g) * 0.02
    path.mkdir(parents=True)
    save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 32, "target_modules": list(TARGETS), "lora_dropout": 0.0,
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": "llama-3.2-1b-shaped"}))
    return path


def read_safe_open(file: Path, device: str) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt", device=str(device)) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


READERS = {"own": _read_mapped, "load_file": load_safetensors, "safe_open": read_safe_open}


def drop_from_page_cache(dirs: list[Path]) -> None:
    for d in dirs:
        for f in d.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_question(dirs: list[Path], reader, cold: bool) -> float:
    if cold:
        drop_from_page_cache(dirs)
    t0 = time.perf_counter()
    for d in dirs:
        pack_checked(load_adapter_dir(d, check_values=False, read_safetensors=reader))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ns", default="3,10")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ns = [int(x) for x in args.ns.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_adapter(Path(tmp) / f"a{i}", args.layers, 2, i) for i in range(max(ns))]
        print(f"{args.layers} layers, r=2 on {list(TARGETS)}, fp32: "
              f"{(dirs[0] / 'adapter_model.safetensors').stat().st_size / 2**20:.2f} MiB per adapter; "
              f"{args.rounds} rounds, medians per question (ms)")
        print(f"{'N':>3} {'cache':>5} " + " ".join(f"{k:>10}" for k in READERS)
              + "  " + " ".join(f"{k + '/own':>14}" for k in READERS if k != "own"))
        for n in ns:
            for cold in (True, False):
                times: dict[str, list[float]] = {k: [] for k in READERS}
                for name, reader in READERS.items():  # warm-up (imports, allocator)
                    one_question(dirs[:n], reader, cold)
                for rnd in range(args.rounds):
                    order = list(READERS) if rnd % 2 == 0 else list(reversed(READERS))
                    for name in order:
                        times[name].append(one_question(dirs[:n], READERS[name], cold))
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                print(f"{n:>3} {'cold' if cold else 'warm':>5} " + " ".join(f"{med[k]:>10.2f}" for k in READERS)
                      + "  " + " ".join(f"{med[k] / med['own']:>14.2f}" for k in READERS if k != "own"))


if __name__ == "__main__":
    main()
