"""The nearest public peer of a per-query merge: PEFT's training-free **Arrow** router over a question's own
passage adapters (``peft.ArrowConfig`` / ``peft.create_arrow_model``, PEFT >= 0.18; Ostapenko et al. 2024,
https://huggingface.co/papers/2405.11157).

What Arrow does (read from PEFT's ``tuners/lora/arrow.py``): in every LoRA-wrapped Linear, each expert (here a
passage's adapter) gets a prototype, the top right singular vector of its ``B A`` (power iteration, seeded by
``rng_seed``); each token's input ``x`` is routed to the ``top_k`` experts with the largest ``|x . prototype|``,
with coefficients ``softmax(score / router_temperature)`` over those, and the layer adds
``sum_e coeff_e * scaling_e * B_e A_e x``. No training, no query encoder; the coefficients sum to 1 per token
(a convex mixture, like ``average``'s total, not PRAG's sum).

Why its own path: Arrow's weights change per token and per layer, so it is no ``w~`` row of the fused slot
(``scoring.score_jobs``). Per job (one question asked one way) :func:`score_arrow` wraps the model with
``create_arrow_model`` over the job's distinct adapters (``top_k = min(ARROW_TOP_K, experts)``), scores on the
same prompt the same way as the other rows (gold answer's mean token log-lik under teacher forcing, max over
aliases, ``batched_answer_logprobs``; with ``generate`` the greedy answer, ``batched_greedy`` with the same stop
tokens and ``max_new_tokens``, scored by ``scoring.finish``), then ``unload()``s the LoRA layers, leaving the base
model as it was. The routing is per token, so left padding and batching a question's aliases change nothing.
With a single expert (``top_k`` 1) the coefficient is 1 and Arrow is that adapter alone (tested).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from batch_scorer import Job

# PEFT's ArrowConfig defaults (top_k 3, temperature 1.0); rng_seed fixed so the prototypes are reproducible
ARROW_TOP_K = 3
ARROW_TEMPERATURE = 1.0
ARROW_SEED = 0
SCORER = "peft-arrow"


def status() -> tuple[bool, str]:
    """``(available, why)``: whether the installed PEFT has Arrow, with its version."""
    try:
        import peft
    except ImportError:
        return False, "peft is not installed"
    try:
        from peft import ArrowConfig, create_arrow_model  # noqa: F401
    except ImportError:
        return False, f"peft {peft.__version__} has no ArrowConfig (PEFT >= 0.18 has it)"
    return True, f"peft {peft.__version__}"


def settings(top_k: int = ARROW_TOP_K) -> dict[str, Any]:
    return {"top_k": top_k, "router_temperature": ARROW_TEMPERATURE, "rng_seed": ARROW_SEED,
            "top_k_per_question": f"min({top_k}, distinct adapters)"}


def arrow_model(model: Any, adapter_dirs: Sequence[str | Path], top_k: int = ARROW_TOP_K) -> Any:
    """``model`` wrapped in place by ``create_arrow_model`` over ``adapter_dirs`` (PEFT LoRA folders); the
    caller must ``unload()`` the returned PeftModel to get the plain model back."""
    import warnings

    from peft import ArrowConfig, create_arrow_model

    cfg = ArrowConfig(top_k=min(top_k, len(adapter_dirs)), router_temperature=ARROW_TEMPERATURE,
                      rng_seed=ARROW_SEED)
    with warnings.catch_warnings():  # PEFT asks transformers 5 a deprecated question once per wrap (per question)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return create_arrow_model(model, [str(d) for d in adapter_dirs], cfg)


@torch.no_grad()
def score_arrow(model: Any, tok: Any, jobs: Iterable[Job], adapter_dir: Callable[[str], Path], *,
                top_k: int = ARROW_TOP_K, max_new_tokens: int = 16, stop_ids: Iterable[int] | None = None,
                name: str = "arrow") -> list[dict[str, Any]]:
    """One result row (``scoring.finish``: ``key``, ``name``, ``logprob``[, generation metrics]) per encoded job,
    Arrow over the job's distinct adapters ``adapter_dir(pid)``. ``model`` must carry no other active adapter
    (remove any FusedSlot first); it is left unchanged."""
    from fcprag_tools.label_builder.batched import batched_answer_logprobs, batched_greedy

    from scoring import finish

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    stops = None if stop_ids is None else sorted(stop_ids)
    out = []
    for job in jobs:
        wrapped = arrow_model(model, [adapter_dir(p) for p in job.pids], top_k)
        try:
            lps = batched_answer_logprobs(model, [(job.prompt_ids, g) for g in job.gold], pad)
            gen = batched_greedy(model, tok, [job.prompt_ids], max_new_tokens, stops)[0] if job.generate else None
        finally:
            wrapped.unload()  # removes every LoRA layer without merging: the base modules are back
        out.append(finish(job, name, max(lps), gen, scorer=SCORER))
    return out
