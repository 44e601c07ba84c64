"""``AdapterStore``: a bounded LRU cache of packed adapters read once (memory-mapped), validated and packed on the
chosen device, keyed by directory and file signatures (rewritten files are reloaded on the next ``get``)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ..adapter import CONFIG_NAME, SAFETENSORS_NAME, LoraAdapter, load_adapter_dir, load_safetensors, warn_zero
from ..errors import AdapterError
from ..loading import CacheStats, file_signature
from .layout import PackedAdapter, pack_adapter

logger = logging.getLogger(__name__)


@dataclass
class StoreStats(CacheStats):
    uncached: int = 0  # loaded but larger than the whole budget


def _fingerprint(path: Path) -> tuple:
    """:func:`~fcprag_plugin.loading.file_signature` of the config and the weights (None for a legacy ``.bin``)."""
    fp = file_signature(path / CONFIG_NAME, path / SAFETENSORS_NAME)
    if fp[0] is None:
        if not path.exists():
            raise AdapterError(f"{path}: adapter directory not found")
        raise AdapterError(f"{path / CONFIG_NAME}: adapter config not found (expected a PEFT '{CONFIG_NAME}')")
    return fp


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class _NotFastPath(Exception):
    """The file is not a plain float safetensors file we can map directly: use ``safe_open`` instead."""


def _mmap_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a zero-copy view into one private memory map; anything unusual raises
    :class:`_NotFastPath` (the store then uses ``load_file``)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or 8 + n > size:  # also a file under 8 bytes
            raise _NotFastPath
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise _NotFastPath from None
    if not isinstance(header, dict):
        raise _NotFastPath
    buf = torch.from_file(str(file), shared=False, size=size, dtype=torch.uint8)
    base = 8 + n
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    try:
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dt = _ST_DTYPES.get(info["dtype"])
            if dt is None:
                raise _NotFastPath  # integer tensors etc.: the regular loader reports them
            isz = torch.finfo(dt).bits // 8
            start, end = (int(v) for v in info["data_offsets"])
            shape = [int(v) for v in info["shape"]]
            if end - start != math.prod(shape) * isz or base + end > size or start < 0 or start % isz:
                raise _NotFastPath
            flat = typed.get(dt)
            if flat is None:  # the whole data region as one typed view (needs an aligned start: else fall back)
                flat = typed[dt] = buf[base:base + (size - base) // isz * isz].view(dt)
            out[key] = flat[start // isz:start // isz + math.prod(shape)].view(shape)
    except (KeyError, TypeError, ValueError, RuntimeError):
        raise _NotFastPath from None
    return out


def _read_mapped(file: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    try:
        state = _mmap_tensors(file)
    except (_NotFastPath, OSError):
        return load_safetensors(file, device)  # the regular reader and its errors
    return state if torch.device(device).type == "cpu" else {k: v.to(device) for k, v in state.items()}


def read_adapter_dir(path: str | Path, *, check_values: bool = True) -> LoraAdapter:
    """Load a PEFT adapter directory, reading ``adapter_model.safetensors`` memory-mapped (``check_values=False``:
    the caller checks values; the tensors may be views of the file's map, copy them before it is rewritten)."""
    return load_adapter_dir(path, check_values=check_values, read_safetensors=_read_mapped)


def pack_checked(adapter: LoraAdapter, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> PackedAdapter:
    """Pack and check the values in bulk: finite (a few big ``isfinite`` instead of one per tensor), not all zero."""
    packed = pack_adapter(adapter, device=device, dtype=dtype)
    for lg, pg in zip(packed.layout.groups, packed.groups):
        # sum(x * 0) is NaN exactly when x holds a NaN or an inf: one reduction, no boolean temporary
        if not (math.isfinite(float((pg.A * 0).sum())) and math.isfinite(float((pg.BT * 0).sum()))):
            adapter.validate()  # raises, naming the key
            raise AdapterError(f"{adapter.source}: modules '{lg.pattern}' overflow {packed.dtype} when packed "
                               f"(finite in the file as {adapter.dtype})")
    if packed.all_zero:
        warn_zero(adapter.source)
    return packed


class AdapterStore:
    """LRU cache ``adapter directory -> PackedAdapter`` of at most ``budget_bytes`` (a larger adapter is returned,
    not kept), packed on ``device`` in ``dtype`` (default: as stored); ``check_mtime``: re-stat on every ``get``."""

    def __init__(self, budget_bytes: int = 1 << 30, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, check_mtime: bool = True) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise AdapterError(f"AdapterStore budget_bytes must be a non-negative integer, got {budget_bytes!r}")
        self.budget_bytes, self.dtype, self.check_mtime = budget_bytes, dtype, check_mtime
        self.device = torch.device(device) if device is not None else None
        self.stats = StoreStats()
        self._items: "OrderedDict[str, tuple[tuple, PackedAdapter]]" = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(path: str | Path) -> str:
        return os.path.abspath(os.fspath(path))

    def get(self, path: str | Path) -> PackedAdapter:
        """The packed adapter of directory ``path``: from the cache if its files are unchanged, else read."""
        key = self.key(path)
        fp = _fingerprint(Path(key)) if self.check_mtime else None
        with self._lock:
            item = self._items.get(key)
            if item is not None and (fp is None or item[0] == fp):
                self._items.move_to_end(key)
                self.stats.hits += 1
                return item[1]
            if item is not None:
                self._drop(key)
                self.stats.reloads += 1
                logger.info("%s changed on disk: reloading the adapter", key)
            else:
                self.stats.misses += 1
        fp = fp or _fingerprint(Path(key))
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
        return pack_checked(read_adapter_dir(path, check_values=False), device=self.device, dtype=self.dtype)

    def _insert(self, key: str, fp: tuple, packed: PackedAdapter) -> None:
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
                self._drop(next(iter(self._items)))
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

    nbytes = property(lambda self: self._nbytes)

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
