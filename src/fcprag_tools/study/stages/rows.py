"""The rows the evaluation scores for one question: ``{row name: (prompt, w~ per passage)}`` (see
:mod:`..summary` for what each row measures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fcprag_plugin.weights import is_uniform
from ..ceiling import gold_rows
from ..dyprag import gold_name
from ..summary import suffix

Rows = dict[str, tuple[str, list[float]]]  # {row name: (prompt setting, w~ per passage)}


def query_encoder(encoder: Any) -> Any:
    """``--encoder`` as an encoder object (a name or path is loaded once); None: the controller's own model."""
    if isinstance(encoder, (str, Path)):
        from fcprag_plugin.encoding import get_encoder

        return get_encoder(encoder)  # cached by the library: loaded once per process
    return encoder


def weights(q: dict[str, Any], ctrl: Any, encoder: Any, adapter: Callable[[str], Any]) -> list[float]:
    """``ctrl``'s ``w~`` for question ``q`` (its retrieval ranks and scores, its adapters by ``adapter(pid)`` when
    it reads them); ``encoder``: ``--encoder``."""
    from fcprag_plugin.weights import weigh

    ps = q["passages"]
    with torch.no_grad():
        return [float(x) for x in weigh(ctrl, q["question"], [p["text"] for p in ps], encoder=query_encoder(encoder),
                                        adapters=lambda: [adapter(p["pid"]) for p in ps],
                                        retrieval_ranks=[float(p["rank"]) for p in ps],
                                        retrieval_scores=[float(p["score"]) for p in ps]).merge_weights]


def held_out_rows(q: dict[str, Any], ctrls: dict[str, Any], scales: Sequence[float], encoder: Any,
                  adapter: Callable[[str], Any]) -> Rows:
    """The rows of one held-out question before any verdict (all but the oracle, Arrow and the rows that depend on
    what ships). ``ctrls``: each setting's controller; ``scales``: ``--scales``."""
    n = len(q["passages"])
    rows: Rows = {"vanilla": ("param", [0.0] * n), "standard_rag": ("combine", [0.0] * n)}
    for setting, ctrl in ctrls.items():
        sfx, kappa = suffix(setting), float(ctrl.config.kappa)
        rows["prag_sum" + sfx] = (setting, [1.0] * n)
        if setting == "param":  # the parametric setting's descriptive rows
            rows["average"] = (setting, [1.0 / n] * n)
            for s in sorted({*scales, kappa} - {1.0}):
                rows[f"scale:{s:g}"] = (setting, [float(s)] * n)
            for i in range(n):
                rows[f"loo:{i}"] = (setting, [0.0 if j == i else 1.0 for j in range(n)])
        elif kappa != 1.0:  # the Combine setting's scale part
            rows[f"scale:{kappa:g}{sfx}"] = (setting, [kappa] * n)
        if not is_uniform(ctrl):
            w = weights(q, ctrl, encoder, adapter)
            rows["learned" + sfx], rows["learned_same_total" + sfx] = (setting, w), (setting, [sum(w) / n] * n)
    rows.update(gold_rows(q, list(ctrls)))  # the gold-passage ceiling (absent without supporting titles)
    return rows


def random_rows(q: dict[str, Any], ships: dict[str, Any], encoder: Any, adapter: Callable[[str], Any]) -> Rows:
    """The paper's ablation: an untrained controller (seed 0) at each setting's recommended kappa."""
    from fcprag_plugin import FusionController

    out = {}
    for s, ship in ships.items():
        cfg = ship.config
        rnd = FusionController(embed_dim=cfg.embed_dim, embedding_model=cfg.embedding_model,
                               controller_mode="random", seed=0, kappa=float(cfg.kappa)).eval()
        out["random_controller" + suffix(s)] = (s, weights(q, rnd, encoder, adapter))
    return out


def candidate_rows(q: dict[str, Any], ships: dict[str, Any], verdicts: dict[str, Any], encoder: Any,
                   adapter: Callable[[str], Any]) -> Rows:
    """The candidates of "what to run" on one training question: no adapter (two prompts), PRAG's sum and what
    ships in each setting (under the name of the held-out row it equals)."""
    n = len(q["passages"])
    rows = {"vanilla": ("param", [0.0] * n), "standard_rag": ("combine", [0.0] * n)}
    for s, ship in ships.items():
        rows["prag_sum" + suffix(s)] = (s, [1.0] * n)
        rows[verdicts[s]["recommended_row"]] = (s, weights(q, ship, encoder, adapter))
    return rows


def dyprag_rows(q: dict[str, Any], settings: Sequence[str]) -> Rows:
    """The DyPRAG rows of one question before any verdict: DyPRAG's rule (``u = 1/N``) with the question alone
    (``dyprag``) and with the passages in the prompt (``dyprag_combine``); held out also the gold-passage ceiling
    over the translator's updates (the PRAG ceiling's ``w~``: ``u = 1/k`` on the ``k`` supporting passages)."""
    n = len(q["passages"])
    rows: Rows = {"dyprag": ("param", [1.0] * n), "dyprag_combine": ("combine", [1.0] * n)}
    if q.get("split") == "test":
        rows.update({gold_name(name): spec for name, spec in gold_rows(q, settings).items()})
    return rows


def dyprag_fusion_rows(q: dict[str, Any], ships: dict[str, Any], encoder: Any, adapter: Callable[[str], Any]
                       ) -> Rows:
    """The fusion over the translator's updates with what ships in each setting (``dyprag_recommended{,_combine}``:
    ``u = w~/N`` of that setting's shipped controller, weighing the generated updates ``adapter(pid)`` as the
    DyPRAG shim does)."""
    return {"dyprag_recommended" + suffix(s): (s, weights(q, ship, encoder, adapter)) for s, ship in ships.items()}


def dyprag_later_rows(q: dict[str, Any], ships: dict[str, Any], encoder: Any, adapter: Callable[[str], Any]
                      ) -> Rows:
    """The DyPRAG rows scored after the verdict: the fusions with what ships; on a training question also DyPRAG's
    own rows, all four the candidates of "what to run" there."""
    rows = dyprag_rows(q, list(ships)) if q.get("split") == "train" else {}
    return {**rows, **dyprag_fusion_rows(q, ships, encoder, adapter)}


def oracle(done: dict[str, dict[str, Any]], qid: str, n: int) -> list[float]:
    """``w~ = N softmax(delta / T)`` (``T``: the trainer's label temperature) from this question's own
    ``prag_sum`` and ``loo:i`` log-liks. (it reads the answer: a reference, not a method)."""
    from fcprag_plugin.training import TrainArgs

    full = done[f"{qid}|prag_sum"]["logprob"]
    deltas = torch.tensor([full - done[f"{qid}|loo:{i}"]["logprob"] for i in range(n)])
    return [round(float(x), 6) for x in n * torch.softmax(deltas / TrainArgs().t_label, 0)]
