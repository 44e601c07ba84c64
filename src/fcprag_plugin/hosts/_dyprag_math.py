"""The math of the DyPRAG shim: check that captured translator outputs (dicts of ``...{module}.lora_A.weight``
``[..., r, in]`` / ``...lora_B.weight`` ``[..., out, r]``; DyPRAG's ``delta = lora_B @ lora_A``, no scaling) line up
with DyPRAG's average, then re-aggregate them with per-passage weights ``u`` ``[N]`` by the merge modes' math:
``separate``: ``A* = sum_i u_i A_i``, ``B* = sum_i u_i B_i``; ``cat``: ``A = cat_i(u_i A_i)``,
``B = cat_i(B_i)``, so ``B A = sum_i u_i B_i A_i`` exactly. Results keep DyPRAG's dtypes, devices and keys."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..adapter import strip_peft_prefix
from ..errors import HookError, kw
from ..merge import factors

A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"
DYPRAG_MODES = ("separate", "cat")  # merge modes, on DyPRAG's weights u = w~/N


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> tuple[bool, float]:
    """Equal, or equal up to a few ulps of the dtype at the inputs' ``scale`` (a host may average in another
    summation order); a capture that is out of step differs by far more. NaNs must sit at the same places."""
    a, b = a.detach(), b.detach()
    if torch.equal(a, b):
        return True, 0.0
    eps = torch.finfo(b.dtype).eps if b.dtype.is_floating_point else 0.0
    ok = bool(torch.isclose(a.double(), b.double(), rtol=0.0, atol=8 * eps * scale, equal_nan=True).all())
    diff = float((a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max()) if a.numel() else 0.0
    return ok, diff


def check_alignment(outputs: Sequence[Any], merged: Mapping[str, Any], n_passages: int, question: str = "") -> None:
    """Raise :class:`HookError` unless the captured ``outputs`` (in call order) are ``n_passages`` dicts whose
    plain mean is ``merged``, the dict DyPRAG passed to ``delta_inject``."""
    q = f" (question {question[:80]!r})" if question else ""
    if not isinstance(merged, Mapping) or not merged:
        raise HookError(f"fcprag dyprag: delta_inject got a {type(merged).__name__} "
                        f"{'(empty)' if isinstance(merged, Mapping) else ''}; expected a non-empty dict of "
                        f"'...lora_A.weight' / '...lora_B.weight' tensors")
    if len(outputs) != n_passages:
        raise HookError(
            f"fcprag dyprag: captured {len(outputs)} ParameterTranslator output(s) since the last delta_inject, but "
            f"the question has {n_passages} passage(s){q}. The capture is out of step with the passages (an extra "
            f"or warm-up translator call, or a skipped passage); refusing to merge")
    keys = set(merged)
    for i, out in enumerate(outputs):
        if not isinstance(out, Mapping):
            raise HookError(f"fcprag dyprag: ParameterTranslator call {i} returned a {type(out).__name__}; "
                            "expected a dict of LoRA factors")
        if set(out) != keys:
            missing, extra = sorted(keys - set(out)), sorted(set(out) - keys)
            raise HookError(f"fcprag dyprag: ParameterTranslator output {i} does not have the keys of the dict "
                            f"given to delta_inject{q}: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for key, m in merged.items():
        if not isinstance(m, torch.Tensor):
            raise HookError(f"fcprag dyprag: key '{key}' given to delta_inject is a {type(m).__name__}, "
                            "expected a tensor")
        for i, out in enumerate(outputs):
            t = out[key]
            if not isinstance(t, torch.Tensor) or t.shape != m.shape:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise HookError(f"fcprag dyprag: key '{key}': ParameterTranslator output {i} has shape {shape} "
                                f"but delta_inject got {list(m.shape)}{q}")
        stacked = torch.stack([out[key].detach().to(m.device) for out in outputs])
        scale = float(stacked.abs().nan_to_num(nan=0.0).max()) if stacked.numel() else 0.0
        ok, diff = _close(stacked.mean(dim=0).to(m.dtype), m, scale)
        if not ok:
            raise HookError(f"fcprag dyprag: key '{key}': the dict given to delta_inject is not the plain mean of the "
                            f"{len(outputs)} captured ParameterTranslator outputs (max abs difference {diff:.3g}){q}. "
                            f"The capture is out of step with DyPRAG's merge; refusing to merge")


def _pair(mod: str, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of module ``mod`` when they form ``B @ A`` (``A [..., r, in]``, ``B [..., out, r]``), else a
    :class:`HookError` naming both shapes."""
    if A.ndim < 2 or B.ndim < 2 or A.shape[-2] != B.shape[-1]:
        raise HookError(f"fcprag dyprag: module '{mod}': lora_A {list(A.shape)} and lora_B {list(B.shape)} do not "
                        "form B @ A (expected A [r, in], B [out, r])")
    return A, B


def lora_pairs(keys: Sequence[str], need: str = "mode 'cat'",
               hint: str = "use mode 'separate' for other keys", params: Sequence[tuple[str, Any]] = ()
               ) -> dict[str, tuple[str, str]]:
    """``{module: (A key, B key)}``; every key must be one half of a complete pair (``need`` / ``hint`` word the
    error; ``params``: the keywords ``hint`` names, see :class:`~fcprag_plugin.errors.FcpragError`)."""
    mods: dict[str, dict[str, str]] = {}
    for k in keys:
        kind = "A" if k.endswith(A_SUFFIX) else "B" if k.endswith(B_SUFFIX) else None
        if kind is None:
            raise HookError(f"fcprag dyprag: key '{k}' is neither '...{A_SUFFIX}' nor '...{B_SUFFIX}'; "
                            f"{need} needs LoRA factor pairs ({hint})", params=params)
        mods.setdefault(k[: -len(A_SUFFIX)], {})[kind] = k  # both suffixes have the same length
    for mod, d in mods.items():
        if "A" not in d or "B" not in d:
            raise HookError(f"fcprag dyprag: module '{mod}' has only '{d.get('A') or d.get('B')}'; {need} needs "
                            f"both its '{A_SUFFIX[1:]}' and '{B_SUFFIX[1:]}'")
    return {mod: (d["A"], d["B"]) for mod, d in mods.items()}


def module_factors(output: Mapping[str, torch.Tensor], index: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module path without the PEFT prefix: (A [r, in], B [out, r])}`` of one translator output, for the fused
    slot (leading size-1 dimensions dropped; a real batch of factors is a :class:`HookError`)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hint = f"run without {kw('use_slot', True)} for other keys"
    for mod, (ka, kb) in lora_pairs(list(output), need="use_slot", hint=hint, params=[("use_slot", True)]).items():
        pair = []
        for key in (ka, kb):
            t = output[key]
            if not isinstance(t, torch.Tensor):
                raise HookError(f"fcprag dyprag: ParameterTranslator output {index}: key '{key}' is a "
                                f"{type(t).__name__}, expected a tensor")
            if t.ndim > 2 and all(d == 1 for d in t.shape[:-2]):
                t = t.reshape(t.shape[-2:])
            if t.ndim != 2:
                raise HookError(f"fcprag dyprag: ParameterTranslator output {index}: key '{key}' has shape "
                                f"{list(t.shape)}; use_slot needs one [r, in] / [out, r] factor pair per module "
                                f"(a batch of factors cannot share one slot): run without {kw('use_slot', True)}",
                                params=[("use_slot", True)])
            pair.append(t.detach())
        out[strip_peft_prefix(mod)[0]] = _pair(mod, *pair)
    return out


def aggregate(outputs: Sequence[Mapping[str, torch.Tensor]], u: torch.Tensor | Sequence[float], mode: str
              ) -> dict[str, torch.Tensor]:
    """The ``outputs`` re-aggregated with weights ``u`` ``[N]`` (module docstring), keys in DyPRAG's order
    (``cat``: ``A`` ``[..., N r, in]``, ``B`` ``[..., out, N r]``)."""
    if mode not in DYPRAG_MODES:
        raise HookError(f"fcprag dyprag: mode '{mode}' is not one of {list(DYPRAG_MODES)}")
    w = [float(x) for x in u]
    if len(w) != len(outputs):
        raise HookError(f"fcprag dyprag: got {len(w)} weights for {len(outputs)} passages")
    if mode == "separate":
        return {key: factors.weighted_sum([o[key] for o in outputs], w) for key in outputs[0]}
    first = outputs[0]
    out: dict[str, torch.Tensor] = {}
    for mod, (ka, kb) in lora_pairs(list(first)).items():
        _pair(mod, first[ka], first[kb])
        out[ka], out[kb] = factors.cat([o[ka] for o in outputs], [o[kb] for o in outputs], w)
    return {k: out[k] for k in first}
