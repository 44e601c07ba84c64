"""The study's batch sizes by device: the CPU keeps its defaults; on CUDA each is the largest power of two up to 64
whose estimated memory fits half the free memory, so less free memory never gives a larger batch."""

from __future__ import annotations

import torch

from fcprag_tools.lm import sizing
from helpers import tiny_model


def test_the_cpu_keeps_its_defaults():
    s = sizing.default_batches("cpu", tiny_model())
    assert (s.group, s.aug_batch, s.batch_size) == (16, 8, 16) and "cpu" in s.why


def test_cuda_sizes_follow_the_free_memory(monkeypatch):
    gib = 2 ** 30
    big = sizing.default_batches("cuda", free_bytes=130 * gib)  # an H200 with a 1B model loaded
    assert (big.group, big.aug_batch, big.batch_size) == (64, 64, 64) and "130.0 GiB free" in big.why
    per = sizing.unit_bytes(sizing.LLAMA_1B, 2)
    last = None
    for free in (1, 2, 4, 8, 16, 32, 64):
        s = sizing.default_batches("cuda", free_bytes=free * gib)
        now = (s.group, s.aug_batch, s.batch_size)
        for k, v in zip(("group", "aug_batch", "batch_size"), now):
            assert v == 1 or v * per[k] <= 0.5 * free * gib  # fits the share by estimate ...
            assert v == 64 or 2 * v * per[k] > 0.5 * free * gib  # ... and is the largest power of two that does
        assert last is None or all(a >= b for a, b in zip(now, last))
        last = now
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gib, 80 * gib))
    assert sizing.default_batches("cuda") == sizing.default_batches("cuda", free_bytes=3 * gib)


def test_the_model_given_sets_the_estimate():
    """A tiny model needs next to nothing per unit: 64 everywhere even with 256 MiB free; the 1B shape does not."""
    s = sizing.default_batches("cuda", tiny_model(), free_bytes=2 ** 28)
    assert (s.group, s.aug_batch, s.batch_size) == (64, 64, 64)
    assert sizing.default_batches("cuda", free_bytes=2 ** 28).group < 64
