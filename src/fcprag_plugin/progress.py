"""Progress bars on stderr (tqdm's: units done of the total, the rate, the time left), the one import of tqdm in
``src/``; the tooling's ``fcprag_tools.progress`` builds on it."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


def progress_bar(desc: str, total: float | None, *, unit: str = "it", enabled: bool = True, **options: Any) -> Any:
    """A bar of ``total`` units (a context manager; ``update(n)``), or over ``iterable=`` (``total`` None: its
    length); ``enabled=False``: one that draws nothing; ``options``: tqdm's (``initial``, ``position``, ...)."""
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=not enabled, **options)


def write_line(text: str) -> None:
    """``text`` and a newline on stderr, above any bar on the screen."""
    tqdm.write(text, file=sys.stderr)
