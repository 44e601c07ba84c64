"""Issue 15 section 2: per-passage side features (retrieval rank / score, adapter statistics) and the global
scale kappa: label fields, trainer, FusionController.predict; equal side features change nothing; a side-feature
controller without them is a clear error."""

import json
import math

import pytest
import torch

from fcprag_plugin import ControllerError, FusionController
from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.controller import ControllerConfig
from fcprag_plugin.errors import LabelFileError
from fcprag_plugin.features import ADAPTER_STAT_NAMES, adapter_stats, center_side
from fcprag_plugin.training import build_tensors, evaluate, load_labels, train_controller
from fcprag_plugin.labels import LabelRecord, validate_record
from fcprag_tools.synthetic import record_to_json, synthetic_records, table_encoder, write_labels
from helpers import make_adapter_dir

SIDE = ["retrieval_rank", "retrieval_score"]


def side_controller(side=SIDE, seed=1, **kw):
    return FusionController(ControllerConfig(embed_dim=8, score_hidden=[16, 8], calib_hidden=8, seed=seed,
                                             init="random", side_features=list(side), **kw)).eval()


def test_equal_side_features_change_nothing():
    """A set whose side features are all equal gets exactly the weights of the same controller without side
    features (its score net's side columns removed)."""
    c = side_controller()
    plain = FusionController(ControllerConfig(embed_dim=8, score_hidden=[16, 8], calib_hidden=8, init="random"))
    state = dict(c.state_dict())
    state["score_net.0.weight"] = state["score_net.0.weight"][:, : 4 * 8]
    plain.load_state_dict(state)
    plain.eval()
    g = torch.Generator().manual_seed(0)
    e_q, E_p = torch.randn(4, 8, generator=g), torch.randn(4, 3, 8, generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    equal = torch.randn(4, 1, 2, generator=g).expand(4, 3, 2) * 100  # a different constant per set and column
    padded = equal.clone().masked_fill(~mask.unsqueeze(-1), 7.0)  # padding may hold anything
    ref = plain(e_q, E_p, mask)
    for side in (equal, padded, torch.zeros(4, 3, 2)):
        out = c(e_q, E_p, mask, side)
        for k in ("scores", "g", "tau", "probabilities", "merge_weights"):
            torch.testing.assert_close(getattr(out, k), getattr(ref, k), rtol=1e-6, atol=1e-7)
    # ... while features that differ within a set do change the weights
    varied = torch.randn(4, 3, 2, generator=g)
    assert not torch.allclose(c(e_q, E_p, mask, varied).merge_weights[0], ref.merge_weights[0], atol=1e-4)
    # centering: only within-set differences, divided by the stored scale
    x = center_side(varied, mask, torch.tensor([2.0, 4.0]))
    m0 = varied[1, :2].mean(0)
    torch.testing.assert_close(x[1, :2], (varied[1, :2] - m0) / torch.tensor([2.0, 4.0]))
    assert torch.equal(x[1, 2], torch.zeros(2)) and torch.equal(x[2], torch.zeros(3, 2))


def test_a_side_feature_controller_without_them_is_a_clear_error(encoder16):
    c = FusionController(ControllerConfig(embed_dim=16, score_hidden=[8], calib_hidden=8, init="random",
                                          side_features=["retrieval_score", "adapter_stats"]))
    with pytest.raises(ControllerError, match=r"trained with side features \['retrieval_score', 'adapter_stats'\]"):
        c(torch.randn(1, 16), torch.randn(1, 2, 16))
    with pytest.raises(ControllerError, match=r"pass adapter_stats= \(one value per passage\)"):
        c.predict("q", ["a", "b"], encoder16)  # the retrieval score is optional (hosts lack it): not named
    with pytest.raises(ControllerError, match=r"pass adapter_stats="):
        c.predict("q", ["a", "b"], encoder16, retrieval_scores=[1.0, 2.0])
    with pytest.raises(ControllerError, match=r"retrieval_scores= has 3 values for 2 passages"):
        c.predict("q", ["a", "b"], encoder16, retrieval_scores=[1.0, 2.0, 3.0], adapter_stats=[[0.0] * 6] * 2)
    with pytest.raises(ControllerError, match=r"side features have shape \[1, 2, 3\], expected \[1, 2, 7\]"):
        c(torch.randn(1, 16), torch.randn(1, 2, 16), side=torch.zeros(1, 2, 3))
    # a controller without side features ignores them (the paper's features are the default)
    plain = FusionController(embed_dim=16, score_hidden=[8], calib_hidden=8, init="random").eval()
    a = plain.predict("q", ["a", "b"], encoder16)
    b = plain.predict("q", ["a", "b"], encoder16, retrieval_scores=[5.0, 1.0])
    assert torch.equal(a.merge_weights, b.merge_weights)


def test_adapter_stats_against_dense_updates(tmp_path):
    ad = LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / "a", r=2, alpha=32, seed=3))
    st = adapter_stats(ad)
    assert list(st) == list(ADAPTER_STAT_NAMES)
    dense = {g: 0.0 for g in ("gate_proj", "up_proj", "down_proj")}
    for name, m in ad.modules.items():
        dense[name.rsplit(".", 1)[-1]] += float(torch.linalg.norm(m.delta(torch.float64)))  # formed here only
    for g, v in dense.items():
        assert st[f"log_norm_{g}"] == pytest.approx(math.log(v + 1e-8), rel=1e-5)
    assert st["log_norm_all"] == pytest.approx(math.log(sum(dense.values()) + 1e-8), rel=1e-5)
    assert st["rank"] == 2 and st["scaling"] == pytest.approx(16.0)


def test_predict_takes_adapters_or_their_statistics(tmp_path, encoder16):
    ads = [LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"a{i}", seed=i)) for i in range(3)]
    c = FusionController(ControllerConfig(embed_dim=16, score_hidden=[8], calib_hidden=8, init="random",
                                          side_features=["adapter_stats", "retrieval_rank"]))
    ps = ["p one", "p two", "p three"]
    a = c.predict("q", ps, encoder16, adapter_stats=ads, retrieval_ranks=[0, 1, 2])
    b = c.predict("q", ps, encoder16, adapter_stats=[adapter_stats(x) for x in ads], retrieval_ranks=[0, 1, 2])
    d = c.predict("q", ps, encoder16, adapter_stats=[list(adapter_stats(x).values()) for x in ads],
                  retrieval_ranks=torch.tensor([0, 1, 2]))
    assert torch.equal(a.merge_weights, b.merge_weights) and torch.equal(a.merge_weights, d.merge_weights)
    with pytest.raises(ControllerError, match=r"adapter_stats=: expected a LoraAdapter, a dict with keys"):
        c.predict("q", ps, encoder16, adapter_stats=[{"rank": 2}] * 3, retrieval_ranks=[0, 1, 2])
    with pytest.raises(ControllerError, match=r"adapter_stats=: expected .* a list of 6 numbers per passage"):
        c.predict("q", ps, encoder16, adapter_stats=[[0.0] * 6, [0.0] * 6, [0.0]], retrieval_ranks=[0, 1, 2])


def test_label_fields_parse_round_trip_and_errors(tmp_path):
    st = dict(zip(ADAPTER_STAT_NAMES, [0.1, 0.2, 0.3, 0.4, 2.0, 16.0]))
    obj = {"id": "a", "query": "q", "passages": ["x", "y"], "deltas": [0.1, 0.0], "retrieval_ranks": [0, 1],
           "retrieval_scores": [12.5, 3.0], "adapter_stats": [st, st]}
    rec = validate_record(obj)
    assert rec.retrieval_ranks == [0, 1] and rec.retrieval_scores == [12.5, 3.0] and rec.adapter_stats == [st, st]
    assert validate_record(record_to_json(rec)) == rec
    write_labels([rec], tmp_path / "l.jsonl")
    assert load_labels(tmp_path / "l.jsonl").records[0].adapter_stats == [st, st]
    for bad, msg in (({"retrieval_ranks": [0]}, r"field 'retrieval_ranks'"),
                     ({"retrieval_scores": [1.0, float("nan")]}, r"field 'retrieval_scores\[1\]'"),
                     ({"adapter_stats": [st]}, r"field 'adapter_stats': is 1 entries, expected a list of 2"),
                     ({"adapter_stats": [st, {"rank": 2}]}, r"field 'adapter_stats\[1\]': lacks key\(s\)")):
        (tmp_path / "bad.jsonl").write_text(json.dumps({**obj, **bad}) + "\n")
        with pytest.raises(LabelFileError, match=r"bad.jsonl:1: " + msg):
            load_labels(tmp_path / "bad.jsonl")


def ranked_records(n, seed, with_ranks=True):
    """Noise embeddings; the best passage (largest delta) is the one retrieved first: only the rank tells."""
    recs, table = synthetic_records(n, 3, 8, kind="noise", noise=0.02, seed=seed, groups=n // 2)
    out = []
    for r in recs:
        d = list(r.deltas)
        best = max(range(3), key=lambda i: d[i])
        d[best] += 0.3
        order = sorted(range(3), key=lambda i: -d[i])
        ranks = [float(order.index(i)) for i in range(3)]
        out.append(LabelRecord(id=r.id, query=r.query, passages=r.passages, deltas=d, group=r.group,
                               retrieval_ranks=ranks if with_ranks else None))
    return out, table


def test_trainer_learns_from_a_side_feature_and_predict_needs_it(tmp_path):
    recs, table = ranked_records(200, 1)
    enc = table_encoder(table, "syn8")
    kw = dict(encoder=enc, cache_dir=tmp_path / "cache", epochs=6, lr=3e-3, progress=False,
              precision="fp32", threads=1, controller={"score_hidden": [32], "calib_hidden": 16}, cv_folds=3)
    res = train_controller(recs, tmp_path / "side", side_features=["retrieval_rank"], keep_network=True, **kw)
    plain = train_controller(recs, tmp_path / "plain", keep_network=True, **kw)  # its network, to compare
    held, held_table = ranked_records(40, 2)  # questions neither controller saw
    data = build_tensors(held, table_encoder(held_table, "syn8"), side_features=["retrieval_rank"])
    v, p = (evaluate(r.controller, data)[0]["learned"] for r in (res, plain))
    assert v["top1"] >= 0.8 and v["top1"] > p["top1"] + 0.3, (v["top1"], p["top1"])
    assert res.metrics["cv"]["verdict"] == "better_than_uniform"
    cfg = json.loads((tmp_path / "side" / "config.json").read_text())
    assert cfg["side_features"] == ["retrieval_rank"] and len(cfg["side_scale"]) == 1 and cfg["side_scale"][0] > 0
    c = FusionController.from_pretrained(tmp_path / "side")
    r = recs[0]
    same = c.predict(r.query, r.passages, enc, retrieval_ranks=[2.0] * len(r.passages)).merge_weights
    assert torch.equal(c.predict(r.query, r.passages, enc).merge_weights, same)  # none given: equal for all
    w = c.predict(r.query, r.passages, enc, retrieval_ranks=r.retrieval_ranks).merge_weights[0]
    assert int(w.argmax()) == r.retrieval_ranks.index(0.0)
    # a record without the field is an error naming its line and the field
    bad = [LabelRecord(id=f"x{r.id}", query=r.query, passages=r.passages, deltas=r.deltas) for r in recs[30:40]]
    write_labels(recs[:30] + bad, tmp_path / "mixed.jsonl")
    with pytest.raises(LabelFileError, match=r"mixed.jsonl:31: field 'retrieval_ranks' is missing"):
        train_controller(tmp_path / "mixed.jsonl", tmp_path / "x", side_features=["retrieval_rank"], **kw)


def test_kappa_scales_the_merge_weights_and_is_saved(tmp_path):
    base = side_controller(side=[], seed=4)
    scaled = FusionController(ControllerConfig(**{**base.config.__dict__, "kappa": 1.7})).eval()
    scaled.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(5)
    e_q, E_p = torch.randn(3, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    a, b = base(e_q, E_p), scaled(e_q, E_p)
    torch.testing.assert_close(b.merge_weights, 1.7 * a.merge_weights)
    assert torch.equal(a.probabilities, b.probabilities) and a.scale is None
    assert torch.equal(b.scale, torch.full((3,), 1.7))
    scaled.save_pretrained(tmp_path / "k")
    again = FusionController.from_pretrained(tmp_path / "k")
    assert again.config.kappa == 1.7 and torch.equal(again(e_q, E_p).merge_weights, b.merge_weights)
    u = FusionController.uniform(8, kappa=2.0)
    assert torch.equal(u(e_q, E_p).merge_weights, torch.full((3, 4), 2.0))
    with pytest.raises(ControllerError, match=r"key 'kappa' is 0"):
        ControllerConfig(kappa=0).validate()
