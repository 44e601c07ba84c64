"""``AdapterStore``: a bounded LRU cache of packed adapters, keyed by directory and file modification times.

PRAG reads every passage adapter from disk for every question. The store reads an adapter directory once
(safetensors memory-mapped via ``safe_open``), validates it with the library's loader, packs it into contiguous
per-layer stacks (:func:`~fcprag_plugin.fast.layout.pack_adapter`) on the chosen device, and keeps it while the
byte budget allows. A changed ``adapter_model.safetensors`` or ``adapter_config.json`` (mtime or size) is
noticed on the next ``get`` and reloaded.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ..adapter import LoraAdapter
from ..adapter_io import CONFIG_NAME, SAFETENSORS_NAME, adapter_from_state_dict, load_adapter_dir, read_config
from ..errors import AdapterError
from .layout import PackedAdapter, pack_adapter

logger = logging.getLogger(__name__)

Fingerprint = tuple[int, int, int, int]  # weights (mtime_ns, size), config (mtime_ns, size)


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    reloads: int = 0  # cached but the files changed
    evictions: int = 0
    uncached: int = 0  # loaded but larger than the whole budget


def _fingerprint(path: Path) -> Fingerprint:
    try:
        cfg = os.stat(path / CONFIG_NAME)
    except FileNotFoundError:
        if not path.exists():
            raise AdapterError(f"{path}: adapter directory not found") from None
        raise AdapterError(f"{path / CONFIG_NAME}: adapter config not found (expected a PEFT '{CONFIG_NAME}')") from None
    try:
        st = os.stat(path / SAFETENSORS_NAME)
        weights = (st.st_mtime_ns, st.st_size)
    except FileNotFoundError:  # legacy adapter_model.bin (or nothing: the loader names what is missing)
        weights = (-1, -1)
    return weights + (cfg.st_mtime_ns, cfg.st_size)


def read_adapter_dir(path: str | Path, *, device: str | torch.device | None = None) -> LoraAdapter:
    """Load a PEFT adapter directory, reading ``adapter_model.safetensors`` memory-mapped (``safe_open``)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    file = path / SAFETENSORS_NAME
    if not file.is_file():
        return load_adapter_dir(path, device=device or "cpu")  # legacy .bin, or the loader's clear error
    cfg = read_config(path / CONFIG_NAME)
    try:
        with safe_open(str(file), framework="pt", device=str(device or "cpu")) as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise AdapterError(f"{file}: corrupt or unreadable safetensors file ({e})") from e
    adapter = adapter_from_state_dict(state, cfg, source=str(file))
    adapter.source = str(path)
    return adapter


class AdapterStore:
    """LRU cache ``adapter directory -> PackedAdapter`` bounded by ``budget_bytes`` of packed tensors.

    Args:
        budget_bytes: the most bytes of adapter tensors kept (default 1 GiB). An adapter larger than the whole
            budget is returned but not kept (with a warning).
        device: where packed adapters live (e.g. the model's GPU, so a merge never crosses devices).
        dtype: the dtype they are packed in (default: as stored; PRAG saves float32).
        check_mtime: re-stat the files on every ``get`` to notice rewritten adapters (two ``stat`` calls).
    """

    def __init__(self, budget_bytes: int = 1 << 30, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, check_mtime: bool = True) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise AdapterError(f"AdapterStore budget_bytes must be a non-negative integer, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.check_mtime = check_mtime
        self.stats = StoreStats()
        self._items: "OrderedDict[str, tuple[Fingerprint, PackedAdapter]]" = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lookup
    @staticmethod
    def key(path: str | Path) -> str:
        return os.path.abspath(os.fspath(path))

    def get(self, path: str | Path) -> PackedAdapter:
        """The packed adapter of directory ``path``: from the cache if its files are unchanged, else read."""
        key = self.key(path)
        with self._lock:
            item = self._items.get(key)
            if item is not None and not self.check_mtime:
                self._items.move_to_end(key)
                self.stats.hits += 1
                return item[1]
        fp = _fingerprint(Path(key))
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                if item[0] == fp:
                    self._items.move_to_end(key)
                    self.stats.hits += 1
                    return item[1]
                self._drop(key)
                self.stats.reloads += 1
                logger.info("%s changed on disk: reloading the adapter", key)
            else:
                self.stats.misses += 1
        packed = self.load(key)
        if _fingerprint(Path(key)) != fp:  # rewritten while we read it: hand it out, do not cache
            logger.warning("%s changed while it was read: not caching it", key)
            return packed
        self._insert(key, fp, packed)
        return packed

    def get_many(self, paths: Iterable[str | Path]) -> list[PackedAdapter]:
        return [self.get(p) for p in paths]

    def load(self, path: str | Path) -> PackedAdapter:
        """Read and pack without touching the cache (the cold path)."""
        adapter = read_adapter_dir(path)
        return pack_adapter(adapter, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ bookkeeping
    def _insert(self, key: str, fp: Fingerprint, packed: PackedAdapter) -> None:
        size = packed.nbytes
        with self._lock:
            if key in self._items:
                self._drop(key)
            if size > self.budget_bytes:
                self.stats.uncached += 1
                logger.warning("%s: packed adapter is %d bytes, more than the store's whole budget of %d bytes; "
                               "not caching it", key, size, self.budget_bytes)
                return
            self._items[key] = (fp, packed)
            self._nbytes += size
            while self._nbytes > self.budget_bytes:
                old = next(iter(self._items))
                self._drop(old)
                self.stats.evictions += 1

    def _drop(self, key: str) -> None:
        _, packed = self._items.pop(key)
        self._nbytes -= packed.nbytes

    def invalidate(self, path: str | Path) -> bool:
        """Forget ``path``; True if it was cached."""
        with self._lock:
            key = self.key(path)
            if key in self._items:
                self._drop(key)
                return True
            return False

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, path: object) -> bool:
        return isinstance(path, (str, Path)) and self.key(path) in self._items

    def keys(self) -> list[str]:
        """Cached directories, least recently used first."""
        return list(self._items)

    def __repr__(self) -> str:
        return (f"AdapterStore(entries={len(self)}, bytes={self.nbytes}/{self.budget_bytes}, device={self.device}, "
                f"stats={self.stats})")
