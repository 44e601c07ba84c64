"""What the integration shims share; ``prag.py`` / ``dyprag.py`` add only their patches and their merge step.

- :class:`Shim` + :class:`Lifecycle`: the one install / uninstall / installed / launch lifecycle (at most one
  installed shim per host; installing again replaces it; ``installed()`` restores the previous state).
- :class:`PatchSet`: idempotent, fully reversible attribute patches (restores the exact original objects).
- Query context: :func:`set_context` (explicit) and the shim's data-file mapping are the documented ways; the
  caller's locals (``question``, ``passages``, ``test_id``) are searched as a fallback; never a silent uniform merge.
- :class:`MergeHook`: controller + encoder -> :class:`~fcprag_plugin.weights.FusionWeights` for one question, plus
  the JSON Lines log.
- :func:`run_script`: run an unmodified host script as ``__main__`` (same sys.path / argv semantics as python).
"""

from __future__ import annotations

import contextlib
import json
import logging
import runpy
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..controller import FusionController, load_controller
from ..errors import HookError
from ..weights import FusionWeights, finite_or_none, is_uniform, side_inputs
from ._slot_bridge import ShimSlots, check_max_adapters

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


def caller_test_id(ctx: dict[str, Any]) -> int | str | None:
    """The host's question index: ``set_context(..., test_id=...)``, else a ``test_id`` local of a calling function
    (PRAG's and DyPRAG's loops both have one), else None."""
    tid = ctx.get("test_id")
    if tid is None:
        found = find_in_callers(("test_id",), sys._getframe(1), max_depth=30)
        tid = found["test_id"] if found else None
    return tid if isinstance(tid, (int, str)) and not isinstance(tid, bool) else None


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
        if self._encoder is None and not is_uniform(self.controller):
            from ..encoding import get_encoder

            # shared per process: the controller's own encoder unless a model was named
            self._encoder = get_encoder(self._encoder_name) if self._encoder_name else self.controller.encoder
        if self._encoder is not None and self.controller is not None:
            self.controller.check_encoder(self._encoder)
        return self._encoder

    def weights(self, question: str, passages: Sequence[str], adapters: Any = None) -> FusionWeights:
        """The :class:`~fcprag_plugin.weights.FusionWeights` for one question.

        Side features: the hosts hand over their passages in retrieval order, so ``retrieval_rank`` is the
        position (1..N); ``adapter_stats`` come from ``adapters`` (LoraAdapters, or a callable giving them, read
        only when needed); the hosts keep no retrieval scores, so a controller trained with ``retrieval_score``
        is refused by ``predict`` with a message naming the argument.
        """
        from ..fusion import check_texts

        check_texts(question, passages)
        side = side_inputs(self.controller, adapters=adapters,
                           retrieval_ranks=[float(i + 1) for i in range(len(passages))])
        return FusionWeights.for_query(question, passages, self.controller, self.encoder, side)

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


def run_host_script(script: str | Path, argv: Sequence[str] = ()) -> int:
    """:func:`run_script`, returning the exit status ``python script ARGS`` would have (``sys.exit`` is caught)."""
    try:
        run_script(script, argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        sys.stderr.write(f"{e.code}\n")  # what python prints for sys.exit("message")
        return 1
    return 0


# ----------------------------------------------------------------------------- the shim lifecycle
class Shim:
    """What every host shim holds: the weight hook (controller, encoder, log), the merge ``mode``, the fused slots
    of ``use_slot`` (``slots``), its patches, and the per-question log (``merges``, ``last_record``).

    Subclasses set ``who`` and ``lifecycle`` and implement :meth:`apply` (install their patches into
    ``self.patches``) and their merge step; :meth:`close` releases what a question left behind.
    """

    who = "fcprag"
    lifecycle: "Lifecycle"

    def __init__(self, hook: MergeHook, mode: str, *, use_slot: bool = False, max_adapters: int | None = None
                 ) -> None:
        self.hook = hook
        self.mode = mode
        self.use_slot = bool(use_slot)
        self.slots = ShimSlots(check_max_adapters(max_adapters, self.use_slot, self.who), self.who)
        self.patches = PatchSet(self.who)
        self.merges = 0
        self.last_record: dict[str, Any] | None = None
        self._warned: set[str] = set()

    def apply(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Switch off and remove this shim's fused slots (the base models are exactly as before)."""
        self.slots.close()

    def teardown(self) -> None:
        """Restore every patched attribute exactly and :meth:`close`."""
        self.patches.revert()
        self.close()

    @property
    def active(self) -> bool:
        return self.lifecycle.current is self

    def uninstall(self) -> None:
        if self.active:
            self.lifecycle.uninstall()
        else:
            self.teardown()

    def __enter__(self) -> "Shim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def warn_once(self, key: str, msg: str, *args: Any) -> None:
        """One warning per kind per installed shim (per run), not one per question."""
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def log_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """Count the question and write its record (strict JSON: NaN / inf become null) to the log."""
        record = finite_or_none(record)
        self.merges += 1
        self.last_record = record
        self.hook.log(record)
        return record


class Lifecycle:
    """install / uninstall / installed / launch of one host's shims: at most one is installed at a time."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.current: Shim | None = None

    def install(self, shim: Shim) -> Shim:
        """Install ``shim`` (its patches), replacing the installed one."""
        if self.current is not None:
            logger.info("%s: replacing the installed shim", self.who)
            self.uninstall()
        shim.apply()
        self.current = shim
        return shim

    def uninstall(self) -> None:
        """Undo :meth:`install` (no-op when nothing is installed)."""
        shim, self.current = self.current, None
        if shim is not None:
            shim.teardown()

    def is_installed(self) -> bool:
        return self.current is not None

    @contextlib.contextmanager
    def installed(self, shim: Shim) -> Iterator[Shim]:
        """Install ``shim`` for the block; restores the previous state (installed or not) on exit."""
        previous = self.current
        self.install(shim)
        try:
            yield shim
        finally:
            self.uninstall()
            if previous is not None:
                previous.apply()
                self.current = previous

    def launch(self, script: str | Path, script_args: Sequence[str], shim: Shim) -> int:
        """Run the unmodified host ``script`` as ``__main__`` with ``shim`` installed; returns its exit status."""
        with self.installed(shim):
            code = run_host_script(script, list(script_args))
            ctrl = shim.hook.controller
            logger.info("%s: merged %d question(s) with %s weights", self.who, shim.merges,
                        "uniform" if is_uniform(ctrl) else ctrl.config.mode)
        return code
