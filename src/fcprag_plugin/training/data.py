"""Label records -> tensors: a table of unique text embeddings (embedded once, through the on-disk cache) plus
index tensors; a padded batch with a mask is a gather from the table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..errors import BARE, LabelFileError, kw
from ..features import ADAPTER_STAT_NAMES, side_feature_columns
from .embed_cache import EmbeddingCache, embed_texts
from ..labels import LabelRecord
from .targets import DEFAULT_FLAT_EPS, DEFAULT_FLAT_WEIGHT, DEFAULT_T_LABEL, make_targets


@dataclass
class Batch:
    """A padded batch. ``e_q [B, d]``, ``E_p [B, N, d]``, ``mask [B, N]``, ``deltas``/``y [B, N]``, ``omega [B]``,
    ``index [B]`` (rows of the dataset), ``side [B, N, k]`` or None."""

    e_q: torch.Tensor
    E_p: torch.Tensor
    mask: torch.Tensor
    deltas: torch.Tensor
    y: torch.Tensor
    omega: torch.Tensor
    index: torch.Tensor
    side: torch.Tensor | None = None


@dataclass
class LabelTensors:
    """A whole label set as tensors (R records, at most ``N`` passages, U unique texts): ``table [U, d]``
    embeddings; rows of each query ``q_idx [R]`` and passage ``p_idx [R, N]`` (0 on padding); ``mask [R, N]``;
    ``deltas``/``y [R, N]`` (0 on padding); ``omega``/``flat [R]``; ``ids``/``groups`` per record; raw ``side
    [R, N, k]`` (columns ``side_columns``) or None; ``scales [S]`` and ``scale_gains`` / ``f1_scale_gains [R, S]``
    float64 (gain of PRAG's sum times ``scales[j]`` over the sum, label metric / F1; NaN: not measured) or None."""

    table: torch.Tensor
    q_idx: torch.Tensor
    p_idx: torch.Tensor
    mask: torch.Tensor
    deltas: torch.Tensor
    y: torch.Tensor
    omega: torch.Tensor
    flat: torch.Tensor
    ids: list[str]
    groups: list[str]
    side: torch.Tensor | None = None
    side_columns: list[str] = field(default_factory=list)
    scales: torch.Tensor | None = None
    scale_gains: torch.Tensor | None = None
    f1_scale_gains: torch.Tensor | None = None

    def gains(self, metric: str) -> torch.Tensor | None:
        """The measured scale gains in ``metric``: ``"label"`` (the label metric) or ``"f1"``."""
        return self.f1_scale_gains if metric == "f1" else self.scale_gains

    def __len__(self) -> int:
        return int(self.q_idx.shape[0])

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])

    def batch(self, index: torch.Tensor) -> Batch:
        """Gather rows ``index`` and trim padding to the longest record in the batch."""
        mask = self.mask[index]
        n = int(mask.sum(1).max())
        mask = mask[:, :n]
        return Batch(self.table[self.q_idx[index]], self.table[self.p_idx[index, :n]], mask,
                     self.deltas[index, :n], self.y[index, :n], self.omega[index], index,
                     None if self.side is None else self.side[index, :n])

    def batches(self, batch_size: int, shuffle: bool = False, generator: torch.Generator | None = None
                ) -> Iterator[Batch]:
        order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
        for i in range(0, len(self), batch_size):
            yield self.batch(order[i:i + batch_size])

    def subset(self, rows: Sequence[int] | torch.Tensor) -> "LabelTensors":
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        rl = rows_t.tolist()
        return LabelTensors(self.table, self.q_idx[rows_t], self.p_idx[rows_t], self.mask[rows_t],
                            self.deltas[rows_t], self.y[rows_t], self.omega[rows_t], self.flat[rows_t],
                            [self.ids[i] for i in rl], [self.groups[i] for i in rl],
                            None if self.side is None else self.side[rows_t], self.side_columns, self.scales,
                            None if self.scale_gains is None else self.scale_gains[rows_t],
                            None if self.f1_scale_gains is None else self.f1_scale_gains[rows_t])


def build_tensors(records: Sequence[LabelRecord], encoder: Any, cache: EmbeddingCache | None = None, *,
                  t_label: float = DEFAULT_T_LABEL, flat_eps: float = DEFAULT_FLAT_EPS,
                  flat_weight: float = DEFAULT_FLAT_WEIGHT, progress: bool = False,
                  side_features: Sequence[str] = ()) -> LabelTensors:
    """Embed every distinct text of ``records`` (via ``cache``) and build :class:`LabelTensors`; ``side_features``
    (``features.SIDE_FEATURES``) come from the records' fields, a record without one is a :class:`LabelFileError`."""
    if not records:
        raise ValueError("build_tensors: no records")
    texts = {t: i for i, t in enumerate(dict.fromkeys(t for r in records for t in (r.query, *r.passages)))}
    table = embed_texts(list(texts), encoder, cache, progress=progress)
    R, N = len(records), max(r.n for r in records)
    q_idx = torch.tensor([texts[r.query] for r in records], dtype=torch.long)
    lens = torch.tensor([r.n for r in records], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(R), lens)  # one flat scatter instead of a loop per record
    cols = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    p_idx = torch.zeros(R, N, dtype=torch.long)
    mask = torch.zeros(R, N, dtype=torch.bool)
    deltas = torch.zeros(R, N, dtype=torch.float32)
    p_idx[rows, cols] = torch.tensor([texts[p] for r in records for p in r.passages], dtype=torch.long)
    mask[rows, cols] = True
    deltas[rows, cols] = torch.tensor([d for r in records for d in r.deltas], dtype=torch.float32)
    y, omega, flat = make_targets(deltas, mask, t_label, flat_eps, flat_weight)
    side = None
    if side_features:
        side = torch.zeros(R, N, len(side_feature_columns(side_features)), dtype=torch.float32)
        side[rows, cols] = torch.tensor([row for r in records for row in side_rows(r, side_features)],
                                        dtype=torch.float32)
    scales, scale_gains = scale_tensors(records)
    f1_gains = scale_tensors(records, "f1_scale_gains")[1] if scales is not None else None
    return LabelTensors(table.float().contiguous(), q_idx, p_idx, mask, deltas, y, omega, flat,
                        [r.id for r in records], [r.group_key for r in records], side,
                        side_feature_columns(side_features), scales, scale_gains, f1_gains)


def scale_tensors(records: Sequence[LabelRecord], attr: str = "scale_gains"
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(scales [S], gains [R, S])`` of the records' ``attr`` (``scale_gains`` / ``f1_scale_gains``; NaN rows where
    a record has none; one grid of scales per file), or ``(None, None)`` when no record has scales."""
    measured = [r for r in records if r.scales is not None]
    if not measured:
        return None, None
    grid = sorted(measured[0].scales)
    gains = torch.full((len(records), len(grid)), float("nan"), dtype=torch.float64)
    if not any(getattr(r, attr) is not None for r in measured):
        return torch.tensor(grid, dtype=torch.float64), None
    for i, r in enumerate(records):
        g = getattr(r, attr)
        if r.scales is not None and sorted(r.scales) != grid:
            raise LabelFileError(f"{r.where}: field 'scales' is {sorted(r.scales)} but {measured[0].where} has "
                                 f"{grid}; expected one grid of scales in a label file")
        if g is not None:
            gains[i] = torch.tensor([g[s] for s in grid], dtype=torch.float64)
    return torch.tensor(grid, dtype=torch.float64), gains


_SIDE_FIELDS = {"retrieval_rank": "retrieval_ranks", "retrieval_score": "retrieval_scores",
                "adapter_stats": "adapter_stats"}


def side_rows(record: LabelRecord, side_features: Sequence[str]) -> list[list[float]]:
    """The raw side-feature values of ``record``, one row per passage (columns ``side_feature_columns``)."""
    cols: list[list[list[float]]] = []
    for name in side_features:
        v = getattr(record, _SIDE_FIELDS[name])
        if v is None:
            raise LabelFileError(f"{record.where}: field '{_SIDE_FIELDS[name]}' is missing; the side feature "
                                 f"'{name}' was requested ({kw('side_features')}), so every record needs it "
                                 "(fcprag labels build writes it; docs/label-format.md)",
                                 params=[("side_features", BARE)])
        cols.append([[float(s[k]) for k in ADAPTER_STAT_NAMES] for s in v] if name == "adapter_stats"
                    else [[float(x)] for x in v])
    return [[x for c in cols for x in c[i]] for i in range(record.n)]
