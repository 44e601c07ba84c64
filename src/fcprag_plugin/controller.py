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
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .errors import ControllerError
from .features import masked_max, masked_mean, masked_min, masked_std, pair_features

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


def combine(scores: torch.Tensor, g: torch.Tensor, tau: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pi = softmax(s/tau)``, ``w = g*pi + (1-g)/N``, ``w~ = N*w/(sum w + eps)``; all masked. Returns (w, w~)."""
    n = mask.sum(1, keepdim=True).to(scores.dtype)
    logits = (scores / tau.unsqueeze(1)).masked_fill(~mask, float("-inf"))
    pi = torch.softmax(logits, dim=1).masked_fill(~mask, 0.0)
    w = (g.unsqueeze(1) * pi + (1 - g.unsqueeze(1)) / n).masked_fill(~mask, 0.0)
    w_tilde = n * w / (w.sum(1, keepdim=True) + eps)
    return w, w_tilde


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
    def _scores(self, e_q: torch.Tensor, E_p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.config.scorer == "cosine":
            cos = torch.einsum("bd,bnd->bn", nn.functional.normalize(e_q, dim=-1), nn.functional.normalize(E_p, dim=-1))
            return (1 + cos) / 2
        return torch.sigmoid(self.score_net(x).squeeze(-1))

    def _calibration(self, e_q, E_p, x, s, mask) -> tuple[torch.Tensor, torch.Tensor]:
        cos = torch.einsum("bd,bnd->bn", e_q, E_p)
        smax, smin = masked_max(s, mask), masked_min(s, mask)
        stats = torch.stack([
            masked_mean(s, mask), masked_std(s, mask), smax, smin, smax - smin,
            masked_mean(cos, mask), masked_std(cos, mask), masked_max(cos, mask), masked_min(cos, mask),
            mask.sum(1).to(s.dtype).log(),
        ], dim=1)
        out = self.calib_net(torch.cat([masked_mean(x, mask), stats], dim=1))
        g = torch.sigmoid(out[:, 0])
        c = self.config
        tau = c.tau_min + (c.tau_max - c.tau_min) * torch.sigmoid(out[:, 1])
        return g, tau

    def forward(self, e_q: torch.Tensor, E_p: torch.Tensor, mask: torch.Tensor | None = None) -> ControllerOutput:
        """``e_q [B, d]``, ``E_p [B, N, d]``, ``mask [B, N]`` (True = real passage) -> :class:`ControllerOutput`."""
        c = self.config
        if e_q.ndim != 2 or E_p.ndim != 3 or e_q.shape[0] != E_p.shape[0]:
            raise ControllerError(f"expected e_q [B, d] and E_p [B, N, d], got {list(e_q.shape)} and {list(E_p.shape)}")
        if e_q.shape[-1] != c.embed_dim or E_p.shape[-1] != c.embed_dim:
            raise ControllerError(f"embedding dimension {e_q.shape[-1]} does not match the controller's embed_dim "
                                  f"{c.embed_dim} (embedding model '{c.embedding_model}')")
        B, N, _ = E_p.shape
        if N == 0:
            raise ControllerError("no passages (N == 0)")
        mask = torch.ones(B, N, dtype=torch.bool, device=E_p.device) if mask is None else mask.to(torch.bool)
        if mask.shape != (B, N):
            raise ControllerError(f"mask has shape {list(mask.shape)}, expected [{B}, {N}]")
        if not bool(mask.any(1).all()):
            raise ControllerError("every sample needs at least one unmasked passage")
        p = next(self.parameters())
        e_q, E_p, mask = e_q.to(p), E_p.to(p), mask.to(p.device)
        if c.mode == "uniform":
            n = mask.sum(1, keepdim=True).to(p.dtype)
            w = mask.to(p.dtype) / n
            return ControllerOutput(torch.full((B, N), 0.5, dtype=p.dtype, device=p.device).masked_fill(~mask, 0),
                                    torch.zeros(B, dtype=p.dtype, device=p.device),
                                    torch.full((B,), c.tau_max, dtype=p.dtype, device=p.device),
                                    w, mask.to(p.dtype), mask)  # w~ exactly 1: PRAG's merge
        x = pair_features(e_q, E_p)
        s = self._scores(e_q, E_p, x).masked_fill(~mask, 0.0)
        if c.mode == "fixed":
            g = torch.full((B,), c.fixed_g, dtype=p.dtype, device=p.device)
            tau = torch.full((B,), c.fixed_tau, dtype=p.dtype, device=p.device)
        else:
            g, tau = self._calibration(e_q, E_p, x, s, mask)
        w, w_tilde = combine(s, g, tau, mask, c.eps)
        return ControllerOutput(s, g, tau, w, w_tilde, mask)

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
    """Accept a controller object, a directory, or None (None stays None: uniform)."""
    if controller is None or isinstance(controller, FusionController):
        return controller
    if isinstance(controller, (str, Path)):
        return FusionController.from_pretrained(controller)
    raise ControllerError(f"expected a FusionController or a directory, got {type(controller).__name__}")

