"""The controller's networks, plain torch modules: :class:`ScoreNet` (a score per passage), :class:`CalibNet` (the
gate, the temperature and optionally a per-query scale of the set) and :func:`combine`, which turns them into the
weights ``w`` and ``w~`` (the math: :mod:`fcprag_plugin.controller`'s docstring, ``docs/method.md``)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def _layers(sizes: Sequence[int], dropout: float) -> list[nn.Module]:
    """Linear -> ReLU -> Dropout -> ... -> Linear (the indices 0, 3, 6, ... are the Linears: saved files' keys)."""
    layers: list[nn.Module] = [nn.Linear(sizes[0], sizes[1])]
    for d_in, d_out in zip(sizes[1:], sizes[2:]):
        layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_in, d_out)]
    return layers


def combine(scores: torch.Tensor, g: torch.Tensor, tau: torch.Tensor, mask: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pi = softmax(s/tau)``, ``w = g*pi + (1-g)/N``, ``w~ = N*w/sum w``, masked (``mask`` None: all real) ->
    (w, w~), each ``[B, N]``; ``w~`` is computed as ``1 + g*N*(pi - 1/N)`` (``sum w = 1``), so that equal scores give
    exactly ``w~ = 1``."""
    g1, logits = g.unsqueeze(1), scores / tau.unsqueeze(1)
    n = scores.shape[1] if mask is None else mask.sum(1, keepdim=True).to(scores.dtype)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))  # softmax gives padding exactly 0
    pi = torch.softmax(logits, dim=1)
    w, w_tilde = g1 * pi + (1 - g1) / n, 1 + g1 * n * (pi - 1.0 / n)
    if mask is not None:
        w, w_tilde = w.masked_fill(~mask, 0.0), w_tilde.masked_fill(~mask, 0.0)
    return w, w_tilde


def split_first_linear(weight: torch.Tensor, bias: torch.Tensor | None, e_q: torch.Tensor, xp: torch.Tensor
                       ) -> torch.Tensor:
    """``Linear(W, b)([e_q; xp_i])`` as ``W[:, :d] e_q + b`` (once per query) ``+ W[:, d:] xp_i``: ``weight [H, d +
    p]``, ``bias [H]``, ``e_q [B, d]``, ``xp [B, N, p]`` -> ``[B, N, H]``."""
    d = e_q.shape[-1]
    w_q, w_p = weight.split([d, weight.shape[1] - d], dim=1)
    return nn.functional.linear(xp, w_p) + nn.functional.linear(e_q, w_q, bias).unsqueeze(1)


class ScoreNet(nn.Sequential):
    """Per-passage score logits, an MLP ``d + p -> hidden... -> 1`` on ``x_i = [e_q; xp_i]`` (first layer:
    :func:`split_first_linear`): ``forward(e_q [B, d], xp [B, N, p]) -> [B, N]`` float32, in the weights' dtype."""

    def __init__(self, d_query: int, d_passage: int, hidden: Sequence[int], dropout: float) -> None:
        super().__init__(*_layers([d_query + d_passage, *hidden, 1], dropout))

    def forward(self, e_q: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        first = self[0]
        dt = first.weight.dtype
        h = split_first_linear(first.weight, first.bias, e_q.to(dt), xp.to(dt))
        for layer in list(self)[1:]:  # (slicing a Sequential subclass would rebuild it)
            h = layer(h)
        return h.squeeze(-1).to(torch.promote_types(h.dtype, torch.float32))


class CalibNet(nn.Sequential):
    """Gate, temperature (and per-query scale), an MLP ``summary -> hidden -> 2 (3)``: ``forward(summary [B, in])
    -> (g [B] in (0, 1), tau [B] in (tau_min, tau_max), c [B] in (0, 2) or None)``, float32."""

    def __init__(self, d_in: int, hidden: int, dropout: float, tau_min: float, tau_max: float,
                 calib_scale: bool = False) -> None:
        super().__init__(*_layers([d_in, hidden, 3 if calib_scale else 2], dropout))
        self.tau_min, self.tau_max = tau_min, tau_max

    def forward(self, summary: torch.Tensor  # type: ignore[override]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out = super().forward(summary.to(self[0].weight.dtype))
        out = out.to(torch.promote_types(out.dtype, torch.float32))
        g = torch.sigmoid(out[:, 0])
        tau = self.tau_min + (self.tau_max - self.tau_min) * torch.sigmoid(out[:, 1])
        c = 2 * torch.sigmoid(out[:, 2]) if out.shape[1] > 2 else None
        return g, tau, c
