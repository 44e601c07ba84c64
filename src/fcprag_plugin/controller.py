"""``FusionController``: per-query, calibrated merge weights for N passage adapters.

    x_i = [e_q; e_p_i; e_q*e_p_i; |e_q-e_p_i|; side_i]         (features.pair_features; side_i opt-in)
    s_i = sigmoid(ScoreNet(x_i))                               score net: 4d (+k) -> 2048 -> 1024 -> 1
    g, tau (, c) = CalibNet(summary of the set)                calib net: summary -> 256 -> 2 (3)
    pi = softmax(s / tau),  w_i = g*pi_i + (1-g)/N,  w~_i = N*w_i / sum w        (combine)
    merge weights = kappa * c * w~                             kappa = 1, c = 1 unless configured

Modes (``config.controller_mode``): ``learned`` (the nets above), ``uniform`` (no nets, no encoder: ``w~ =
[kappa]*N``), ``random`` (untrained nets, seeded) and ``fixed`` (one global g and tau). ``w~ = [1]*N`` is PRAG's
merge (a plain sum of the passage updates), where ``init="uniform"`` starts. Side features (retrieval rank and
score, :func:`features.adapter_stats`) feed the score net only, centered within the set; ``c = 2*sigmoid(o_3)``."""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .controller_config import CONFIG_NAME, WEIGHTS_NAME, ControllerConfig, read_config, read_weights, write_files
from .encoding import check_recorded_model, get_encoder
from .errors import BARE, ControllerError, kw
from .loading import LoadCache, file_signature
from .features import (ADAPTER_STAT_NAMES, CALIB_STATS, adapter_recipe, adapter_stats, calibration_summary,
                       center_side, passage_features)
from .networks import CalibNet, ScoreNet, combine

logger = logging.getLogger(__name__)

GATE_INIT = 0.5  # g at initialisation; irrelevant to w~ there (all scores are equal), the point of most gradient
INFERENCE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class ControllerOutput:
    """Controller outputs for a batch (padding, ``mask [B, N]`` False, has zero weight): ``scores`` ``s [B, N]``,
    gate ``g [B]``, temperature ``tau [B]``, ``probabilities`` ``w [B, N]`` (sum 1 over the real passages),
    ``merge_weights`` ``kappa * c * w~ [B, N]`` (``w~ = N*w/sum w``), ``scale`` ``kappa * c [B]`` (None when 1)."""

    scores: torch.Tensor
    g: torch.Tensor
    tau: torch.Tensor
    probabilities: torch.Tensor
    merge_weights: torch.Tensor
    mask: torch.Tensor
    scale: torch.Tensor | None = None


def _side_matrix(names: Sequence[str], optional: Sequence[str], n: int, retrieval_ranks: Any, retrieval_scores: Any,
                 adapter_stats_: Any) -> tuple[torch.Tensor, list[str]]:
    """The raw side-feature columns ``[n, k]`` of one query from :meth:`FusionController.predict`'s arguments, and
    the ``optional`` features that were missing (constant columns: no difference between the passages)."""
    given = {"retrieval_rank": retrieval_ranks, "retrieval_score": retrieval_scores, "adapter_stats": adapter_stats_}
    missing = [nm for nm in names if given[nm] is None]
    required = [f"{nm}s" if nm != "adapter_stats" else nm for nm in missing if nm not in optional]
    if required:
        raise ControllerError(f"this controller was trained with side features {list(names)}; pass "
                              f"{', '.join(map(kw, required))} (one value per passage) to use it",
                              params=[(nm, BARE) for nm in required])
    cols = []
    for nm in names:
        if given[nm] is None:
            cols.append(torch.zeros(n, 1))
        elif nm != "adapter_stats":
            t = torch.as_tensor(given[nm], dtype=torch.float32).reshape(-1)
            if t.numel() != n:
                raise ControllerError(f"{kw(nm + 's')} has {t.numel()} values for {n} passages; expected one each",
                                      params=[(nm + "s", BARE)])
            cols.append(t.unsqueeze(1))
        else:
            rows = [adapter_stats(a) if hasattr(a, "modules") else a for a in given[nm]]
            if len(rows) != n:
                raise ControllerError(f"adapter_stats= has {len(rows)} entries for {n} passages; expected one each")
            try:
                mat = [[float(r[k]) for k in ADAPTER_STAT_NAMES] if isinstance(r, dict) else [float(x) for x in r]
                       for r in rows]
                t = torch.tensor(mat, dtype=torch.float32)  # (rows of different lengths: ValueError)
            except (KeyError, TypeError, ValueError) as e:
                raise ControllerError(f"adapter_stats=: expected a LoraAdapter, a dict with keys "
                                      f"{list(ADAPTER_STAT_NAMES)} or a list of {len(ADAPTER_STAT_NAMES)} numbers "
                                      f"per passage ({e})") from e
            if t.shape != (n, len(ADAPTER_STAT_NAMES)):
                raise ControllerError(f"adapter_stats= gives shape {list(t.shape)}, expected "
                                      f"[{n}, {len(ADAPTER_STAT_NAMES)}]")
            cols.append(t)
    side = torch.cat(cols, 1)
    if not bool(torch.isfinite(side).all()):
        raise ControllerError(f"side features {list(names)} contain non-finite values")
    return side, missing


def _check_inputs(c: ControllerConfig, e_q: torch.Tensor, E_p: torch.Tensor, mask: torch.Tensor | None,
                  side: torch.Tensor | None) -> torch.Tensor | None:
    """:meth:`FusionController.forward`'s inputs checked against config ``c``: the mask (None: all real)."""
    if e_q.ndim != 2 or E_p.ndim != 3 or e_q.shape[0] != E_p.shape[0]:
        raise ControllerError(f"expected e_q [B, d] and E_p [B, N, d], got {list(e_q.shape)} and {list(E_p.shape)}")
    if e_q.shape[-1] != c.embed_dim or E_p.shape[-1] != c.embed_dim:
        raise ControllerError(f"embedding dimension {e_q.shape[-1]} does not match the controller's embed_dim "
                              f"{c.embed_dim} (embedding model '{c.embedding_model}')")
    B, N, _ = E_p.shape
    if N == 0:
        raise ControllerError("no passages (N == 0)")
    k = len(c.side_columns)
    if k and c.controller_mode != "uniform" and side is None:
        raise ControllerError(f"this controller was trained with side features {c.side_features}; they must be "
                              f"given (predict(..., retrieval_ranks=, retrieval_scores=, adapter_stats=))")
    if side is not None and k and tuple(side.shape) != (B, N, k):
        raise ControllerError(f"side features have shape {list(side.shape)}, expected [{B}, {N}, {k}] "
                              f"(columns {c.side_columns})")
    if mask is not None:
        mask = mask.to(device=e_q.device, dtype=torch.bool)
        if mask.shape != (B, N):
            raise ControllerError(f"mask has shape {list(mask.shape)}, expected [{B}, {N}]")
        if not bool(mask.any(1).all()):
            raise ControllerError("every sample needs at least one unmasked passage")
        if bool(mask.all()):
            mask = None  # nothing to mask: the cheaper unmasked formulas (same values)
    return mask


class FusionController(nn.Module):
    """Maps ``(e_q [B, d], E_p [B, N, d], mask [B, N])`` to calibrated merge weights (:class:`ControllerOutput`);
    the baselines are modes of the same class (see the module docstring)."""

    def __init__(self, config: ControllerConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        config = config or ControllerConfig(**kwargs)
        self.config = config.validate()
        d, k = config.embed_dim, len(config.side_columns)
        self.score_net: ScoreNet | None = None
        self.calib_net: CalibNet | None = None
        if config.controller_mode != "uniform":
            with torch.random.fork_rng(devices=[], enabled=config.seed is not None):  # the global RNG is left alone
                if config.seed is not None:
                    torch.manual_seed(config.seed)
                self.score_net = ScoreNet(d, 3 * d + k, config.score_hidden, config.dropout)
                self.calib_net = CalibNet(4 * d + CALIB_STATS, config.calib_hidden, config.dropout, config.tau_min,
                                          config.tau_max, config.calib_scale)
        if config.init == "uniform" and config.controller_mode == "learned":  # baselines keep their own (random) nets
            self.reset_to_uniform_()
        scale = config.side_scale if config.side_scale is not None else [1.0] * k
        self.register_buffer("_side_scale", torch.tensor(scale, dtype=torch.float32), persistent=False)
        self._inference_copy = False
        self._warned: set[str] = set()
        self.source: str | None = None  # the directory it was loaded from

    @torch.no_grad()
    def reset_to_uniform_(self) -> "FusionController":
        """Zero both heads' output layers: equal scores (``w~ = [1]*N`` exactly), the gate at ``GATE_INIT``, tau
        mid-range, the per-query scale 1; the hidden layers keep their random initialisation (gradients at step 1)."""
        for last in (self.score_net[-1], self.calib_net[-1]):
            last.weight.zero_()
            last.bias.zero_()
        self.calib_net[-1].bias[0] = math.log(GATE_INIT / (1 - GATE_INIT))
        return self

    @classmethod
    def uniform(cls, embed_dim: int = 768, embedding_model: str | None = None, kappa: float = 1.0
                ) -> "FusionController":
        return cls(embed_dim=embed_dim, embedding_model=embedding_model, controller_mode="uniform", kappa=kappa)

    @classmethod
    def scale_only(cls, kappa: float, *, embed_dim: int = 768, embedding_model: str | None = None,
                   cv: dict[str, Any] | None = None) -> "FusionController":
        """PRAG's sum times ``kappa`` (``w~ = [kappa]*N``; no network, no encoder): what ``fcprag train`` ships when
        the reweighting part of its verdict (``cv``) is not shown."""
        return cls(embed_dim=embed_dim, embedding_model=embedding_model, controller_mode="uniform", kappa=float(kappa),
                   cv=cv)

    @classmethod
    def random(cls, embed_dim: int = 768, seed: int = 0, embedding_model: str | None = None) -> "FusionController":
        return cls(embed_dim=embed_dim, embedding_model=embedding_model, controller_mode="random", seed=seed)

    @classmethod
    def fixed(cls, g: float, tau: float, embed_dim: int = 768, scorer: str = "cosine",
              embedding_model: str | None = None) -> "FusionController":
        return cls(ControllerConfig(embed_dim=embed_dim, embedding_model=embedding_model, controller_mode="fixed",
                                    scorer=scorer, fixed_g=g, fixed_tau=tau))

    def score(self, e_q: torch.Tensor, E_p: torch.Tensor, xp: torch.Tensor, side: torch.Tensor | None
              ) -> torch.Tensor:
        """``s [B, N]`` in (0, 1): the score net on ``[e_q; xp_i; side_i]`` (cosine scorer: ``(1 + cos)/2``)."""
        if self.config.scorer == "cosine":
            cos = torch.einsum("bd,bnd->bn", nn.functional.normalize(e_q, dim=-1), nn.functional.normalize(E_p, dim=-1))
            return (1 + cos) / 2
        x = xp if side is None else torch.cat([xp, side.to(xp.dtype)], -1)
        return torch.sigmoid(self.score_net(e_q, x))

    def forward(self, e_q: torch.Tensor, E_p: torch.Tensor, mask: torch.Tensor | None = None,
                side: torch.Tensor | None = None) -> ControllerOutput:
        """``e_q [B, d]``, ``E_p [B, N, d]``, ``mask [B, N]`` (True = real; None: all), ``side [B, N, k]`` (raw, in
        ``config.side_columns`` order; required when the controller has any) -> :class:`ControllerOutput`."""
        c = self.config
        if self.training and self._inference_copy:
            raise ControllerError("this controller is an inference copy (for_inference): call .eval(), or train "
                                  "the original controller")
        p = self._side_scale  # float32 (float64 after .double()): the dtype of everything outside the MLPs
        e_q, E_p = e_q.to(p), E_p.to(p)
        mask = _check_inputs(c, e_q, E_p, mask, side)
        B, N, _ = E_p.shape
        full_mask = torch.ones(B, N, dtype=torch.bool, device=p.device) if mask is None else mask
        scale = None if c.kappa == 1.0 else torch.full((B,), float(c.kappa), dtype=p.dtype, device=p.device)
        q_scale = None
        if c.controller_mode == "uniform":  # g = 0: exactly w~ = 1, PRAG's merge
            s = full_mask.to(p.dtype) / 2
            g, tau = s.new_zeros(B), s.new_full((B,), c.tau_max)
        else:
            xp = passage_features(e_q, E_p)
            side_x = center_side(side.to(p), mask, p) if c.side_features and c.scorer == "mlp" else None
            s = self.score(e_q, E_p, xp, side_x)
            if mask is not None:
                s = s.masked_fill(~mask, 0.0)
            if c.controller_mode == "fixed":
                g, tau = s.new_full((B,), c.fixed_g), s.new_full((B,), c.fixed_tau)
            else:
                g, tau, q_scale = self.calib_net(calibration_summary(e_q, xp, s, mask))
        w, w_tilde = combine(s, g, tau, mask)
        if q_scale is not None:
            scale = q_scale if scale is None else scale * q_scale
        if scale is not None:
            w_tilde = w_tilde * scale.unsqueeze(1)
        return ControllerOutput(s, g, tau, w, w_tilde, full_mask, scale)

    def for_inference(self, dtype: torch.dtype = torch.bfloat16) -> "FusionController":
        """A frozen eval copy with the two MLPs' weights in ``dtype`` (everything else stays float32); it saves the
        rounded weights as float32, and calling it in train mode is an error."""
        if dtype not in INFERENCE_DTYPES:
            raise ControllerError(f"for_inference: dtype {dtype} is not supported, expected one of "
                                  f"{[str(t) for t in INFERENCE_DTYPES]}")
        fast = copy.deepcopy(self).eval().requires_grad_(False)
        for net in (fast.score_net, fast.calib_net):
            if net is not None:
                net.to(dtype)
        fast._inference_copy = True
        return fast

    @torch.no_grad()
    def predict(self, query: str, passages: Sequence[str], encoder: Any = None, *,
                retrieval_ranks: Sequence[float] | None = None, retrieval_scores: Sequence[float] | None = None,
                adapter_stats: Sequence[Any] | None = None) -> ControllerOutput:
        """Weights for one query and its passages, embedded with ``encoder`` (None: :attr:`encoder`). Side features
        of a controller trained with them, one entry per passage: ``retrieval_ranks``, ``retrieval_scores``,
        ``adapter_stats`` (a ``LoraAdapter``, a dict from :func:`features.adapter_stats` or its values). A missing one
        of ``config.optional_side`` is taken as equal (a ``UserWarning`` once); a missing required one raises."""
        self.warn_if_unproven()  # weigh() comes through here: one warning per controller
        if encoder is None:
            encoder = self.encoder  # the shared, lazily loaded encoder of config.embedding_model
        self.check_encoder(encoder)
        side = None
        if self.config.side_features and self.config.controller_mode != "uniform":
            side, missing = _side_matrix(self.config.side_features, self.config.optional_side, len(passages),
                                         retrieval_ranks, retrieval_scores, adapter_stats)
            side = side.unsqueeze(0)
            for name in missing:
                arg = {"retrieval_rank": "retrieval_ranks=", "retrieval_score": "retrieval_scores="}.get(name, name)
                self._warn_once(f"missing:{name}", f"fcprag: controller '{self._name}' was trained with the side "
                                f"feature '{name}' but this call has none: taken as equal for every passage (its "
                                f"verdict was measured with the feature); pass {arg} (one value per passage)")
        was_training = self.training
        self.eval()
        try:
            e_q = encoder.encode([query])
            E_p = encoder.encode(list(passages)).unsqueeze(0)
            return self(e_q, E_p, side=side)
        finally:
            self.train(was_training)

    def warn_if_unproven(self, *, quiet: bool = False) -> bool:
        """Warn once per controller (``UserWarning`` and the log) when its selection-unbiased gain over PRAG's sum
        (``config.cv``) has a 95% CI not above 0, or was never measured (``cv_folds=0``); returns whether it is.
        ``quiet``: count it as said without saying it (a caller that measures the controller and reports that)."""
        cv = self.config.cv
        unproven = bool(cv) and cv.get("verdict") == "unproven"
        if unproven:
            lo, hi = cv.get("ci95") or (float("nan"), float("nan"))
            said = "was never compared with PRAG's sum (it was trained without cross-validation, --cv-folds 0)" if \
                cv.get("gain") is None else (f"was NOT shown to beat PRAG's sum: gain {cv['gain']:+.4g} per record, "
                                             f"95% CI [{lo:+.4g}, {hi:+.4g}] (held-out, selection-unbiased)")
            if quiet:
                self._warned.add("unproven")
            else:
                self._warn_once("unproven", f"fcprag: controller '{self._name}' {said}; its weights may be no better "
                                "than uniform")
        return unproven

    _name = property(lambda self: str(self.source or (self.config.cv or {}).get("source") or "(in memory)"))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", message)
            warnings.warn(message, UserWarning, stacklevel=_caller_level())

    @property
    def needs_adapters(self) -> bool:
        """Whether ``weigh`` reads adapters given as a callable: for adapter statistics, or a recipe not checked yet."""
        c = self.config
        return ("adapter_stats" in c.side_features and c.controller_mode != "uniform") or bool(
            (c.trained_for or {}).get("adapter_recipes")) and not {"recipe", "recipe-read"} & self._warned

    def check_adapters(self, adapters: Sequence[Any]) -> bool:
        """Warn once per controller (``UserWarning`` and the log) when ``adapters`` are of another recipe than
        ``config.trained_for``; returns whether they match (:func:`~fcprag_plugin.weights.weigh` calls it)."""
        known, keys = (self.config.trained_for or {}).get("adapter_recipes") or [], ("rank", "scaling", "targets")
        if not known or "recipe" in self._warned:
            return True
        self._warned.add("recipe-read")
        for a in adapters:
            got = adapter_recipe(a)
            if not any(all(got[k] == r.get(k) for k in (*keys, "modules", "shapes")) for r in known):
                self._warn_once("recipe", f"fcprag: controller '{self._name}' was trained for adapters of base model "
                                f"{', '.join(map(str, self.config.trained_for.get('base_model') or ['?']))} with "
                                f"{[{k: r.get(k) for k in (*keys, 'modules')} for r in known]}, but adapter "
                                f"{getattr(a, 'source', '?')} has {({k: got[k] for k in (*keys, 'modules')})} "
                                f"(shapes {got['shapes'][:3]}, base model {got['base_model']}): its kappa and adapter "
                                "statistics were fitted to the other adapters; train one on labels of these")
                return False
        return True

    def check_encoder(self, encoder: Any) -> None:
        """Raise :class:`ControllerError` naming both models when ``encoder`` is not the recorded embedding model
        (another dimension, or another model: :func:`~fcprag_plugin.encoding.check_recorded_model`)."""
        dim, name = getattr(encoder, "dim", None), getattr(encoder, "name", encoder)
        if dim is not None and dim != self.config.embed_dim:
            raise ControllerError(f"encoder '{name}' gives {dim}-d embeddings but the controller expects "
                                  f"{self.config.embed_dim}-d (trained with '{self.config.embedding_model}')")
        if not check_recorded_model(self.config.embedding_model, encoder):
            raise ControllerError(f"encoder '{name}' is not the embedding model this controller was trained with "
                                  f"('{self.config.embedding_model}'); leave {kw('encoder')} out to use the "
                                  "controller's own, or pass that model", params=[("encoder", BARE)])

    @property
    def encoder(self) -> Any:
        """The shared :class:`~fcprag_plugin.encoding.TextEncoder` of ``config.embedding_model`` on this device."""
        return get_encoder(self.config.embedding_model, device=self._side_scale.device)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (:func:`~fcprag_plugin.controller_config.write_files`)."""
        return write_files(Path(path), self.config, self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, map_location: str | torch.device = "cpu") -> "FusionController":
        """The controller saved in directory ``path``."""
        path = Path(path)
        model = cls(read_config(path))
        model.load_state_dict(read_weights(path, model.state_dict(), map_location, model.config.embed_dim))
        model.source = str(path)
        return model.to(map_location).eval()

    def extra_repr(self) -> str:
        c = self.config
        return (f"controller_mode={c.controller_mode}, scorer={c.scorer}, embed_dim={c.embed_dim}, "
                f"tau=[{c.tau_min}, {c.tau_max}]")


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the user's call: the first frame outside this package and
    outside torch (whose ``no_grad`` decorator wraps :meth:`FusionController.predict`)."""
    skip = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


CONTROLLERS: LoadCache[FusionController] = LoadCache("controller cache", maxsize=4)  # ~14 MB each at d=384


def load_controller(controller: "FusionController | str | Path | None") -> "FusionController | None":
    """A controller object, a directory (read once per process, again when its files change; shared, do not
    modify) or None (uniform) -> the controller or None."""
    if controller is None or isinstance(controller, FusionController):
        return controller
    if not isinstance(controller, (str, Path)):
        raise ControllerError(f"expected a FusionController or a directory, got {type(controller).__name__}")
    resolved = Path(os.path.realpath(controller))
    files = (resolved / CONFIG_NAME, resolved / WEIGHTS_NAME)
    return CONTROLLERS.get(str(resolved), lambda: FusionController.from_pretrained(controller),
                           lambda: file_signature(*files))

