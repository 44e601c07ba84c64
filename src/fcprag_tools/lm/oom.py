"""Batches that halve on a GPU out-of-memory error instead of losing the stage.

:func:`halving` runs consecutive batches of a list of units; when a batch raises the device's out-of-memory error
(``torch.OutOfMemoryError``; older torch: ``torch.cuda.OutOfMemoryError``) it frees the allocator's cache, halves
the batch size, says so in one log line and runs the same units again in smaller batches; the smaller size is kept
for the rest of the list. A batch of one unit that still runs out of memory re-raises the error. Used by the
scorer (:func:`fcprag_tools.lm.batched.score_rows`), the study's augmentation and its stacked adapter training.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from fcprag_plugin.compat import OUT_OF_MEMORY_ERRORS

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is the device's out-of-memory error."""
    return isinstance(error, OUT_OF_MEMORY_ERRORS)


def free_cached_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def halving(units: Sequence[T], size: int, run: Callable[[list[T]], R], *, what: str,
            take: Callable[[Sequence[T], int], int] | None = None,
            measure: Callable[[Sequence[T]], int] = len) -> Iterator[tuple[list[T], R]]:
    """Yield ``(batch, run(batch))`` over consecutive batches of ``units``, in order.

    ``take(rest, size)``: how many of the leading ``rest`` units the next batch holds at batch size ``size``
    (default ``min(size, len(rest))``; at least 1); ``measure(batch)``: its size in the same terms as ``size``
    (default ``len``). On an out-of-memory error the size becomes half the failed batch's ``measure`` (at least 1)
    and the same units run again; a failed batch of one unit re-raises.
    """
    if size < 1:
        raise ValueError(f"{what}: batch size must be >= 1, got {size}")
    i = 0
    while i < len(units):
        rest = units[i:]
        n = max(1, min(len(rest), take(rest, size) if take is not None else size))
        batch = list(rest[:n])
        try:
            out = run(batch)
        except BaseException as e:  # noqa: BLE001 -- only the out-of-memory error is handled, all else re-raised
            if not is_oom(e) or n == 1:
                raise
        else:
            yield batch, out
            i += n
            continue
        # outside the except block: the failed batch's frames and tensors are released before the retry
        was = measure(batch)
        size = max(1, was // 2)
        free_cached_memory()
        logger.warning("%s: out of device memory at a batch of %d; going on with batches of %d", what, was, size)
