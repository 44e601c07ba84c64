"""Process-wide load caches (:class:`LoadCache`), so a controller directory (``controller.cached_controller``)
and an embedding model (``encoding.get_encoder``) are each loaded once per process; the JSON and safetensors
readers and the one atomic file writer. Cached objects are shared: do not train or modify them in place
(``FusionController.from_pretrained`` gives a private copy).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, Iterable, Iterator, TypeVar

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
    """A bounded, thread-safe LRU map ``key -> (signature, value)`` that builds missing values once.

    ``get(key, build, signature)``: the cached value when present and its stored signature equals
    ``signature()`` (e.g. file sizes and mtimes), else ``build()``'s result, which is stored. Construction runs
    under a per-key lock (other keys stay available); a value whose signature changed while it was being built is
    returned but not stored (it may mix old and new files).
    """

    def __init__(self, name: str, maxsize: int, on_clear: Callable[[], None] | None = None) -> None:
        self.name = name
        self.maxsize = maxsize
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
                    old = next(iter(self._items))
                    del self._items[old]
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


def finite_or_none(obj: Any) -> Any:
    """NaN / inf -> None, recursively through dicts, lists and tuples, so a record is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def split_lines(text: str, keepends: bool = False) -> list[str]:
    """``text``'s lines, broken at ``"\\n"`` only (a ``"\\r"`` before it stays: JSON reads it as whitespace). The
    JSON Lines readers use this, not ``str.splitlines()``, which also breaks at U+2028, U+0085 and other characters
    that JSON strings written with ``ensure_ascii=False`` hold raw."""
    lines = text.split("\n")
    last = lines.pop()  # "" when the text ends with a newline (or is empty)
    if keepends:
        lines = [line + "\n" for line in lines]
    return lines + [last] if last else lines


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temp file beside it, ``fsync`` and ``os.replace``: a reader,
    or a run resumed after a crash, never sees a half-written file, and no temp file is left when a step fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented strict JSON (NaN/inf as null, other non-JSON values as ``str``), atomically."""
    return write_atomic(path, json.dumps(finite_or_none(obj), indent=2, allow_nan=False, default=str) + "\n")


def parse_json_lines(lines: Iterable[str]) -> Iterator[tuple[int, str, Any, json.JSONDecodeError | None]]:
    """``(line number, raw line, value, error)`` per non-blank line (``lines`` from :func:`split_lines` or a text
    file); where a line is not valid JSON, ``value`` is None and ``error`` says why. The one JSON Lines parser:
    each reader turns ``error`` into its own message."""
    for lineno, raw in enumerate(lines, start=1):
        if raw.strip():
            try:
                value, error = json.loads(raw), None
            except json.JSONDecodeError as e:
                value, error = None, e
            yield lineno, raw, value, error


def read_json_object(path: Path, error: type[Exception], missing: str) -> dict[str, Any]:
    """The JSON object in ``path`` (the one reader of JSON config files); a missing file, invalid JSON or a
    non-object is an ``error`` naming the file (``missing``: what to say when it does not exist)."""
    if not path.is_file():
        raise error(f"{path}: {missing}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_tensor_file(path: Path, device: Any, error: type[Exception], missing: str) -> dict[str, Any]:
    """The tensors of safetensors file ``path`` on ``device``; a missing or unreadable file is an ``error`` naming
    it (``missing``: what to say when it does not exist)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise error(f"{path}: {missing}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise error(f"{path}: corrupt or unreadable safetensors file ({e})") from e


def file_signature(*files: Path) -> tuple[tuple[int, int, int] | None, ...]:
    """``(size, mtime_ns, inode)`` of each file, None where it is missing: changes when a file is rewritten or
    replaced (a new inode catches ``os.replace`` of a copy that kept its mtime)."""
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
