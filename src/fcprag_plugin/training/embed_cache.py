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
    """One model's embeddings (names never share entries) in the file ``path`` under ``root``: ``rows`` by the
    sha256 of their text; ``dim`` checked against the file (None: read from it)."""

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

    def save(self) -> Path:
        """Write the file again, whole (atomically: a reader never sees half of it)."""
        from safetensors.torch import save

        keys = torch.frombuffer(bytearray(b"".join(self.rows)), dtype=torch.uint8).view(len(self.rows), 32)
        return write_atomic(self.path, save({"keys": keys, "emb": torch.stack(list(self.rows.values()))},
                                            metadata={"model": self.model_name}))


def embed_texts(texts: Sequence[str], encoder: Any, cache: EmbeddingCache | None = None, *,
                batch_size: int = 256, progress: bool = False) -> torch.Tensor:
    """``[len(texts), d]``; only texts missing from ``cache`` go to ``encoder`` (a TextEncoder or a factory), and
    then the cache's file is written again."""
    keys = [text_key(t) for t in texts]
    rows = cache.rows if cache is not None else {}
    missing = list(dict.fromkeys(t for t, k in zip(texts, keys) if k not in rows))
    if missing:
        enc = encoder() if callable(encoder) and not hasattr(encoder, "encode") else encoder
        if cache is not None and enc.name != cache.model_name:
            raise EncoderError(f"encoder '{enc.name}' does not match the cache's model '{cache.model_name}'")
        chunks = progress_bar(f"embedding {len(missing)} texts", None, unit="batch", enabled=progress,
                              iterable=range(0, len(missing), batch_size))
        fresh = torch.cat([enc.encode(missing[i:i + batch_size]) for i in chunks]).float()
        if cache is not None and fresh.shape[1] != (cache.dim or fresh.shape[1]):
            raise EncoderError(f"encoder '{enc.name}' gives {fresh.shape[1]}-d embeddings but the cache "
                               f"{cache.path} holds {cache.dim}-d ones; delete it to encode again")
        rows.update(zip(map(text_key, missing), fresh))
        if cache is not None:
            cache.dim = fresh.shape[1]
            cache.save()
            logger.info("embedded %d new texts with '%s' (cache: %d entries in %s)", len(missing), enc.name,
                        len(cache), cache.path)
    elif cache is not None and keys:
        logger.info("all %d distinct texts found in the embedding cache %s", len(set(keys)), cache.path)
    return torch.stack([rows[k] for k in keys]) if keys else torch.empty(0, 0)


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
