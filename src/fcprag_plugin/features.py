"""Query-passage pair features ``x_i = [e_q; e_p_i; e_q*e_p_i; |e_q-e_p_i|]``, set statistics and side features
(the ``masked_*`` reductions take ``mask=None`` for "every entry is real")."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def pair_features(e_q: torch.Tensor, E_p: torch.Tensor) -> torch.Tensor:
    """``e_q [B, d]``, ``E_p [B, N, d]`` -> ``x [B, N, 4d]``: ``e_q`` beside each :func:`passage_features` row."""
    xp = passage_features(e_q, E_p)
    return torch.cat([e_q.unsqueeze(1).expand_as(E_p), xp], dim=-1)


def passage_features(e_q: torch.Tensor, E_p: torch.Tensor) -> torch.Tensor:
    """The per-passage blocks of :func:`pair_features`: ``[e_p; e_q*e_p; |e_q-e_p|]`` as ``[B, N, 3d]``."""
    if e_q.ndim != 2 or E_p.ndim != 3 or e_q.shape[0] != E_p.shape[0] or e_q.shape[1] != E_p.shape[2]:
        raise ValueError(f"features expect e_q [B, d] and E_p [B, N, d], got {list(e_q.shape)} and {list(E_p.shape)}")
    q = e_q.unsqueeze(1)
    return torch.cat([E_p, q * E_p, (q - E_p).abs()], dim=-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """Mean over ``dim`` of ``x [B, N, ...]`` counting only ``mask [B, N]`` entries (None: all)."""
    if mask is None:
        return x.mean(dim)
    m = mask.to(x.dtype)
    while m.ndim < x.ndim:
        m = m.unsqueeze(-1)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def masked_std(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """Population standard deviation over ``dim`` of the ``mask`` entries (None: all)."""
    mu = masked_mean(x, mask, dim)
    var = masked_mean((x - mu.unsqueeze(dim)) ** 2, mask, dim)
    # sqrt'(0) is infinite: at var == 0 (N = 1, ties) the gradient is 0 instead of NaN; the values are sqrt(var)
    return torch.where(var > 0, var.clamp_min(torch.finfo(var.dtype).tiny).sqrt(), torch.zeros_like(var))


def masked_max(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    return x.amax(dim) if mask is None else x.masked_fill(~mask, float("-inf")).amax(dim)


def masked_min(x: torch.Tensor, mask: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    return x.amin(dim) if mask is None else x.masked_fill(~mask, float("inf")).amin(dim)


def calibration_summary(e_q: torch.Tensor, xp: torch.Tensor, s: torch.Tensor, mask: torch.Tensor | None
                        ) -> torch.Tensor:
    """The calibration net's input, masked and permutation-invariant: ``[e_q; mean_i xp_i]`` (``4d``), score
    statistics ``[mean, std, max, min, max-min]``, query-passage dot-product statistics ``[mean, std, max, min]``
    and ``log N``. ``e_q [B, d]``, ``xp [B, N, 3d]`` (:func:`passage_features`), ``s [B, N]`` -> ``[B, 4d + 10]``."""
    d = e_q.shape[1]
    cos = xp[..., d:2 * d].sum(-1)  # e_q . e_p from the e_q*e_p block of the features (no second product)
    sc = torch.stack([s, cos], dim=1)  # [B, 2, N]: both statistics in one pass
    m2 = None if mask is None else mask.unsqueeze(1)
    mean, std = masked_mean(sc, m2, 2), masked_std(sc, m2, 2)
    mx, mn = masked_max(sc, m2, 2), masked_min(sc, m2, 2)
    n = torch.full_like(s[:, :1], float(s.shape[1])) if mask is None else mask.sum(1, keepdim=True).to(s.dtype)
    st = torch.stack([mean, std, mx, mn], dim=2).flatten(1)  # [s mean, std, max, min, cos mean, std, max, min]
    stats = torch.cat([st[:, :4], mx[:, :1] - mn[:, :1], st[:, 4:], n.log()], dim=1)
    return torch.cat([e_q, masked_mean(xp, mask), stats], dim=1)


CALIB_STATS = 10  # columns of calibration_summary after the 4d mean pair feature


SIDE_FEATURES = ("retrieval_rank", "retrieval_score", "adapter_stats")  # opt-in: config.side_features
ADAPTER_GROUPS = ("gate_proj", "up_proj", "down_proj")  # adapter_stats' norm groups (module name's last part)
ADAPTER_STAT_NAMES = (*(f"log_norm_{g}" for g in ADAPTER_GROUPS), "log_norm_all", "rank", "scaling")
_NORM_FLOOR = 1e-8  # log of a missing group / an all-zero adapter stays finite


def side_feature_columns(names: Sequence[str]) -> list[str]:
    """The per-passage columns the side features ``names`` expand to (``adapter_stats`` is several)."""
    return [c for n in names for c in ([f"adapter_stats.{a}" for a in ADAPTER_STAT_NAMES]
                                       if n == "adapter_stats" else [n])]


def adapter_stats(adapter: Any) -> dict[str, float]:
    """:data:`ADAPTER_STAT_NAMES` of one ``LoraAdapter`` without forming dW: ``log(sum of ||s B A||_F + 1e-8)`` over
    each of :data:`ADAPTER_GROUPS` and over all modules, then the mean ``rank`` and ``scaling``."""
    mods = getattr(adapter, "modules", None)
    if not isinstance(mods, dict) or not mods:
        raise ValueError(f"adapter_stats expects a LoraAdapter with at least one module, got {type(adapter).__name__}")
    norm = {name: abs(v["delta"]) for name, v in adapter.norms().items()}  # per module ||s B A||_F
    group_norm = {g: sum(v for name, v in norm.items() if name.rsplit(".", 1)[-1] == g) for g in ADAPTER_GROUPS}
    return {**{f"log_norm_{g}": math.log(v + _NORM_FLOOR) for g, v in group_norm.items()},
            "log_norm_all": math.log(sum(norm.values()) + _NORM_FLOOR),
            "rank": sum(int(m.A.shape[0]) for m in mods.values()) / len(mods),
            "scaling": sum(float(m.scaling) for m in mods.values()) / len(mods)}


def adapter_recipe(adapter: Any) -> dict[str, Any]:
    """What a controller's scale and adapter statistics depend on besides the passage, without tensor math: sorted
    ``rank`` s, ``scaling`` s, ``targets`` (module name's last part) and ``shapes`` (``"out x in"``), the number of
    ``modules`` and the config's ``base_model`` (or None; shown, never compared: one model has several names)."""
    mods = adapter.modules.values()
    return {"rank": sorted({m.rank for m in mods}), "scaling": sorted({round(float(m.scaling), 6) for m in mods}),
            "targets": sorted({n.rsplit(".", 1)[-1] for n in adapter.modules}), "modules": len(adapter.modules),
            "shapes": sorted({f"{m.out_features}x{m.in_features}" for m in mods}),
            "base_model": (getattr(adapter, "config", None) or {}).get("base_model_name_or_path")}


def center_side(side: torch.Tensor, mask: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(f_i - mean over the set's real passages) / scale``, exactly 0 for a feature equal across the set: ``side
    [B, N, k]``, ``mask [B, N]`` (None: all real), ``scale [k]`` (None: 1) -> ``[B, N, k]``, 0 on padding."""
    centered = side - masked_mean(side, mask, 1).unsqueeze(1)
    # the mean of equal values can round away from them: a set whose feature does not vary is exactly 0
    m3 = None if mask is None else mask.unsqueeze(-1)
    constant = (masked_max(side, m3, 1) == masked_min(side, m3, 1)).unsqueeze(1)  # [B, 1, k]
    centered = centered.masked_fill(constant, 0.0)
    if mask is not None:
        centered = centered.masked_fill(~m3, 0.0)
    return centered if scale is None else centered / scale
