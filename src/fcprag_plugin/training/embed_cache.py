"""On-disk embedding cache: ``<dir>/<slug>-<model hash>/shard-<n>.safetensors`` with ``keys [M, 32]`` uint8 (the
sha256 of each text, never the text) and ``emb [M, d]`` float32, model name and dim in each shard's metadata. A run
that encodes new texts appends one shard atomically; old shards are never rewritten."""

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
from ..progress import progress_bar

logger = logging.getLogger(__name__)

CACHE_FORMAT = "fcprag-embeddings-v1"
ENV_CACHE_DIR = "FCPRAG_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$FCPRAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/fcprag/embeddings``, else ``~/.cache/fcprag/embeddings``."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fcprag" / "embeddings"


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def _model_dir_name(model_name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)[-60:].strip("._") or "model"
    return f"{slug}-{hashlib.sha256(model_name.encode('utf-8')).hexdigest()[:12]}"


class EmbeddingCache:
    """One model's embeddings (names never share entries) under ``root``; ``dim`` checked on the shards (None: read)."""

    def __init__(self, root: str | Path, model_name: str, dim: int | None = None) -> None:
        self.model_name = model_name
        self.dir = Path(root) / _model_dir_name(model_name)
        self.dim = dim
        self._index: dict[bytes, tuple[int, int]] = {}  # key -> (shard, row)
        self._shards: list[torch.Tensor] = []
        self._load()

    def _load(self) -> None:
        from safetensors import SafetensorError, safe_open

        if not self.dir.is_dir():
            return
        for f in sorted(self.dir.glob("shard-*.safetensors"), key=lambda p: (len(p.name), p.name)):
            try:
                with safe_open(str(f), framework="pt") as st:
                    meta = st.metadata() or {}
                    keys, emb = st.get_tensor("keys"), st.get_tensor("emb")
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise EncoderError(f"{f}: corrupt or unreadable embedding cache shard ({e}); delete it to "
                                   "re-encode") from e
            if meta.get("format") != CACHE_FORMAT or meta.get("model") != self.model_name:
                raise EncoderError(f"{f}: metadata says format {meta.get('format')!r}, model {meta.get('model')!r}; "
                                   f"expected {CACHE_FORMAT!r} and {self.model_name!r}")
            if keys.ndim != 2 or keys.shape[1] != 32 or emb.ndim != 2 or emb.shape[0] != keys.shape[0]:
                raise EncoderError(f"{f}: tensors 'keys' {list(keys.shape)} / 'emb' {list(emb.shape)} are malformed; "
                                   "expected [M, 32] and [M, d]")
            if self.dim is None:
                self.dim = int(emb.shape[1])
            elif emb.shape[1] != self.dim:
                raise EncoderError(f"{f}: embeddings are {emb.shape[1]}-d but model '{self.model_name}' gives "
                                   f"{self.dim}-d; delete the cache directory {self.dir}")
            blob = keys.contiguous().numpy().tobytes()
            self._append([blob[i:i + 32] for i in range(0, len(blob), 32)], emb.float())

    def _append(self, keys: list[bytes], rows: torch.Tensor) -> None:
        s = len(self._shards)
        self._shards.append(rows)
        self._index.update((k, (s, row)) for row, k in enumerate(keys))

    def __len__(self) -> int:
        return len(self._index)

    def missing(self, texts: Sequence[str]) -> list[str]:
        """Distinct texts (first-seen order) that are not cached yet."""
        return [t for t in dict.fromkeys(texts) if text_key(t) not in self._index]

    def get(self, texts: Sequence[str]) -> torch.Tensor:
        """``[n, d]`` embeddings of cached texts (KeyError names the first missing one)."""
        rows = []
        for t in texts:
            loc = self._index.get(text_key(t))
            if loc is None:
                raise KeyError(f"text not in the embedding cache: {t[:60]!r}")
            rows.append(self._shards[loc[0]][loc[1]])
        return torch.stack(rows) if rows else torch.empty(0, self.dim or 0)

    def add(self, texts: Sequence[str], emb: torch.Tensor) -> Path:
        """Store the embeddings ``emb [n, d]`` of ``texts`` (distinct and not cached yet: :meth:`missing`) as one
        new shard."""
        from safetensors.torch import save_file

        if emb.ndim != 2 or emb.shape[0] != len(texts):
            raise EncoderError(f"cache add: {len(texts)} texts but embeddings of shape {list(emb.shape)}")
        if self.dim is not None and emb.shape[1] != self.dim:
            raise EncoderError(f"cache add: embeddings are {emb.shape[1]}-d, the cache for '{self.model_name}' "
                               f"holds {self.dim}-d")
        self.dim = int(emb.shape[1])
        digests = [text_key(t) for t in texts]
        keys = torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).view(len(digests), 32)
        rows = emb.detach().float().cpu().contiguous()
        self.dir.mkdir(parents=True, exist_ok=True)
        n = len(list(self.dir.glob("shard-*.safetensors")))
        while (self.dir / f"shard-{n}.safetensors").exists():
            n += 1
        path = self.dir / f"shard-{n}.safetensors"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"keys": keys, "emb": rows}, str(tmp),
                  metadata={"format": CACHE_FORMAT, "model": self.model_name, "dim": str(self.dim)})
        os.replace(tmp, path)  # readers never see a half-written shard
        self._append(digests, rows)
        return path


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
                        len(cache), cache.dir)
    elif cache is not None and texts:
        logger.info("all %d distinct texts found in the embedding cache %s", len(set(texts)), cache.dir)
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

    # loaded once, on first need, shared by the train and validation sets: the process-wide encoder
    return resolve_model(encoder)[0], functools.cache(lambda: get_encoder(encoder))


def open_cache(cache_dir: str | Path | None, model_name: str, dim: int | None) -> EmbeddingCache | None:
    if cache_dir == "":
        return None
    return EmbeddingCache(default_cache_dir() if cache_dir is None else cache_dir, model_name, dim)
