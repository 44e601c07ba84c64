"""Sharding over processes (torchrun / accelerate launch): rank ``r`` of ``W`` takes units ``i % W == r`` and
writes ``OUT.part{r}-of{W}.jsonl``; the launcher's environment and its process group."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fcprag_plugin.errors import LabelFileError


@dataclass(frozen=True)
class ShardInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def shard_from_env(env: Mapping[str, str] | None = None) -> ShardInfo:
    """Rank, world size and local rank from the launcher's environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``).
    ``WORLD_SIZE > 1`` without ``MASTER_ADDR`` is refused: without a process group the ranks could not wait for
    each other (rank 0 would merge the part files while the others still write them)."""
    env = os.environ if env is None else env

    def read(key: str, default: str) -> int:
        try:
            return int(env.get(key, default))
        except ValueError:
            raise LabelFileError(f"environment variable {key}={env[key]!r}: expected an integer (set by torchrun / "
                                 "accelerate launch)") from None

    rank, world = read("RANK", "0"), read("WORLD_SIZE", "1")
    local_rank = read("LOCAL_RANK", str(rank))
    if world < 1 or not 0 <= rank < world:
        raise LabelFileError(f"environment: RANK={rank}, WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
    if world > 1 and not env.get("MASTER_ADDR"):
        raise LabelFileError(f"environment: WORLD_SIZE={world} without MASTER_ADDR: several processes need a "
                             "launcher's process group; start them with torchrun or accelerate launch (or unset "
                             "WORLD_SIZE for one process)")
    return ShardInfo(rank, world, local_rank)


def part_path(out: str | Path, rank: int, world: int) -> Path:
    """``labels.jsonl`` -> ``labels.part{rank}-of{world}.jsonl`` (the ``.jsonl`` suffix is kept last)."""
    out = Path(out)
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.part{rank}-of{world}.jsonl")


def output_path(out: str | Path, shard: ShardInfo) -> Path:
    return part_path(out, shard.rank, shard.world) if shard.distributed else Path(out)


# ----------------------------------------------------------------------------- process group
def init_process_group(shard: ShardInfo, env: Mapping[str, str] | None = None) -> bool:
    """Join the launcher's process group (gloo: it only carries barriers) so rank 0 can merge at the end; False
    (no group) in a plain process or without ``MASTER_ADDR`` (:func:`shard_from_env` refuses that case for several
    processes). Long timeout: ranks wait at the final barrier."""
    env = os.environ if env is None else env
    if not shard.distributed or "MASTER_ADDR" not in env:
        return False
    import torch.distributed as dist

    if not dist.is_available():
        raise LabelFileError(f"WORLD_SIZE={shard.world}: this torch build has no torch.distributed; run one process")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=shard.rank, world_size=shard.world,
                                timeout=datetime.timedelta(days=7))
    return True
