"""``FusionController``: per-query, calibrated merge weights for N passage adapters.

    x_i = [e_q; e_p_i; e_q*e_p_i; |e_q-e_p_i|]                 (features.pair_features)
    s_i = sigmoid(score_net(x_i))                              score net: 4d -> 2048 -> 1024 -> 1
    g, tau from calib_net(summary of the set)                  calib net: summary -> 256 -> 2
    pi = softmax(s / tau),  w_i = g*pi_i + (1-g)/N,  w~_i = N*w_i / (sum w + eps)

``w~ = [1]*N`` is PRAG's merge (a plain sum of the passage updates).

The calibration summary (our design) is a masked, permutation-invariant description of the set:
the mean pair feature ``[4d]``, score statistics ``[mean, std, max, min, max-min]``, query-passage cosine
statistics ``[mean, std, max, min]`` and ``log N``. It lets the net open the gate (g -> 1) and sharpen
(tau -> tau_min) when one passage clearly stands out, and fall back to uniform when nothing does.

Evaluation. ``x_i`` is never built: the score net's first weight ``W [H, 4d]`` is applied as
``W[:, :d] e_q + b`` once per query plus ``W[:, d:] [e_p_i; e_q*e_p_i; |e_q-e_p_i|]`` per passage (the same
function, ~1/6 fewer FLOPs in that layer for N = 3; parameters and saved files are unchanged). The MLPs run
through an :class:`MLPRunner`: plain float32 autograd ops by default, bfloat16 kernels with a custom backward
while training (``training.precision``), and cached bfloat16 / int8 weights in
:meth:`FusionController.for_inference`.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .errors import ControllerError
from .features import masked_max, masked_mean, masked_min, masked_std, passage_features

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CONTROLLER_MODES = ("learned", "uniform", "random", "fixed")
SCORERS = ("mlp", "cosine")
FORMAT_VERSION = 1


@dataclass
class ControllerConfig:
    """Everything needed to rebuild a controller; saved as ``config.json``."""

    embed_dim: int = 768
    embedding_model: str | None = None
    score_hidden: list[int] = field(default_factory=lambda: [2048, 1024])
    calib_hidden: int = 256
    dropout: float = 0.1
    tau_min: float = 0.05
    tau_max: float = 2.0
    eps: float = 1e-8
    mode: str = "learned"  # learned | uniform | random | fixed
    scorer: str = "mlp"  # mlp | cosine (parameter-free (1+cos)/2, for fixed baselines)
    fixed_g: float = 0.5
    fixed_tau: float = 0.1
    seed: int | None = None
    format_version: int = FORMAT_VERSION

    def validate(self, where: str = "controller config") -> "ControllerConfig":
        if self.mode not in CONTROLLER_MODES:
            raise ControllerError(f"{where}: key 'mode' is '{self.mode}', expected one of {list(CONTROLLER_MODES)}")
        if self.scorer not in SCORERS:
            raise ControllerError(f"{where}: key 'scorer' is '{self.scorer}', expected one of {list(SCORERS)}")
        if not (isinstance(self.embed_dim, int) and self.embed_dim > 0):
            raise ControllerError(f"{where}: key 'embed_dim' must be a positive integer, got {self.embed_dim!r}")
        if not (0 < self.tau_min <= self.tau_max):
            raise ControllerError(f"{where}: keys 'tau_min'/'tau_max' must satisfy 0 < tau_min <= tau_max, "
                                  f"got {self.tau_min}, {self.tau_max}")
        if not (0.0 <= self.fixed_g <= 1.0) or self.fixed_tau <= 0:
            raise ControllerError(f"{where}: keys 'fixed_g' in [0, 1] and 'fixed_tau' > 0 expected, "
                                  f"got {self.fixed_g}, {self.fixed_tau}")
        return self


@dataclass
class ControllerOutput:
    """Controller outputs for a batch; padded entries (``mask`` False) have zero weight.

    Attributes:
        scores: ``s [B, N]`` in (0, 1)
        g: gate ``[B]`` in [0, 1]
        tau: temperature ``[B]`` in [tau_min, tau_max]
        weights: ``w [B, N]``, a distribution over the real passages (sums to 1)
        merge_weights: ``w~ [B, N]`` = ``N*w/(sum w + eps)``; all ones is PRAG's uniform merge
        mask: ``[B, N]`` bool
    """

    scores: torch.Tensor
    g: torch.Tensor
    tau: torch.Tensor
    weights: torch.Tensor
    merge_weights: torch.Tensor
    mask: torch.Tensor

    def sample(self, b: int = 0) -> dict[str, Any]:
        """Plain-Python view of sample ``b`` (only its real passages)."""
        m = self.mask[b]
        return {
            "scores": self.scores[b][m].tolist(),
            "g": float(self.g[b]),
            "tau": float(self.tau[b]),
            "weights": self.weights[b][m].tolist(),
            "merge_weights": self.merge_weights[b][m].tolist(),
        }


def _mlp(sizes: Sequence[int], dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers += [nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers)


CALIB_STATS = 10  # 5 score stats + 4 cosine stats + log N


def combine(scores: torch.Tensor, g: torch.Tensor, tau: torch.Tensor, mask: torch.Tensor | None, eps: float = 1e-8
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pi = softmax(s/tau)``, ``w = g*pi + (1-g)/N``, ``w~ = N*w/(sum w + eps)``; all masked (``mask`` None:
    every passage is real). Returns (w, w~), each ``[B, N]``."""
    if mask is None:
        n: torch.Tensor | int = scores.shape[1]
        pi = torch.softmax(scores / tau.unsqueeze(1), dim=1)
        w = g.unsqueeze(1) * pi + (1 - g.unsqueeze(1)) / n
        return w, n * w / (w.sum(1, keepdim=True) + eps)
    n = mask.sum(1, keepdim=True).to(scores.dtype)
    logits = (scores / tau.unsqueeze(1)).masked_fill(~mask, float("-inf"))
    pi = torch.softmax(logits, dim=1).masked_fill(~mask, 0.0)
    w = (g.unsqueeze(1) * pi + (1 - g.unsqueeze(1)) / n).masked_fill(~mask, 0.0)
    w_tilde = n * w / (w.sum(1, keepdim=True) + eps)
    return w, w_tilde


def split_first_linear(weight: torch.Tensor, bias: torch.Tensor | None, e_q: torch.Tensor, xp: torch.Tensor
                       ) -> torch.Tensor:
    """A linear layer on pair features without building them: ``Linear(W, b)(x_i)`` for
    ``x_i = [e_q; xp_i]`` as ``W[:, :d] e_q + b`` (once per query) ``+ W[:, d:] xp_i``.

    ``weight [H, 4d]``, ``bias [H]``, ``e_q [B, d]``, ``xp [B, N, 3d]`` (:func:`features.passage_features`)
    -> ``[B, N, H]``. Equal to ``F.linear(pair_features(e_q, E_p), weight, bias)`` up to float rounding.
    """
    d = e_q.shape[-1]
    w_q, w_p = weight.split([d, weight.shape[1] - d], dim=1)
    return torch.nn.functional.linear(xp, w_p) + torch.nn.functional.linear(e_q, w_q, bias).unsqueeze(1)


class MLPRunner:
    """How the controller evaluates its two MLPs. This default runs float32 autograd ops on the parameters;
    faster runners (bfloat16 training kernels in ``training.precision``, the cached low-precision weights of
    :meth:`FusionController.for_inference`) override these methods and compute the same function.

    A runner receives float32 features and returns float32 outputs; what happens in between is its business.
    """

    #: autograd through this runner reaches the parameters (False: an inference snapshot)
    trainable = True

    def first(self, layer: nn.Linear, e_q: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
        """The score net's first layer on ``[e_q; xp_i]``: ``e_q [B, d]``, ``xp [B, N, 3d]`` -> ``[B, N, H]``."""
        return split_first_linear(layer.weight, layer.bias, e_q, xp)

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)

    def relu_dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """``dropout(relu(x))`` with drop probability ``p`` (0 when not training)."""
        x = torch.relu(x)
        return torch.nn.functional.dropout(x, p, True) if p > 0 else x

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """The last layer's output as float32."""
        return y.float()


_DEFAULT_RUNNER = MLPRunner()
INFERENCE_DTYPES = (torch.bfloat16, torch.int8, torch.float32)
# torch._weight_int8pack_mm (torch 2.13, CPU) crashes when the inner dimension is not a multiple of 16 (measured:
# K = 1538, 1540, 1544, 1546, 3082 segfault; multiples of 16 and 64 are fine): int8 weights and their inputs are
# zero-padded to a multiple of 64.
_INT8_K_ALIGN = 64


def int8_matmul_available() -> bool:
    """Whether this torch has the CPU weight-only int8 matmul (``torch._weight_int8pack_mm``) and it runs."""
    fn = getattr(torch, "_weight_int8pack_mm", None)
    if fn is None:
        return False
    try:
        fn(torch.ones(3, _INT8_K_ALIGN, dtype=torch.bfloat16), torch.ones(3, _INT8_K_ALIGN, dtype=torch.int8),
           torch.ones(3, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _version(t: torch.Tensor) -> int:
    """The in-place version counter (-1 for inference tensors, which have none)."""
    return -1 if t.is_inference() else t._version


class InferenceRunner(MLPRunner):
    """Inference with the Linear weights converted once: ``torch.bfloat16`` / ``torch.float32`` casts, or
    ``torch.int8`` weight-only quantization (symmetric, one scale per output row, ``w ~ q * max|w_row| / 127``)
    multiplied by bfloat16 activations. Inputs are cast per call; outputs come back as float32.

    The converted weights are cached per layer and redone when a parameter is replaced, moved or changed in place
    through autograd-visible ops (``load_state_dict``, ``copy_``: its version counter; tensors created under
    ``torch.inference_mode`` have no version counter, so there only replacement and moves are seen). The copy this runner
    belongs to has frozen parameters (``requires_grad=False``), and nothing here reaches them (``trainable``).
    """

    trainable = False

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.act = torch.bfloat16 if dtype == torch.int8 else dtype  # activations' dtype
        self._cache: dict[int, tuple[tuple, tuple[torch.Tensor, ...]]] = {}

    def _convert(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.dtype != torch.int8:
            return (w.to(self.dtype).contiguous(),)
        scale = w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
        pad = -w.shape[1] % _INT8_K_ALIGN
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))  # zero columns: the same products
        return q.contiguous(), scale.to(self.act)

    def _weights(self, layer: nn.Linear, split: int | None = None) -> tuple[tuple[torch.Tensor, ...], ...]:
        w, b = layer.weight, layer.bias
        key = (_version(w), _version(b), w.data_ptr(), b.data_ptr(), w.device, split)
        hit = self._cache.get(id(layer))
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            w = w.detach().float()
            parts = (w,) if split is None else (w[:, :split], w[:, split:])  # query / passage blocks
            val = (*(self._convert(p) for p in parts), (b.detach().to(self.act),))
        self._cache[id(layer)] = (key, val)
        return val

    def _mm(self, x: torch.Tensor, wt: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.dtype == torch.int8:
            pad = wt[0].shape[1] - x.shape[1]
            if pad:
                x = torch.nn.functional.pad(x, (0, pad))
            return torch._weight_int8pack_mm(x.contiguous(), wt[0], wt[1])
        return torch.mm(x, wt[0].t())

    def first(self, layer: nn.Linear, e_q: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
        w_q, w_p, (b,) = self._weights(layer, e_q.shape[-1])
        B, N, _ = xp.shape
        h_q = (self._mm(e_q.to(self.act), w_q) + b).repeat_interleave(N, 0)  # [B*N, H]
        if self.dtype == torch.int8:
            return (self._mm(xp.to(self.act).reshape(B * N, -1), w_p) + h_q).view(B, N, -1)
        return torch.addmm(h_q, xp.to(self.act).reshape(B * N, -1), w_p[0].t()).view(B, N, -1)

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w, (b,) = self._weights(layer)
        y = self._mm(x.to(self.act).reshape(-1, x.shape[-1]), w) + b
        return y.view(*x.shape[:-1], y.shape[-1])

    def relu_dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if p > 0:
            raise ControllerError("an inference controller (for_inference) cannot be trained; train the original")
        return torch.relu(x)


class FusionController(nn.Module):
    """Maps ``(e_q [B, d], E_p [B, N, d], mask [B, N])`` to calibrated merge weights (:class:`ControllerOutput`).

    Baselines are modes of the same class: ``uniform`` (g = 0, exactly PRAG), ``random`` (untrained, seeded),
    ``fixed`` (one global g and tau, e.g. from a grid search).
    """

    def __init__(self, config: ControllerConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        config = config or ControllerConfig(**kwargs)
        self.config = config.validate()
        if config.seed is not None:
            gen_state = torch.random.get_rng_state()
            torch.manual_seed(config.seed)
        d = config.embed_dim
        self.score_net = _mlp([4 * d, *config.score_hidden, 1], config.dropout)
        self.calib_net = _mlp([4 * d + CALIB_STATS, config.calib_hidden, 2], config.dropout)
        if config.seed is not None:
            torch.random.set_rng_state(gen_state)

    # ------------------------------------------------------------------ constructors for the baselines
    @classmethod
    def uniform(cls, embed_dim: int = 768, embedding_model: str | None = None) -> "FusionController":
        return cls(ControllerConfig(embed_dim=embed_dim, embedding_model=embedding_model, mode="uniform"))

    @classmethod
    def random(cls, embed_dim: int = 768, seed: int = 0, embedding_model: str | None = None) -> "FusionController":
        return cls(ControllerConfig(embed_dim=embed_dim, embedding_model=embedding_model, mode="random", seed=seed))

    @classmethod
    def fixed(cls, g: float, tau: float, embed_dim: int = 768, scorer: str = "cosine",
              embedding_model: str | None = None) -> "FusionController":
        return cls(ControllerConfig(embed_dim=embed_dim, embedding_model=embedding_model, mode="fixed",
                                    scorer=scorer, fixed_g=g, fixed_tau=tau))

    # ------------------------------------------------------------------ forward
    @property
    def runner(self) -> MLPRunner:
        """The :class:`MLPRunner` evaluating the MLPs (the default float32 one unless a faster one is set)."""
        return self.__dict__.get("_runner") or _DEFAULT_RUNNER

    def _mlp_rest(self, net: nn.Sequential, h: torch.Tensor, runner: MLPRunner) -> torch.Tensor:
        """``net`` after its first Linear (already applied to give ``h``); float32 output."""
        mods = list(net)
        i = 1
        while i < len(mods):
            m = mods[i]
            if isinstance(m, nn.Linear):
                h = runner.linear(m, h)
            elif isinstance(m, nn.ReLU):  # _mlp puts a Dropout after every ReLU: one fused step
                p = 0.0
                if i + 1 < len(mods) and isinstance(mods[i + 1], nn.Dropout):
                    i += 1
                    p = mods[i].p if self.training else 0.0
                h = runner.relu_dropout(h, p)
            elif isinstance(m, nn.Dropout):
                if self.training and m.p > 0:
                    h = nn.functional.dropout(h, m.p, True)
            else:  # pragma: no cover - _mlp builds only the three kinds above
                h = m(h)
            i += 1
        return runner.output(h)

    def _scores(self, e_q: torch.Tensor, E_p: torch.Tensor, xp: torch.Tensor, runner: MLPRunner) -> torch.Tensor:
        if self.config.scorer == "cosine":
            cos = torch.einsum("bd,bnd->bn", nn.functional.normalize(e_q, dim=-1), nn.functional.normalize(E_p, dim=-1))
            return (1 + cos) / 2
        h = runner.first(self.score_net[0], e_q, xp)
        return torch.sigmoid(self._mlp_rest(self.score_net, h, runner).squeeze(-1))

    def _calibration(self, e_q: torch.Tensor, E_p: torch.Tensor, xp: torch.Tensor, s: torch.Tensor,
                     mask: torch.Tensor | None, runner: MLPRunner) -> tuple[torch.Tensor, torch.Tensor]:
        """``g [B]``, ``tau [B]`` from the set summary (``mask`` None: every passage is real)."""
        d = e_q.shape[1]
        cos = xp[..., d:2 * d].sum(-1)  # e_q . e_p from the e_q*e_p block of the features (no second product)
        sc = torch.stack([s, cos], dim=1)  # [B, 2, N]: both statistics in one pass
        m2 = None if mask is None else mask.unsqueeze(1)
        mean, std = masked_mean(sc, m2, 2), masked_std(sc, m2, 2)
        mx, mn = masked_max(sc, m2, 2), masked_min(sc, m2, 2)
        n = torch.full_like(s[:, :1], float(s.shape[1])) if mask is None else mask.sum(1, keepdim=True).to(s.dtype)
        st = torch.stack([mean, std, mx, mn], dim=2).flatten(1)  # [s mean, std, max, min, cos mean, std, max, min]
        stats = torch.cat([st[:, :4], mx[:, :1] - mn[:, :1], st[:, 4:], n.log()], dim=1)  # CALIB_STATS columns
        summary = torch.cat([e_q, masked_mean(xp, mask), stats], dim=1)  # = [mean pair feature; stats]
        out = self._mlp_rest(self.calib_net, runner.linear(self.calib_net[0], summary), runner)
        g = torch.sigmoid(out[:, 0])
        c = self.config
        tau = c.tau_min + (c.tau_max - c.tau_min) * torch.sigmoid(out[:, 1])
        return g, tau

    def forward(self, e_q: torch.Tensor, E_p: torch.Tensor, mask: torch.Tensor | None = None) -> ControllerOutput:
        """``e_q [B, d]``, ``E_p [B, N, d]``, ``mask [B, N]`` (True = real passage; None: all real) ->
        :class:`ControllerOutput`."""
        c = self.config
        if e_q.ndim != 2 or E_p.ndim != 3 or e_q.shape[0] != E_p.shape[0]:
            raise ControllerError(f"expected e_q [B, d] and E_p [B, N, d], got {list(e_q.shape)} and {list(E_p.shape)}")
        if e_q.shape[-1] != c.embed_dim or E_p.shape[-1] != c.embed_dim:
            raise ControllerError(f"embedding dimension {e_q.shape[-1]} does not match the controller's embed_dim "
                                  f"{c.embed_dim} (embedding model '{c.embedding_model}')")
        B, N, _ = E_p.shape
        if N == 0:
            raise ControllerError("no passages (N == 0)")
        p = next(self.parameters())
        if mask is not None:
            mask = mask.to(device=p.device, dtype=torch.bool)
            if mask.shape != (B, N):
                raise ControllerError(f"mask has shape {list(mask.shape)}, expected [{B}, {N}]")
            if not bool(mask.any(1).all()):
                raise ControllerError("every sample needs at least one unmasked passage")
            if bool(mask.all()):
                mask = None  # nothing to mask: the cheaper unmasked formulas (same values)
        e_q, E_p = e_q.to(p), E_p.to(p)
        full_mask = torch.ones(B, N, dtype=torch.bool, device=p.device) if mask is None else mask
        if c.mode == "uniform":
            n = full_mask.sum(1, keepdim=True).to(p.dtype)
            w = full_mask.to(p.dtype) / n
            return ControllerOutput(torch.full((B, N), 0.5, dtype=p.dtype, device=p.device).masked_fill(~full_mask, 0),
                                    torch.zeros(B, dtype=p.dtype, device=p.device),
                                    torch.full((B,), c.tau_max, dtype=p.dtype, device=p.device),
                                    w, full_mask.to(p.dtype), full_mask)  # w~ exactly 1: PRAG's merge
        runner = self.runner
        if self.training and not runner.trainable:
            raise ControllerError("this controller is an inference copy (for_inference): call .eval(), or train "
                                  "the original controller")
        xp = passage_features(e_q, E_p)
        s = self._scores(e_q, E_p, xp, runner)
        if mask is not None:
            s = s.masked_fill(~mask, 0.0)
        if c.mode == "fixed":
            g = torch.full((B,), c.fixed_g, dtype=p.dtype, device=p.device)
            tau = torch.full((B,), c.fixed_tau, dtype=p.dtype, device=p.device)
        else:
            g, tau = self._calibration(e_q, E_p, xp, s, mask, runner)
        w, w_tilde = combine(s, g, tau, mask, c.eps)
        return ControllerOutput(s, g, tau, w, w_tilde, full_mask)

    # ------------------------------------------------------------------ fast inference
    def for_inference(self, dtype: torch.dtype = torch.bfloat16) -> "FusionController":
        """A copy for fast inference: eval mode, frozen parameters, the MLP weights converted once to ``dtype``.

        Batch-1 inference is memory-bound: the score net streams its whole weight matrix per call (21 MB in
        float32 for d = 384, 34 MB for d = 768). ``torch.bfloat16`` halves the bytes (and uses native bfloat16
        matmuls where the CPU has them); ``torch.int8`` (weight-only: one scale per output row, bfloat16
        activations, via ``torch._weight_int8pack_mm``) quarters them; ``torch.float32`` keeps float32 weights.
        Only the matmuls change: features, set statistics, sigmoid/softmax and the weights stay float32.
        ``benchmarks/bench_controller.py`` measures the speed.

        Accuracy (``w~`` on its scale where uniform is 1; ``s`` the scores in (0, 1)). On a trained d = 384
        controller (gate ~0.98, tau at its 0.05 floor, so score errors are amplified 20x in ``w~``), 2,000
        queries: largest ``|w~ - w~_fp32|`` 0.024 (bfloat16) / 0.037 (int8), means 0.003 / 0.004, ``|s - s_fp32|``
        below 3e-3; the top passage changed only where the float32 top-2 scores were within 1.1e-3 of a tie.
        Tested bound (``tests/test_controller.py``, a random controller sharpened to the same regime, where the
        measured maxima are 0.058 / 0.084 for ``w~`` and 3e-3 / 6e-3 for ``s``): ``|s - s_fp32| <= 5e-3`` and
        ``|w~ - w~_fp32| <= 0.08`` for bfloat16, ``1e-2`` and ``0.12`` for int8, and the same passage ranking
        wherever the float32 scores are at least 2e-2 apart.

        The copy's parameters (and ``save_pretrained`` files) are the float32 ones; the converted weights are
        rebuilt when a parameter is replaced or changed via ``load_state_dict``/``copy_``. The copy cannot be
        trained (calling it in train mode is an error).
        """
        if dtype not in INFERENCE_DTYPES:
            raise ControllerError(f"for_inference: dtype {dtype} is not supported, expected one of "
                                  f"{[str(t) for t in INFERENCE_DTYPES]}")
        if dtype == torch.int8 and next(self.parameters()).device.type != "cpu":
            raise ControllerError(f"for_inference: dtype torch.int8 is a CPU path, the controller is on "
                                  f"{next(self.parameters()).device}; use torch.bfloat16")
        if dtype == torch.int8 and not int8_matmul_available():
            raise ControllerError(f"for_inference: dtype torch.int8 needs torch._weight_int8pack_mm on the CPU, "
                                  f"which this torch ({torch.__version__}) lacks; use torch.bfloat16")
        fast = copy.deepcopy(self).eval().requires_grad_(False)
        fast.__dict__["_runner"] = InferenceRunner(dtype)
        return fast

    @torch.no_grad()
    def predict(self, query: str, passages: Sequence[str], encoder: Any) -> ControllerOutput:
        """Weights for one query and its passages, embedded with ``encoder`` (a :class:`TextEncoder`)."""
        self.check_encoder(encoder)
        was_training = self.training
        self.eval()
        try:
            e_q = encoder.encode([query])
            E_p = encoder.encode(list(passages)).unsqueeze(0)
            return self(e_q, E_p)
        finally:
            self.train(was_training)

    def check_encoder(self, encoder: Any) -> None:
        dim = getattr(encoder, "dim", None)
        if dim is not None and dim != self.config.embed_dim:
            raise ControllerError(
                f"encoder '{getattr(encoder, 'name', encoder)}' gives {dim}-d embeddings but the controller expects "
                f"{self.config.embed_dim}-d (trained with '{self.config.embedding_model}')"
            )
        from .encoding import check_recorded_model

        check_recorded_model(self.config.embedding_model, encoder)  # same size, other model: a one-time warning

    @property
    def encoder(self) -> Any:
        """The :class:`~fcprag_plugin.encoding.TextEncoder` of ``config.embedding_model`` on this controller's
        device: loaded on first use and shared by every controller with the same model and device
        (:func:`~fcprag_plugin.encoding.get_encoder`)."""
        from .encoding import get_encoder

        return get_encoder(self.config.embedding_model, device=next(self.parameters()).device)

    # ------------------------------------------------------------------ persistence
    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (never a pickle)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = asdict(self.config)
        cfg["library"] = "fcprag_plugin"
        (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt", "library": "fcprag_plugin"})
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, *, map_location: str | torch.device = "cpu") -> "FusionController":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        cfg_path, w_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not path.is_dir():
            raise ControllerError(f"{path}: controller directory not found (expected {CONFIG_NAME} + {WEIGHTS_NAME})")
        if not cfg_path.is_file():
            raise ControllerError(f"{cfg_path}: controller config not found")
        try:
            raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ControllerError(f"{cfg_path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ControllerError(f"{cfg_path}: expected a JSON object")
        raw.pop("library", None)
        known = {f.name for f in fields(ControllerConfig)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ControllerError(f"{cfg_path}: unknown key(s) {unknown}; expected keys among {sorted(known)}")
        if raw.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
            raise ControllerError(f"{cfg_path}: key 'format_version' is {raw['format_version']}, newer than this "
                                  f"library supports ({FORMAT_VERSION}); upgrade fcprag-plugin")
        try:
            config = ControllerConfig(**raw)
        except TypeError as e:
            raise ControllerError(f"{cfg_path}: {e}") from e
        model = cls(config.validate(str(cfg_path)))
        if not w_path.is_file():
            raise ControllerError(f"{w_path}: controller weights not found")
        try:
            state = load_file(str(w_path), device=str(map_location))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ControllerError(f"{w_path}: corrupt or unreadable safetensors file ({e})") from e
        own = model.state_dict()
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or extra:
            raise ControllerError(f"{w_path}: weights do not match the config: missing {missing[:4]}, unexpected {extra[:4]}")
        for k, v in state.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ControllerError(f"{w_path}: key '{k}' has shape {list(v.shape)}, the config implies "
                                      f"{list(own[k].shape)} (embed_dim {config.embed_dim})")
            if not bool(torch.isfinite(v).all()):
                raise ControllerError(f"{w_path}: key '{k}' has non-finite values")
        model.load_state_dict(state)
        return model.to(map_location).eval()

    def extra_repr(self) -> str:
        c = self.config
        return f"mode={c.mode}, scorer={c.scorer}, embed_dim={c.embed_dim}, tau=[{c.tau_min}, {c.tau_max}]"


def load_controller(controller: "FusionController | str | Path | None") -> "FusionController | None":
    """Accept a controller object, a directory (loaded once per process, see :mod:`fcprag_plugin.loading`), or
    None (None stays None: uniform)."""
    if controller is None or isinstance(controller, FusionController):
        return controller
    if isinstance(controller, (str, Path)):
        from .loading import cached_controller

        return cached_controller(controller)  # read once per process; shared, do not modify (loading.py)
    raise ControllerError(f"expected a FusionController or a directory, got {type(controller).__name__}")

