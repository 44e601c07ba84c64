"""Process-wide load caches (:class:`LoadCache`): a controller directory and an embedding model are each loaded
once per process. Cached objects are shared: do not modify them (``FusionController.from_pretrained`` copies)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0  # built because absent
    reloads: int = 0  # built again because the files changed
    evictions: int = 0


_CACHES: "weakref.WeakSet[LoadCache[Any]]" = weakref.WeakSet()  # every live LoadCache


class LoadCache(Generic[T]):
    """A bounded, thread-safe LRU map ``key -> (signature, value)``: ``get`` returns the value cached under the
    current ``signature()`` (e.g. file stats), else ``build()``'s (per-key lock), kept unless the signature moved."""

    def __init__(self, name: str, maxsize: int, on_clear: Callable[[], None] | None = None) -> None:
        self.name, self.maxsize = name, maxsize
        self.stats = CacheStats()
        self.on_clear = on_clear  # forget what the owner derived from the entries (e.g. name lookups)
        self._items: OrderedDict[Hashable, tuple[Any, T]] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[Hashable, threading.Lock] = {}
        _CACHES.add(self)  # clear_caches / cache_info see every cache without importing its owner

    def _lookup(self, key: Hashable, sig: Any) -> tuple[bool, T | None]:
        with self._lock:
            item = self._items.get(key)
            if item is not None and item[0] == sig:
                self._items.move_to_end(key)
                self.stats.hits += 1
                return True, item[1]
            return False, None

    def get(self, key: Hashable, build: Callable[[], T], signature: Callable[[], Any] = lambda: None) -> T:
        sig = signature()
        found, value = self._lookup(key, sig)
        if found:
            return value  # type: ignore[return-value]
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            found, value = self._lookup(key, sig)  # built by another thread while we waited
            if found:
                return value  # type: ignore[return-value]
            value = build()
            if signature() != sig:
                logger.warning("%s: %s changed while it was read; not caching it", self.name, key)
                return value
            with self._lock:
                if key in self._items:
                    self.stats.reloads += 1
                    del self._items[key]
                else:
                    self.stats.misses += 1
                self._items[key] = (sig, value)
                while len(self._items) > max(self.maxsize, 0):
                    old, _ = self._items.popitem(last=False)
                    self._key_locks.pop(old, None)
                    self.stats.evictions += 1
            return value

    def clear(self) -> None:
        """Forget every entry (objects already handed out stay valid) and reset the counters."""
        with self._lock:
            self._items.clear()
            self._key_locks.clear()
            self.stats = CacheStats()
        if self.on_clear is not None:
            self.on_clear()

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"LoadCache({self.name!r}, entries={len(self)}/{self.maxsize}, stats={self.stats})"


def file_signature(*files: Path) -> tuple[tuple[int, int, int] | None, ...]:
    """``(size, mtime_ns, inode)`` per file (None if missing): a rewrite or an ``os.replace`` (new inode) changes it."""
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def clear_caches() -> None:
    """Empty the process-wide controller and encoder caches (the next use reloads from disk)."""
    for c in list(_CACHES):
        c.clear()


def cache_info() -> dict[str, dict[str, int]]:
    """``{cache name: {"entries", "maxsize", "hits", "misses", "reloads", "evictions"}}``."""
    return {c.name: {"entries": len(c), "maxsize": c.maxsize, **asdict(c.stats)}
            for c in sorted(_CACHES, key=lambda c: c.name)}
