"""What the stages of one ``fcprag study`` invocation share (:class:`StudyRun`): the study folder and its stores,
this process's shard of a launch, the progress bars, and what is loaded once on first need (the model of its
:class:`~fcprag_tools.options.ModelPart` and its tokenizer, the passage adapters, the device's batch sizes)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fcprag_plugin.errors import FcpragError
from ..lm.shard import ShardInfo, init_process_group
from ..lm.sizing import BatchSizes
from ..lm.units import UnitStore, log_timing
from ..options import ModelPart
from ..progress import progress_bar
from . import adapters as ad

logger = logging.getLogger(__name__)


@dataclass
class StudyRun:
    """One invocation on the study folder ``out`` as rank ``shard.rank`` of ``shard.world`` processes. The model
    (``lm``: which, in what dtype, on what device), the adapters and the device's batch sizes are loaded by the
    first stage that has work for them; ``times`` sums each stage's seconds (the summary's ``stage_seconds``)."""

    out: Path
    shard: ShardInfo = ShardInfo()
    progress: bool = True
    lm: ModelPart = ModelPart()
    model: Any = None
    tok: Any = None
    adapters: dict[str, Any] = field(default_factory=dict)
    batches: BatchSizes | None = None
    times: dict[str, float] = field(default_factory=dict)

    def store(self, name: str) -> UnitStore:
        """``OUT/<name>.jsonl`` (this rank's part file under a launcher)."""
        return UnitStore(self.out / f"{name}.jsonl", self.shard)

    def barrier(self, *merge: str) -> None:
        """Wait for every rank, then rank 0 folds the part files of ``merge`` stores into their main files. One
        process folds them too: part files of a launch that was killed, resumed here with another number of
        processes."""
        if not self.shard.distributed:
            for name in merge:
                self.store(name).merge()
        elif init_process_group(self.shard):
            import torch.distributed as dist

            dist.barrier()
            if self.shard.rank == 0:
                for name in merge:
                    self.store(name).merge()
            dist.barrier()

    def mine(self, units: list[Any]) -> list[Any]:
        """This rank's share of ``units`` (every ``world``-th, round robin)."""
        return units[self.shard.rank::self.shard.world]

    def bar(self, stage: str, total: int, done: int, unit: str, mine: int | None = None,
            fraction: bool = False) -> Any:
        """A stage's bar (:func:`fcprag_tools.progress.progress_bar`): ``done`` of ``total`` units in one process;
        this rank's ``mine`` under a launcher. ``fraction``: it also moves inside a batch."""
        if self.shard.distributed and mine is not None:
            total, done = mine, 0
        return progress_bar(stage, total, unit=unit, initial=done, enabled=self.progress, position=self.shard.rank,
                            fraction=fraction)

    def kept(self, stage: str, total: int, done: int, unit: str) -> None:
        """On a resumed stage, one line: how many units it keeps and how many are left."""
        if done and self.shard.rank == 0:
            left = f"{total - done} to do" if total > done else "nothing to do"
            logger.info("%s: %d of %d %s kept, %s", stage, done, total, unit, left)

    def timed(self, stage: str, t0: float, **info: Any) -> None:
        """Count the seconds since ``t0`` to ``stage`` (and log them in ``OUT/timings.jsonl`` on rank 0)."""
        secs = time.perf_counter() - t0
        self.times[stage] = self.times.get(stage, 0.0) + secs
        if self.shard.rank == 0:
            log_timing(self.out, stage, secs, **info)

    def load_model(self) -> None:
        """The model of ``lm`` (frozen: the study trains adapters, not the model) once; a model without the Linear
        layers PRAG's LoRA recipe targets is a one-line error."""
        if self.model is not None:
            return
        from ..lm.model_io import load_model

        lm = self.lm
        self.model, self.tok = load_model(lm.model, gguf_file=lm.gguf_file, dtype=lm.dtype, device=lm.device,
                                          local_rank=self.shard.local_rank, progress=False)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if not ad.target_linears(self.model, ad.LORA["target_modules"]):
            raise FcpragError(f"--model {lm.model}: no Linear layer named "
                              f"{'/'.join(ad.LORA['target_modules'])}, the modules PRAG's LoRA recipe targets; choose "
                              "a model with a gated MLP (Llama, Qwen2, Mistral, ...)")

    def device(self) -> str:
        """Where the model runs (``--device`` while it is not loaded)."""
        return str(next(self.model.parameters()).device) if self.model is not None else self.lm.device

    def sizes(self) -> BatchSizes:
        """The device's batch sizes, for those the user did not give, from its free memory after the model is loaded
        (:func:`fcprag_tools.lm.sizing.default_batches`; asked for only by a stage that has work)."""
        if self.batches is None:
            from ..lm.model_io import resolve_device
            from ..lm.sizing import default_batches

            dev = resolve_device(self.lm.device, self.shard.local_rank)
            if dev.type == "cuda":
                self.load_model()
            self.batches = default_batches(dev, self.model if dev.type == "cuda" else None)
            logger.info("batch sizes: %s", self.batches.why)
        return self.batches

    def batch_size(self, given: int | None) -> int:
        """Sequences per scoring forward (labels and evaluation): ``given`` (``--batch-size``), else the device's."""
        return given or self.sizes().batch_size

    def adapter(self, pid: str) -> Any:
        """Passage ``pid``'s adapter (``OUT/adapters/<pid>/``), kept on the model's device once it is loaded."""
        from fcprag_plugin.adapter import LoraAdapter

        if self.model is None:  # read before any scoring (a controller's recipe check): on the CPU, not kept
            return LoraAdapter.from_pretrained(self.out / "adapters" / pid)
        if pid not in self.adapters:
            self.adapters[pid] = LoraAdapter.from_pretrained(self.out / "adapters" / pid,
                                                             device=next(self.model.parameters()).device)
        return self.adapters[pid]
