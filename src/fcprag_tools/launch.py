"""Run a host's unmodified script as ``__main__`` with a shim installed (what ``fcprag run`` does)."""

from __future__ import annotations

import logging
import runpy
import sys
from pathlib import Path
from typing import Any, ContextManager, Sequence

from fcprag_plugin.errors import BARE, HookError, kw
from fcprag_plugin.hosts import dyprag, prag
from fcprag_plugin.hosts.base import Shim, check_max_adapters
from fcprag_plugin.weights import is_uniform

logger = logging.getLogger(__name__)


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


def _launch(who: str, script: str | Path, script_args: Sequence[str], installed: ContextManager[Shim]) -> int:
    with installed as shim:
        code = run_host_script(script, list(script_args))
        ctrl = shim.weigher.controller
        logger.info("%s: merged %d question(s) with %s weights", who, shim.merges,
                    "uniform" if is_uniform(ctrl) else ctrl.config.controller_mode)
    return code


def launch_prag(script: str | Path, script_args: Sequence[str] = (), *, controller: Any = None, encoder: Any = None,
                mode: str | None = None, log: str | Path | None = None, data_file: str | Path | None = None,
                use_slot: bool | None = None, slot_max_adapters: int | None = None) -> int:
    """Run PRAG's unmodified ``script`` as ``__main__`` with the shim installed (:func:`prag.install`'s options;
    ``slot_max_adapters`` is ``max_adapters``) and removed afterwards; returns the script's exit status."""
    return _launch("fcprag prag", script, script_args,
                   prag.installed(controller, encoder, mode or "cat", log, data_file, use_slot=bool(use_slot),
                                  max_adapters=slot_max_adapters))


def launch_dyprag(script: str | Path, script_args: Sequence[str] = (), *, controller: Any = None,
                  encoder: Any = None, mode: str | None = None, log: str | Path | None = None,
                  use_slot: bool | None = None, slot_max_adapters: int | None = None, **options: Any) -> int:
    """``fcprag run dyprag``: run DyPRAG's unmodified ``script`` as ``__main__`` with the shim installed; returns
    its exit status. The script's own ``utils`` and ``projector`` are imported fresh (its directory first on
    sys.path) and patched; sys.path and those sys.modules entries are restored afterwards.
    """
    if options:
        usable = ("controller", "encoder", "mode", "log", "use_slot", "slot_max_adapters")
        raise HookError(f"fcprag run dyprag: option(s) {sorted(options)} do not apply to DyPRAG "
                        f"({kw('data_file')} is for prag); use {', '.join(map(kw, usable))}",
                        params=[(name, BARE) for name in ("data_file", *usable)])
    check_max_adapters(slot_max_adapters, bool(use_slot), "fcprag run dyprag")
    script = Path(script)
    if not script.is_file():
        raise HookError(f"fcprag run dyprag: {script}: script not found (expected DyPRAG's src/inference_dyprag.py)")
    src = script.resolve().parent
    names = (dyprag.UTILS_MODULE, dyprag.PROJECTOR_MODULE)
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}  # another directory's 'utils' must not win
    old_path = sys.path[:]
    sys.path.insert(0, str(src))
    try:
        utils_mod, projector_mod = dyprag.host_modules()
        for m in (utils_mod, projector_mod):
            f = getattr(m, "__file__", None)
            if f is None or Path(f).resolve().parent != src:
                raise HookError(f"fcprag run dyprag: '{m.__name__}' was imported from {f}, not from {src}")
        return _launch("fcprag dyprag", script, script_args,
                       dyprag.installed(controller, encoder, mode or "separate", log, utils=utils_mod,
                                        projector=projector_mod, use_slot=bool(use_slot),
                                        max_adapters=slot_max_adapters))
    finally:
        sys.path[:] = old_path
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


LAUNCHERS = {"prag": launch_prag, "dyprag": launch_dyprag}
