"""Held-out scoring by real forwards: named weight rows of many questions in mixed batches, each row its own
per-sample fusion (:func:`fcprag_tools.lm.batched.score_rows`), and PEFT's Arrow router on its own path.

A row is data: a question, a name, its prompt (``param``: the question only, PRAG's; ``combine``: the retrieved
passages in the prompt too, the paper's "Combine") and one ``w~`` per passage adapter (0: that adapter is off; all
0: the base model, e.g. ``vanilla`` and ``standard_rag``). A row's result: ``logprob`` (the gold answer's mean token
log-likelihood under teacher forcing, best over the aliases), and the greedy answer from the same prompt (read
once for both, :func:`fcprag_tools.lm.batched.read_prompts`) scored by PRAG's rules: the short answer is the
generation cut at its first ``.``, newline or ``,``, SQuAD normalisation, ``f1`` (HotpotQA's yes/no rule) and
``em`` best over the aliases; ``acc`` is answer presence (a normalised alias as whole words anywhere in the
normalised generation). With ``until_cut`` (the default) a greedy answer ends at the token that reaches the cut, so
``prediction``, ``f1`` and ``em`` equal those of the full-length answer while ``generation`` (and so ``acc``) holds
the answer through its cut only; ``until_cut=False`` generates to ``max_new_tokens`` (or a stop token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from fcprag_plugin.compat import package_version, peft_has_arrow
from fcprag_plugin.errors import FcpragError
from ..lm.batched import ScoreRow, read_prompts, score_rows
from ..lm.metrics import answer_in_text, exact_match, extract_answer, f1_score
from ..lm.prompts import PromptTemplate, answer_ids, render_prompt

ARROW = {"top_k": 3, "router_temperature": 1.0, "rng_seed": 0}


@dataclass
class Row:
    """One question under one method: its prompt (``param`` / ``combine``), its adapters (pids) and their ``w~``.
    ``update``: the row's own adapter instead (a DyPRAG row's composite, :func:`fcprag_tools.translator.
    dyprag_adapter`), scored alone at weight 1; ``pids`` and ``weights`` are then only recorded, and the result
    names it (``update``: its source). ``translator``: the identity of the translator a DyPRAG row's update comes
    from (its export's sha256), recorded with the result: the row is valid for that translator only."""

    qid: str
    name: str
    pids: list[str]
    weights: list[float]
    prompt: str = "param"
    update: Any = None
    translator: str | None = None


def encode(tok: Any, question: str, answers: Sequence[str], passages: Sequence[str] | None = None,
           prompt: str = "param") -> tuple[list[int], list[list[int]]]:
    """The prompt's ids and each gold alias's ids after it (the label builder's prompt for that mode)."""
    rendered = render_prompt(tok, PromptTemplate(), question, passages if prompt == "combine" else None, prompt)
    return list(rendered.ids), [answer_ids(tok, rendered, a) for a in answers]


def stop_ids(model: Any, tok: Any) -> list[int]:
    """eos, ``<|im_end|>`` (when the vocabulary has it) and the generation config's eos."""
    stops = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        stops.add(tok.convert_tokens_to_ids("<|im_end|>"))
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(s for s in stops if isinstance(s, int) and s >= 0)


def result(row_id: str, logprob: float, generation: str | None, answers: Sequence[str],
           extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": row_id, "logprob": round(float(logprob), 6), **extra}
    if generation is not None:
        pred = extract_answer(generation, False, scoring="prag")
        out.update(generation=generation, prediction=pred, f1=round(f1_score(pred, answers), 6),
                   em=exact_match(pred, answers), acc=answer_in_text(generation, answers))
    return out


def score(model: Any, tok: Any, slot: Any, rows: Sequence[Row], questions: dict[str, dict[str, Any]],
          adapters: Callable[[str], Any], *, generate: bool = True, max_new_tokens: int = 16,
          batch_size: int = 16, on_progress: Callable[[float], None] | None = None,
          until_cut: bool = True) -> list[dict[str, Any]]:
    """One result per row (``id`` = ``"<qid>|<name>"``, with its prompt, pids and weights), in row order;
    ``on_progress``: :func:`~fcprag_tools.lm.batched.score_rows`'."""
    enc = {(q, m): encode(tok, questions[q]["question"], questions[q]["answers"],
                          [p["text"] for p in questions[q]["passages"]] if m == "combine" else None, m)
           for q, m in {(r.qid, r.prompt) for r in rows}}
    srows = []
    for r in rows:
        keep = [(r.update, 1.0)] if r.update is not None else \
            [(adapters(p), float(w)) for p, w in zip(r.pids, r.weights) if float(w) != 0.0]
        p_ids, gold = enc[(r.qid, r.prompt)]
        srows.append(ScoreRow(p_ids, gold, [a for a, _ in keep], [w for _, w in keep],
                              gen_prompt_ids=p_ids if generate else None))
    out = score_rows(model, tok, slot, srows, mode="cat", batch_size=batch_size, max_new_tokens=max_new_tokens,
                     stop_ids=stop_ids(model, tok), on_progress=on_progress, until_cut=until_cut)
    return [result(f"{r.qid}|{r.name}", s.logprob, s.generation, questions[r.qid]["answers"],
                   {"prompt": r.prompt, "pids": r.pids, "w": [round(float(w), 6) for w in r.weights],
                    **({} if r.update is None else {"update": str(getattr(r.update, "source", r.update))}),
                    **({} if r.translator is None else {"translator": r.translator})})
            for r, s in zip(rows, out)]


def score_arrow_rows(model: Any, tok: Any, items: Sequence[tuple[str, dict[str, Any], Sequence[str]]],
                     adapters_of: Callable[[str], Any], *, generate: bool = True, max_new_tokens: int = 16,
                     batch_size: int = 16, until_cut: bool = True) -> list[dict[str, Any]]:
    """The Arrow row of many questions at once: ``items`` = ``[(qid, question record, its passage ids)]``, each
    question routed per token over its own passage adapters (``adapters_of(pid)``: a ``LoraAdapter``, or a
    directory) with PEFT's Arrow arithmetic and :data:`ARROW`'s settings (top ``min(3, N)`` adapters by
    ``|x . prototype|``, softmax at temperature 1), in mixed batches of ``batch_size`` sequences like the other
    rows (:mod:`fcprag_tools.lm.arrow`; tested equal to PEFT's own ``create_arrow_model``, which
    :func:`score_arrow` runs one question at a time). One result per item, in order, as :func:`score_arrow` gives
    it (``id`` ``"<qid>|arrow"``, ``w`` None).
    ``model`` must carry no active adapter; nothing stays installed after the call."""
    from fcprag_plugin.adapter import LoraAdapter

    from ..lm.arrow import ArrowSettings, arrow_routing

    settings = ArrowSettings(top_k=ARROW["top_k"], temperature=ARROW["router_temperature"], seed=ARROW["rng_seed"])
    device = next(model.parameters()).device
    loaded: dict[str, Any] = {}

    def adapter(pid: str) -> Any:
        if pid not in loaded:
            a = adapters_of(pid)
            loaded[pid] = a if isinstance(a, LoraAdapter) else LoraAdapter.from_pretrained(a, device=device)
        return loaded[pid]

    srows = []
    for qid, q, pids in items:
        if not pids:
            raise FcpragError(f"question '{qid}': the Arrow row needs at least one passage adapter")
        p_ids, gold = encode(tok, q["question"], q["answers"])
        srows.append(ScoreRow(p_ids, gold, [adapter(p) for p in pids], gen_prompt_ids=p_ids if generate else None))
    out = score_rows(model, tok, None, srows, batch_size=batch_size, max_new_tokens=max_new_tokens,
                     stop_ids=stop_ids(model, tok), mixture=lambda per_seq: arrow_routing(model, per_seq, settings),
                     until_cut=until_cut)
    return [result(f"{qid}|arrow", s.logprob, s.generation, q["answers"],
                   {"prompt": "param", "pids": list(pids), "w": None}) for (qid, q, pids), s in zip(items, out)]


def arrow_status() -> tuple[bool, str]:
    """Whether the installed PEFT has Arrow (``peft.ArrowConfig``, PEFT >= 0.18), and why not."""
    version = package_version("peft")
    if peft_has_arrow():
        return True, f"peft {version}"
    return False, f"peft {version} has no ArrowConfig (PEFT >= 0.18 has it)"


@torch.no_grad()
def score_arrow(model: Any, tok: Any, qid: str, q: dict[str, Any], pids: Sequence[str],
                adapter_dir: Callable[[str], Any], *, generate: bool = True, max_new_tokens: int = 16,
                until_cut: bool = True) -> dict[str, Any]:
    """PEFT's training-free Arrow router over the question's own passage adapters (per token and layer, the top
    ``min(3, N)`` adapters by ``|x . prototype|``, softmax coefficients), scored like the other rows. ``model``
    must carry no active adapter; it is left as it was (``unload()``)."""
    import warnings

    from peft import ArrowConfig, create_arrow_model

    p_ids, gold = encode(tok, q["question"], q["answers"])
    cfg = ArrowConfig(top_k=min(ARROW["top_k"], len(pids)), router_temperature=ARROW["router_temperature"],
                      rng_seed=ARROW["rng_seed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = create_arrow_model(model, [str(adapter_dir(p)) for p in pids], cfg)
    try:
        lps, gens = read_prompts(model, tok, [p_ids], [gold], max_new_tokens=max_new_tokens if generate else 0,
                                 stop_ids=stop_ids(model, tok), until_cut=until_cut)
    finally:
        wrapped.unload()
    return result(f"{qid}|arrow", max(lps[0]), gens[0] if gens else None, q["answers"],
                  {"prompt": "param", "pids": list(pids), "w": None})
