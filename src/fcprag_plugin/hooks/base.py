"""The shared ``merge_hook`` mechanism of the integration shims.

- :class:`PatchSet`: idempotent, fully reversible attribute patches (restores the exact original objects).
- Query context: :func:`set_context` (explicit), else the caller's locals (``question``, ``passages``), else a
  shim-specific fallback; never a silent uniform merge.
- :class:`MergeHook`: controller + encoder -> merge weights ``w~`` for one question, plus the JSON Lines log.
- :func:`run_script`: run an unmodified host script as ``__main__`` (same sys.path / argv semantics as python).
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterable, Sequence

from ..controller import FusionController, load_controller
from ..errors import HookError
from ..fusion import compute_weights

logger = logging.getLogger(__name__)

_MISSING = object()


# ----------------------------------------------------------------------------- patches
@dataclass
class _Patch:
    owner: Any
    attr: str
    original: Any  # the object found in owner.__dict__, or _MISSING when it was inherited / absent
    replacement: Any


class PatchSet:
    """A named group of attribute patches. ``apply`` is idempotent; ``revert`` restores the originals exactly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._patches: list[_Patch] = []

    @property
    def active(self) -> bool:
        return bool(self._patches)

    def patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.attr`` with ``make(current)``; patching the same (owner, attr) twice is a no-op."""
        for p in self._patches:
            if p.owner is owner and p.attr == attr:
                return
        original = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        current = getattr(owner, attr)
        replacement = make(current)
        setattr(owner, attr, replacement)
        self._patches.append(_Patch(owner, attr, original, replacement))

    def revert(self) -> None:
        for p in reversed(self._patches):
            if p.original is _MISSING:
                try:
                    delattr(p.owner, p.attr)
                except AttributeError:
                    pass
            else:
                setattr(p.owner, p.attr, p.original)
        self._patches.clear()

    def originals(self) -> dict[str, Any]:
        return {f"{getattr(p.owner, '__name__', p.owner)}.{p.attr}": p.original for p in self._patches}


# ----------------------------------------------------------------------------- query context
_ctx = threading.local()


def set_context(question: str, passages: Sequence[str], **extra: Any) -> None:
    """Tell the shims which question and passages the next merge is for (the most reliable source)."""
    _ctx.value = {"question": question, "passages": list(passages), **extra}


def clear_context() -> None:
    _ctx.value = None


def explicit_context() -> dict[str, Any] | None:
    return getattr(_ctx, "value", None)


def find_in_callers(names: Iterable[str], frame: FrameType | None = None, max_depth: int = 30) -> dict[str, Any] | None:
    """The nearest caller frame whose locals hold all ``names`` (e.g. ``question`` and ``passages``)."""
    names = list(names)
    f = frame or sys._getframe(1)
    depth = 0
    while f is not None and depth < max_depth:
        loc = f.f_locals
        if all(n in loc for n in names):
            return {n: loc[n] for n in names}
        f, depth = f.f_back, depth + 1
    return None


def get_context(fallback: Callable[[], dict[str, Any] | None] | None = None, *, what: str = "merge"
                ) -> dict[str, Any]:
    """Resolve ``{"question", "passages", "source", ...}``: explicit, else callers' locals, else ``fallback``."""
    ctx = explicit_context()
    if ctx is not None:
        return {**ctx, "source": "set_context"}
    loc = find_in_callers(("question", "passages"), sys._getframe(1))
    if loc is not None and isinstance(loc["question"], str) and isinstance(loc["passages"], (list, tuple)):
        return {"question": loc["question"], "passages": list(loc["passages"]), "source": "caller_locals"}
    if fallback is not None:
        fb = fallback()
        if fb is not None:
            return {**fb, "source": fb.get("source", "fallback")}
    raise HookError(
        f"fcprag: cannot tell which question and passages this {what} is for: call "
        "fcprag_plugin.hooks.set_context(question, passages) before it, keep local variables named "
        "'question' and 'passages' in the calling function, or give the shim a data file to map adapter paths"
    )


# ----------------------------------------------------------------------------- the hook
class MergeHook:
    """Controller + encoder -> merge weights for one question, and the per-question JSON Lines log.

    ``controller=None`` or a ``uniform`` controller gives ``w~ = [1]*N`` (the host's original merge).
    ``encoder``: a :class:`TextEncoder`, a model name/path, or None (the controller's recorded embedding model).
    """

    def __init__(self, controller: FusionController | str | Path | None = None, encoder: Any = None,
                 mode: str = "cat", log: str | Path | None = None) -> None:
        self.controller = load_controller(controller)
        # A name/path is loaded lazily, and only when the weights need an encoder (not for uniform merges).
        self._encoder_name = str(encoder) if isinstance(encoder, (str, Path)) else None
        self._encoder = None if self._encoder_name is not None else encoder
        self.mode = mode
        self.log_path = Path(log) if log is not None else None
        self.calls = 0
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def encoder(self) -> Any:
        needs = self.controller is not None and self.controller.config.mode != "uniform"
        if self._encoder is None and needs:
            from ..encoding import get_encoder

            # shared per process: the controller's own encoder unless a model was named
            self._encoder = get_encoder(self._encoder_name) if self._encoder_name else self.controller.encoder
        if self._encoder is not None and self.controller is not None:
            self.controller.check_encoder(self._encoder)
        return self._encoder

    def weights(self, question: str, passages: Sequence[str]) -> dict[str, Any]:
        """``{"merge_weights", "weights", "scores", "g", "tau", "controller_mode"}`` for one question."""
        from ..fusion import check_texts

        check_texts(question, passages)
        return compute_weights(question, passages, self.controller, self.encoder)

    def log(self, record: dict[str, Any]) -> None:
        self.calls += 1
        if self.log_path is None:
            return
        line = json.dumps(record, ensure_ascii=False, default=_json_default)
        with open(self.log_path, "a", encoding="utf-8") as f:  # one write per line: no torn records
            f.write(line + "\n")

    @staticmethod
    def timer() -> float:
        return time.perf_counter()


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


# ----------------------------------------------------------------------------- launcher
def run_script(script: str | Path, argv: Sequence[str] = (), *, extra_paths: Sequence[str | Path] = ()) -> dict:
    """Run ``script`` as ``__main__`` like ``python script ARGS``: its directory first on sys.path, sys.argv set.

    Patches must be installed before this call (hosts bind names at import time).
    """
    script = Path(script)
    if not script.is_file():
        raise HookError(f"{script}: script not found")
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *argv]
    sys.path[:0] = [str(script.parent.resolve()), *[str(Path(p).resolve()) for p in extra_paths]]
    try:
        return runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in {"1", "true", "yes"}
