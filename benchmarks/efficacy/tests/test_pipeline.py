"""The efficacy study's grid and evaluation stages end to end on a tiny model, tiny adapters and a toy cache."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import hash_encoder, make_adapter_dir, tiny_model, tiny_tokenizer

import common
import evaluate
import grid

WORDS = "paris berlin rome france germany italy river seine tower bridge king queen".split()


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    from fcprag_plugin import FusionController

    monkeypatch.setattr(common, "HERE", tmp_path)
    model = tiny_model("llama", seed=5, bos_token_id=2, eos_token_id=3, pad_token_id=0).eval()
    tok = tiny_tokenizer()
    tok.chat_template = None
    for mod in (grid, evaluate):
        monkeypatch.setattr(mod, "load_model", lambda dtype="bfloat16": (model, tok))
    import fcprag_plugin.encoding as enc_mod

    encoder = hash_encoder(16)
    monkeypatch.setattr(enc_mod, "TextEncoder", lambda *a, **k: encoder)
    rows = []
    for q in range(6):
        ps = []
        for k in range(3):
            text = f"{WORDS[(q + k) % 12]} is a {WORDS[(q * 3 + k) % 12]} ."
            pid = f"p{q}{k}"
            make_adapter_dir(common.work_dir("toy") / "adapters" / pid, seed=10 * q + k)
            ps.append({"pid": pid, "text": text, "title": pid, "supporting": k == 0})
        rows.append({"id": f"q{q}", "split": "train" if q < 3 else "test", "question": f"what is {WORDS[q]} ?",
                     "answer": [WORDS[q]], "passages": ps})
    common.write_jsonl(common.cache_dir("toy") / "retrieval.jsonl", rows)
    ctrl = FusionController.random(embed_dim=16, seed=3, embedding_model="hash-16")
    ctrl.save_pretrained(common.work_dir("toy") / "controllers" / "f1")
    return model


def test_grid_then_evaluate_then_analyse(toy):
    snapshot = {k: v.clone() for k, v in toy.state_dict().items()}
    grid.run("toy", None)
    g = json.loads((common.cache_dir("toy") / "grid.json").read_text())
    assert len(g["points"]) == 25 and g["points"][0]["g"] == 0.0
    assert g["best"]["mean_logprob"] == max(p["mean_logprob"] for p in g["points"])
    evaluate.run("toy", None)
    rows = common.read_jsonl(common.cache_dir("toy") / "eval.jsonl")
    by = {(r["id"], r["condition"], r["mode"], r["method"]): r for r in rows}
    methods = {"prag_sum", "average", "random", "fixed", "learned:f1", "oracle:logprob", "oracle:f1"}
    for q in ("q3", "q4", "q5"):
        for cond in evaluate.CONDITIONS:
            for mode in evaluate.MODES:
                n = 4 if cond == "repeat" else 3
                got = {m for (i, c, mo, m) in by if (i, c, mo) == (q, cond, mode)}
                assert got == methods | {f"loo:{i}" for i in range(n)}
                full = by[(q, cond, mode, "prag_sum")]
                assert full["w_tilde"] == [1.0] * n and full["n"] == n
                oracle = by[(q, cond, mode, "oracle:logprob")]
                deltas = torch.tensor([full["logprob"] - by[(q, cond, mode, f"loo:{i}")]["logprob"] for i in range(n)])
                ref = n * torch.softmax(deltas / 0.1, 0)
                assert oracle["w_tilde"] == pytest.approx(ref.tolist(), abs=2e-4)
                assert sum(by[(q, cond, mode, "learned:f1")]["w_tilde"]) == pytest.approx(n, abs=1e-3)
        # the replaced passage is a distractor; the repeat duplicates one passage's support flag
        rep = by[(q, "replace", "param", "prag_sum")]
        assert rep["supporting"][rep["replaced_position"]] == 0.0
    # a mixed batch row equals a single-row run of the same weights (rows do not leak into each other)
    r = by[("q3", "clean", "param", "average")]
    data = {x["id"]: x for x in common.read_jsonl(common.cache_dir("toy") / "retrieval.jsonl")}["q3"]
    from fusion_eval import AdapterCache, FusionScorer

    cache = AdapterCache(common.work_dir("toy") / "adapters")
    sc = FusionScorer(toy, tiny_tokenizer(), cache.get("p30"))
    sc.tok.chat_template = None
    one = sc.score(data["question"], [p["text"] for p in data["passages"]], data["answer"], "param",
                   [cache.get(p["pid"]) for p in data["passages"]], torch.tensor([r["w_tilde"]]))[0]
    sc.slot.remove()
    assert one.logprob == pytest.approx(r["logprob"], abs=1e-4) and one.prediction == r["prediction"]
    for k, v in toy.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
    cells: dict = {}
    for r in common.read_jsonl(common.cache_dir("toy") / "eval.jsonl"):
        cells.setdefault((r["condition"], r["mode"], r["method"]), set()).add(r["id"])
    assert len(set.intersection(*cells.values())) == 3  # every test question has every method, condition, prompt
    assert any(m == "learned:f1" for (_, _, m) in cells)
    evaluate.run("toy", None)  # resumable: nothing left to do, nothing appended
    assert len(common.read_jsonl(common.cache_dir("toy") / "eval.jsonl")) == len(rows)
