"""Synthetic label sets with a known answer, for tests, benchmarks and sanity checks of a training setup. Texts are
opaque ids (``q17``, ``p17_2``); :func:`table_encoder` maps them to the generated vectors; :func:`write_labels`
writes any records as a label file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from fcprag_plugin.training import OPTIONAL, LabelRecord


def synthetic_records(n: int, n_passages: int | tuple[int, int] = 3, dim: int = 16, *, kind: str = "planted",
                      gap: float = 0.5, noise: float = 0.05, closeness: float = 0.5, seed: int = 0,
                      prefix: str = "", groups: int | None = None, scales: Sequence[float] | None = None,
                      best_scale: float = 2.0, scale_noise: float = 0.05
                      ) -> tuple[list[LabelRecord], dict[str, torch.Tensor]]:
    """``n`` records and the ``text -> [dim]`` embedding table.

    Args:
        n_passages: N per record, or ``(lo, hi)`` for a variable N drawn uniformly in [lo, hi].
        kind: ``"planted"``: one passage per record is much closer to the query than the others and gets the
            largest delta (``gap``), plus noise: a controller that learns anything should weight it most.
            ``"noise"``: the deltas are pure noise; the best a controller can do is stay close to uniform.
            ``"scale"``: every passage helps about equally (``gap`` each, plus noise): only the total scale
            carries signal, no passage should be weighted over another.
        gap: delta advantage of the closest passage (planted).
        noise: std of the Gaussian noise on every delta (for ``"noise"``: the deltas' std).
        closeness: std of the perturbation of the planted passage around the query (smaller = closer).
        prefix: prepended to ids and texts (to build disjoint sets).
        groups: when set, records get ``group = i % groups``.
        scales: when set, every record also gets measured scales: ``metric_at_scales`` at each of ``scales`` with
            ``metric_all = 0``, a concave gain ``g(s) = gap_s ((s - 1) - (s - 1)^2 / (2 (best_scale - 1)))`` that
            peaks at ``best_scale`` (``gap_s = gap`` for ``"scale"``, 0 otherwise) plus N(0, ``scale_noise``).
    """
    if kind not in ("planted", "noise", "scale"):
        raise ValueError(f"kind is {kind!r}, expected 'planted', 'noise' or 'scale'")
    g = torch.Generator().manual_seed(seed)
    lo, hi = (n_passages, n_passages) if isinstance(n_passages, int) else n_passages
    table: dict[str, torch.Tensor] = {}
    records = []
    for r in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        q = torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0)
        P = torch.nn.functional.normalize(torch.randn(k, dim, generator=g), dim=1)
        gold = int(torch.randint(0, k, (1,), generator=g))
        P[gold] = torch.nn.functional.normalize(q + closeness * torch.randn(dim, generator=g), dim=0)
        cos = P @ q
        if kind == "planted":
            deltas = gap * torch.nn.functional.one_hot(cos.argmax(), k).float() + noise * torch.randn(k, generator=g)
        elif kind == "scale":
            deltas = gap + noise * torch.randn(k, generator=g)
        else:
            deltas = noise * torch.randn(k, generator=g)
        measured = {}
        if scales is not None:
            a = gap if kind == "scale" else 0.0
            at = [a * ((s - 1) - (s - 1) ** 2 / (2 * (best_scale - 1)))
                  + scale_noise * float(torch.randn(1, generator=g)) for s in scales]
            measured = dict(metric_all=0.0, metric_without=[-float(d) for d in deltas], scales=list(scales),
                            metric_at_scales=at)
        qt = f"{prefix}q{r}"
        pts = [f"{prefix}p{r}_{i}" for i in range(k)]
        table[qt] = q
        table.update(zip(pts, P))
        records.append(LabelRecord(id=f"{prefix}{r}", query=qt, passages=pts, deltas=[float(x) for x in deltas],
                                   group=None if groups is None else str(r % groups), **measured))
    return records, table


def table_encoder(table: dict[str, torch.Tensor], name: str = "synthetic", calls: list | None = None):
    """A :class:`TextEncoder` that looks texts up in ``table``; appends each call's texts to ``calls``."""
    from fcprag_plugin.encoding import TextEncoder

    dim = int(next(iter(table.values())).shape[0])

    def fn(texts: Sequence[str]) -> torch.Tensor:
        if calls is not None:
            calls.append(list(texts))
        return torch.stack([table[t] for t in texts])

    return TextEncoder.from_function(fn, dim, name=name)


def record_to_json(rec: LabelRecord) -> dict[str, Any]:
    """The record as a label file holds it (the inverse of ``fcprag_plugin.labels.validate_record``)."""
    out: dict[str, Any] = {"id": rec.id, "query": rec.query, "passages": list(rec.passages)}
    if rec.metric_all is not None:
        out["metric_all"] = rec.metric_all
        out["metric_without"] = list(rec.metric_without or [])
    else:
        out["deltas"] = list(rec.deltas)
    for k in OPTIONAL[3:]:  # after deltas / metric_all / metric_without
        v = getattr(rec, k)
        if v is not None:
            out[k] = v
    out.update(rec.extra)
    return out


def write_labels(records: Sequence[LabelRecord | dict], path: str | Path) -> Path:
    """Write records as JSON Lines (dicts are written as given)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(record_to_json(r) if isinstance(r, LabelRecord) else r, ensure_ascii=False) + "\n")
    return path
