"""The tools' progress bars, one look for every stage and command: units done of the total, the rate and an
estimate of the time left, on stderr (the library's :mod:`fcprag_plugin.progress`); a log line written through
:func:`write_line` never tears a bar."""

from __future__ import annotations

from typing import Any, Callable

from fcprag_plugin import progress
from fcprag_plugin.progress import write_line  # noqa: F401  (the tools' log lines)


def progress_bar(desc: str, total: float, *, unit: str = "it", initial: float = 0, enabled: bool = True,
                 position: int = 0, fraction: bool = False) -> Any:
    """A bar of ``total`` units starting at ``initial`` (what a resumed run kept); ``position``: its line (a
    launcher's rank, so that the ranks' bars stack). ``fraction``: the count shows a decimal, for a bar that also
    moves inside a batch (:func:`moves_inside`). ``enabled=False``: a bar that draws nothing."""
    n = "{n:.1f}" if fraction else "{n_fmt}"
    return progress.progress_bar(desc, total, unit=unit, enabled=enabled, initial=initial, position=position,
                                 bar_format="{l_bar}{bar}| " + n + "/{total_fmt} [{elapsed}<{remaining}, "
                                            "{rate_fmt}{postfix}]")


def moves_inside(bar: Any, units: int, steps: float) -> tuple[Callable[..., None], Callable[[], None]]:
    """``(step, finish)`` for one batch of ``units``: ``step(k=1)`` moves ``bar`` by ``k * units / steps`` (``k`` of
    about ``steps`` model forwards, or rows, of the batch), never to the batch's end; ``finish()`` at the batch's
    end moves it the rest."""
    per, moved = units / max(steps, 1), [0.0]

    def step(k: float = 1.0) -> None:
        if moved[0] + per * k < units:
            bar.update(per * k)
            moved[0] += per * k

    def finish() -> None:
        bar.update(units - moved[0])
        bar.n = round(bar.n, 6)

    return step, finish

