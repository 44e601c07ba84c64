"""Which question and passages a host's merge is for: :func:`set_context` (thread-local), else the locals
``question`` and ``passages`` (or another name for the passages' list) of a calling function (as in PRAG's and
DyPRAG's loops), else the shim's fallback."""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, Callable, Sequence

from ..errors import HookError

_ctx = threading.local()


def set_context(question: str, passages: Sequence[str], **extra: Any) -> None:
    """Tell the shims which question and passages the next merge is for (the most reliable source)."""
    _ctx.value = {"question": question, "passages": list(passages), **extra}


def clear_context() -> None:
    _ctx.value = None


def explicit_context() -> dict[str, Any] | None:
    return getattr(_ctx, "value", None)


def find_in_callers(names: Sequence[str], frame: FrameType | None = None) -> dict[str, Any] | None:
    """The nearest of 30 caller frames whose locals hold all ``names`` (e.g. ``question`` and ``passages``)."""
    f = frame or sys._getframe(1)
    for _ in range(30):
        if f is None:
            return None
        if all(n in f.f_locals for n in names):
            return {n: f.f_locals[n] for n in names}
        f = f.f_back
    return None


def caller_test_id(ctx: dict[str, Any]) -> int | str | None:
    """The host's question index: ``set_context(..., test_id=...)``, else a ``test_id`` local of a calling function
    (PRAG's and DyPRAG's loops both have one), else None."""
    tid = ctx.get("test_id")
    if tid is None:
        found = find_in_callers(("test_id",), sys._getframe(1))
        tid = found["test_id"] if found else None
    return tid if isinstance(tid, (int, str)) and not isinstance(tid, bool) else None


def get_context(fallback: Callable[[], dict[str, Any] | None] | None = None, *, what: str = "merge",
                passages: Sequence[str] = ("passages",)) -> dict[str, Any]:
    """Resolve ``{"question", "passages", "source", ...}``: explicit, else callers' locals (``question``, a str,
    and the first of the ``passages`` names that holds a list), else ``fallback``."""
    ctx = explicit_context()
    if ctx is not None:
        return {**ctx, "source": "set_context"}
    for name in passages:
        loc = find_in_callers(("question", name), sys._getframe(1))
        if loc is not None and isinstance(loc["question"], str) and isinstance(loc[name], (list, tuple)):
            return {"question": loc["question"], "passages": list(loc[name]), "source": "caller_locals"}
    fb = fallback() if fallback is not None else None
    if fb is not None:
        return {**fb, "source": fb.get("source", "fallback")}
    raise HookError(f"fcprag: cannot tell which question and passages this {what} is for: call "
                    "fcprag_plugin.hosts.set_context(question, passages) before it, keep local variables named "
                    "'question' and 'passages' in the calling function, or give the shim a data file to map adapter "
                    "paths")
