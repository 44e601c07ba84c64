"""The on-disk embedding cache: one safetensors file per embedding model, ``<dir>/<slug>-<model hash>.safetensors``,
with the sha256 of each text (``keys [M, 32]`` uint8, never the text) and its embedding (``emb [M, d]`` float32).
It is read whole, and written whole (atomically, :func:`~fcprag_plugin.fileio.write_atomic`) when a run encodes
new texts (the first study's 126 questions hold 818 texts: 86 s of encoding on the project's busy 2-core VM)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import EncoderError, FcpragError
from ..fileio import read_tensor_file, write_atomic
from ..progress import progress_bar

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "FCPRAG_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$FCPRAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/fcprag/embeddings``, else ``~/.cache/fcprag/embeddings``."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fcprag" / "embeddings"


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class EmbeddingCache:
    """One model's embeddings (names never share entries) in ``root``; ``dim`` checked on the file (None: read)."""

    def __init__(self, root: str | Path, model_name: str, dim: int | None = None) -> None:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)[-60:].strip("._") or "model"
        self.model_name, self.dim = model_name, dim
        self.path = Path(root) / f"{slug}-{hashlib.sha256(model_name.encode('utf-8')).hexdigest()[:12]}.safetensors"
        self.rows: dict[bytes, torch.Tensor] = {}
        if not self.path.is_file():
            return
        tensors = read_tensor_file(self.path, "cpu", EncoderError, "")
        keys, emb = tensors.get("keys"), tensors.get("emb")
        if keys is None or emb is None or keys.ndim != 2 or keys.shape[1] != 32 or emb.ndim != 2 \
                or len(emb) != len(keys) or emb.shape[1] != (dim or emb.shape[1]):
            shapes = [None if t is None else list(t.shape) for t in (keys, emb)]
            raise EncoderError(f"{self.path}: tensors 'keys' / 'emb' are {shapes}; expected [M, 32] and [M, "
                               f"{dim or 'd'}] (model '{model_name}'): delete the file to encode again")
        self.dim, blob = int(emb.shape[1]), keys.numpy().tobytes()
        self.rows = {blob[32 * i:32 * i + 32]: row for i, row in enumerate(emb.float())}

    def __len__(self) -> int:
        return len(self.rows)

    def missing(self, texts: Sequence[str]) -> list[str]:
        """Distinct texts (first-seen order) that are not cached yet."""
        return [t for t in dict.fromkeys(texts) if text_key(t) not in self.rows]

    def get(self, texts: Sequence[str]) -> torch.Tensor:
        """``[n, d]`` embeddings of cached texts (KeyError names the first missing one)."""
        missing = self.missing(texts)
        if missing:
            raise KeyError(f"text not in the embedding cache: {missing[0][:60]!r}")
        return torch.stack([self.rows[text_key(t)] for t in texts]) if texts else torch.empty(0, self.dim or 0)

    def add(self, texts: Sequence[str], emb: torch.Tensor) -> Path:
        """Store the embeddings ``emb [n, d]`` of ``texts`` and write the cache file again, whole."""
        from safetensors.torch import save

        if emb.ndim != 2 or emb.shape[0] != len(texts) or emb.shape[1] != (self.dim or emb.shape[1]):
            raise EncoderError(f"cache add: {len(texts)} texts and embeddings of shape {list(emb.shape)}; the cache "
                               f"for '{self.model_name}' holds {self.dim or 'd'}-d rows, one per text")
        self.dim = int(emb.shape[1])
        self.rows.update(zip(map(text_key, texts), emb.detach().float().cpu()))
        keys = torch.frombuffer(bytearray(b"".join(self.rows)), dtype=torch.uint8).view(len(self.rows), 32)
        return write_atomic(self.path, save({"keys": keys, "emb": torch.stack(list(self.rows.values()))},
                                            metadata={"model": self.model_name}))


def embed_texts(texts: Sequence[str], encoder: Any, cache: EmbeddingCache | None = None, *,
                batch_size: int = 256, progress: bool = False) -> torch.Tensor:
    """``[len(texts), d]``; only texts missing from ``cache`` go to ``encoder`` (a TextEncoder or a factory)."""
    texts = list(texts)
    missing = cache.missing(texts) if cache is not None else list(dict.fromkeys(texts))
    fresh = torch.empty(0, 0)
    if missing:
        enc = encoder() if callable(encoder) and not hasattr(encoder, "encode") else encoder
        if cache is not None and enc.name != cache.model_name:
            raise EncoderError(f"encoder '{enc.name}' does not match the cache's model '{cache.model_name}'")
        chunks = progress_bar(f"embedding {len(missing)} texts", None, unit="batch", enabled=progress,
                              iterable=range(0, len(missing), batch_size))
        fresh = torch.cat([enc.encode(missing[i:i + batch_size]) for i in chunks]).float()
        if cache is not None:
            cache.add(missing, fresh)
            logger.info("embedded %d new texts with '%s' (cache: %d entries in %s)", len(missing), enc.name,
                        len(cache), cache.path)
    elif cache is not None and texts:
        logger.info("all %d distinct texts found in the embedding cache %s", len(set(texts)), cache.path)
    if cache is not None:
        return cache.get(texts)
    lookup = dict(zip(missing, fresh))
    return torch.stack([lookup[t] for t in texts]) if texts else fresh


def resolve_encoder(encoder: Any) -> tuple[str, Any]:
    """``(name, encoder or factory)``: a TextEncoder passes through; a name or None loads on a cache miss only."""
    if encoder is not None and not isinstance(encoder, (str, Path)):
        if not (hasattr(encoder, "encode") and hasattr(encoder, "name")):
            raise FcpragError(f"encoder: expected a TextEncoder, a model name/path or None, got "
                              f"{type(encoder).__name__}")
        return str(encoder.name), encoder
    from ..encoding import get_encoder, resolve_model

    # loaded once, on first need: the process-wide encoder
    return resolve_model(encoder)[0], functools.cache(lambda: get_encoder(encoder))


def open_cache(cache_dir: str | Path | None, model_name: str, dim: int | None) -> EmbeddingCache | None:
    if cache_dir == "":
        return None
    return EmbeddingCache(default_cache_dir() if cache_dir is None else cache_dir, model_name, dim)
