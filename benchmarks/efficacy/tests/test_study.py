"""The two-dataset efficacy study's logic: the split, the adapter order, resuming, and the label subsets."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from helpers import tiny_model, tiny_tokenizer
import adapters
import common
import prepare

EFF = Path(__file__).resolve().parent.parent  # benchmarks/efficacy

P0, P1, P2 = "00c0ffee", "10c0ffee", "20c0ffee"  # passage ids are hex (the seed is read from them)
WORDS = "paris berlin rome france germany italy river seine tower bridge king queen".split()


def _data_file(path: Path, n: int) -> Path:
    """``n`` questions in the ``../shared/data`` schema, 10 passages each (distinct texts)."""
    with open(path, "w", encoding="utf-8") as f:
        for q in range(n):
            passages = [f"{WORDS[(q + k) % 12]} is near {WORDS[(q * 5 + k) % 12]} number {q}-{k} ." for k in range(10)]
            f.write(json.dumps({"id": f"q{q}", "question": f"where is {WORDS[q % 12]} {q} ?", "answer": WORDS[q % 12],
                                "passages": passages, "titles": [f"t{q}-{k}" for k in range(10)],
                                "supporting_titles": [f"t{q}-0", f"t{q}-1"]}) + "\n")
    return path


@pytest.mark.parametrize("name,n", [("hotpotqa", 40), ("2wiki", 23)])
def test_split_is_by_question_with_the_asked_test_fraction(tmp_path, name, n):
    rows = prepare.retrieval(_data_file(tmp_path / f"{name}.jsonl", n), tmp_path / "r.jsonl", 0.4, 6, dataset=name)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(f"q{q}" for q in range(n))  # every question once: its passages go with it
    test = [r for r in rows if r["split"] == "test"]
    assert len(test) == round(0.4 * n)
    assert all(len(r["passages"]) == 6 and [p["rank"] for p in r["passages"]] == list(range(6)) for r in rows)
    if name == "hotpotqa":  # the demo's questions are always held out
        assert {"q0", "q1", "q2"} <= {r["id"] for r in test}
    again = prepare.retrieval(_data_file(tmp_path / f"{name}.jsonl", n), tmp_path / "r2.jsonl", 0.4, 6, dataset=name)
    assert [r["split"] for r in again] == [r["split"] for r in rows]  # seeded: the same split every time


@pytest.mark.parametrize("ds", ["hotpotqa", "2wiki"])
def test_committed_split_holds_every_question_once_and_at_least_35_percent_in_test(ds):
    path = EFF / "cache" / ds / "retrieval.jsonl"
    rows = common.read_jsonl(path)
    data = common.read_jsonl(common.DATASETS[ds]) if common.DATASETS[ds].is_file() else None
    if data is not None:
        assert [r["id"] for r in rows] == [d["id"] for d in data]  # all questions, file order
    test = {r["question"] for r in rows if r["split"] == "test"}
    train = {r["question"] for r in rows if r["split"] == "train"}
    assert not test & train  # no question (by text) on both sides
    assert len(test) / len(rows) >= 0.35
    aug = {a["pid"] for a in common.read_jsonl(EFF / "cache" / ds / "augment.jsonl")}
    assert {p["pid"] for r in rows for p in r["passages"]} <= aug
    assert all(len(r["passages"]) == 6 for r in rows)


def _rows(ds: str, n: int, k: int = 6) -> list[dict]:
    return [{"id": f"{ds}{q}", "split": "test" if q % 2 else "train",
             "passages": [{"pid": f"{ds}-{q}-{i}"} for i in range(k)]} for q in range(n)]


def test_study_order_puts_test_top3_then_train_then_the_rest_and_covers_everything_once():
    retrieval = {"a": _rows("a", 5), "b": _rows("b", 3)}
    order = adapters.study_order(retrieval, top=3)
    every = {(ds, p["pid"]) for ds, rows in retrieval.items() for r in rows for p in r["passages"]}
    assert len(order) == len(set(order)) == len(every) and set(order) == every
    tier = {}
    for ds, rows in retrieval.items():
        for r in rows:
            for i, p in enumerate(r["passages"]):
                tier[(ds, p["pid"])] = 0 if (r["split"] == "test" and i < 3) else 1 if r["split"] == "train" else 2
    assert [tier[it] for it in order] == sorted(tier[it] for it in order)
    first = order[:6]  # datasets take turns question by question: a's first test question, then b's
    assert first == [("a", "a-1-0"), ("a", "a-1-1"), ("a", "a-1-2"), ("b", "b-1-0"), ("b", "b-1-1"), ("b", "b-1-2")]


def test_a_passage_shared_by_two_questions_is_trained_once():
    rows = _rows("a", 2)
    rows[1]["passages"][0] = dict(rows[0]["passages"][4])
    order = adapters.study_order({"a": rows})
    assert len(order) == len(set(order)) == 11


def test_groups_keep_the_order_at_block_granularity_and_sort_within_blocks():
    items = [("a", f"p{i}") for i in range(10)]
    lengths = {it: 10 - i for i, it in enumerate(items)}
    groups = adapters.make_groups(items, lengths, group=2, block=4)
    flat = [it for g in groups for it in g]
    assert sorted(flat) == sorted(items) and all(len(g) <= 2 for g in groups)
    assert flat[:4] == [("a", "p3"), ("a", "p2"), ("a", "p1"), ("a", "p0")]  # block 1, shortest first
    assert {it[1] for it in flat[4:8]} == {"p4", "p5", "p6", "p7"}


@pytest.fixture()
def tiny_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "HERE", tmp_path)
    model = tiny_model("llama", seed=5, bos_token_id=2, eos_token_id=3, pad_token_id=0).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = tiny_tokenizer()
    tok.chat_template = None
    augs = {"a": {}}
    for i in range(3):
        text = f"{WORDS[i]} is a {WORDS[i + 3]} near the {WORDS[i + 6]} ."
        augs["a"][f"{i}0c0ffee"] = {"pid": f"{i}0c0ffee", "passage": text, "rewrite": None,
                              "qa_pairs": [{"question": f"what is {WORDS[i]} ?", "answer": WORDS[i + 3]}]}
    return model, tok, augs


def test_build_saves_and_logs_each_group_and_a_restart_skips_what_is_done(tiny_stage):
    from fcprag_plugin import LoraAdapter

    model, tok, augs = tiny_stage
    items = [("a", P0), ("a", P1), ("a", P2)]
    assert adapters.done_adapters("a") == set()
    adapters.build(items[:2], augs, 2, 2, 1, 32, model=model, tok=tok)
    assert adapters.done_adapters("a") == {P0, P1}
    log = common.read_jsonl(common.cache_dir("a") / "adapters.jsonl")
    assert [r["pid"] for r in log] == [P0, P1] and all(r["steps"] == 2 for r in log)
    ad = LoraAdapter.from_pretrained(common.work_dir("a") / "adapters" / P0)
    assert any(float(m.B.abs().max()) > 0 for m in ad.modules.values())
    # an adapter written but never logged (a kill between the two) is not done: a restart redoes it
    adapters.build([items[2]], augs, 1, 1, 1, 32, model=model, tok=tok, save=False)
    (common.work_dir("a") / "adapters" / P2).mkdir(parents=True)
    (common.work_dir("a") / "adapters" / P2 / "adapter_model.safetensors").write_bytes(b"partial")
    assert adapters.done_adapters("a") == {P0, P1}
    # a logged adapter whose files are gone is not done either
    (common.work_dir("a") / "adapters" / P1 / "adapter_model.safetensors").unlink()
    assert adapters.done_adapters("a") == {P0}


def test_an_adapter_does_not_depend_on_its_group(tiny_stage):
    """The seed follows the passage: trained alone or in a group, an adapter comes out the same."""
    model, tok, augs = tiny_stage
    items = [("a", P0), ("a", P1), ("a", P2)]
    together = adapters.build(items, augs, 3, 3, 1, 32, model=model, tok=tok, save=False)
    alone = [adapters.build([it], augs, 1, 1, 1, 32, model=model, tok=tok, save=False)[0] for it in items]
    by = {r["pid"]: r for r in together}
    for r in alone:
        assert by[r["pid"]]["seed"] == r["seed"]
        for key, v in r["norm"].items():
            assert by[r["pid"]]["norm"][key] == pytest.approx(v, rel=1e-3)
        assert by[r["pid"]]["loss_after"]["passage"] == pytest.approx(r["loss_after"]["passage"], abs=1e-3)


def test_label_job_enumerates_every_triple_and_pair_of_the_top6():
    import jobs

    r = {"id": "q0", "dataset": "t", "split": "train", "question": "question 0", "answer": ["x"],
         "passages": [{"pid": f"0-{i}", "text": f"passage 0 {i}", "bm25": 10.0 - i} for i in range(6)]}
    j = jobs.label_job(r)
    assert j["key"] == "t|q0|train|param" and j["pids"] == [f"0-{i}" for i in range(6)]
    triples = {jobs.subset_name(c) for c in itertools.combinations(range(6), 3)}
    pairs = {jobs.subset_name(c) for c in itertools.combinations(range(6), 2)}
    assert set(j["rows"]) == triples | pairs and len(triples) == 20 and len(pairs) == 15
    for c in itertools.combinations(range(6), 3):  # every triple's leave-one-out rows are there
        assert all(jobs.subset_name([x for x in c if x != i]) in j["rows"] for i in c)
        assert j["rows"][jobs.subset_name(c)] == [1.0 if i in c else 0.0 for i in range(6)]
    dup = dict(r, passages=r["passages"][:5] + [dict(r["passages"][0])])
    assert jobs.label_job(dup) is None  # a repeated passage would make the subset labels ambiguous


def test_fixed_rows_are_the_grid_points_with_their_defining_properties():
    import jobs

    g = torch.Generator().manual_seed(0)
    q, P = torch.randn(16, generator=g), torch.randn(3, 16, generator=g)
    rows = jobs.fixed_rows(q, P, [9.0, 5.0, 1.0], 16, "random-16")
    assert len(rows) == len(jobs.KAPPAS) + len(jobs.GRID_G) * len(jobs.GRID_TAU) + len(jobs.BM25_TAU)
    assert rows["kappa:0.5"] == [0.5] * 3
    for t in jobs.BM25_TAU:  # N softmax: sums to N, ordered like the BM25 scores
        w = rows[f"bm25:{t}"]
        assert sum(w) == pytest.approx(3.0) and w[0] > w[1] > w[2]
    assert all(sum(rows[f"cos:{a}:{b}"]) == pytest.approx(3.0, abs=1e-4) for a in jobs.GRID_G for b in jobs.GRID_TAU)


def _question(ds: str = "t", qid: str = "q0", split: str = "train") -> dict:
    ps = [{"pid": f"{qid}-{i}", "text": f"passage {qid} {i}", "bm25": 9.0 - i, "rank": i, "supporting": i < 2}
          for i in range(6)]
    return {"id": qid, "dataset": ds, "split": split, "question": f"question {qid}", "answer": ["x"], "passages": ps}


def test_label_records_are_leave_one_out_deltas_of_every_triple_grouped_by_question(tmp_path):
    import jobs

    r = _question()
    g = torch.Generator().manual_seed(1)
    res = {name: float(torch.randn(1, generator=g)) for name in jobs.label_rows()}
    recs = jobs.label_records(r, res)
    assert len(recs) == 20 and len({x["id"] for x in recs}) == 20
    assert {x["group"] for x in recs} == {"t:q0"}
    for x in recs:
        idx = [int(c) for c in x["id"].split(":s:")[1]]
        assert x["passages"] == [r["passages"][i]["text"] for i in idx]
        assert x["metric_all"] == res["s:" + "".join(map(str, idx))]
        for k, i in enumerate(idx):  # delta_i = metric(subset) - metric(subset without passage i)
            rest = "s:" + "".join(str(j) for j in idx if j != i)
            assert x["deltas"][k] == pytest.approx(res["s:" + "".join(map(str, idx))] - res[rest], abs=1e-6)
        assert x["retrieval_ranks"] == idx and x["retrieval_scores"] == [9.0 - i for i in idx]
    from fcprag_plugin.training.labels import load_labels  # the trainer reads them as written

    common.write_jsonl(tmp_path / "labels.jsonl", recs)
    assert len(load_labels(str(tmp_path / "labels.jsonl"))) == 20


def test_pending_label_jobs_skip_scored_questions_and_wait_for_adapters():
    import jobs
    import study

    qs = [_question(qid=f"q{i}") for i in range(3)]
    rows = jobs.label_rows()
    done_res = {"t": {"t|q0|train|param": dict.fromkeys(rows, 0.0),  # q0 fully scored
                      "t|q1|train|param": dict.fromkeys(list(rows)[:5], 0.0)}}  # q1 half scored: redone
    done_ad = {"t": {p["pid"] for q in qs[:2] for p in q["passages"]} | {"q2-0"}}  # q2 lacks 5 adapters
    todo, waiting = study.pending_label_jobs(qs, done_res, done_ad)
    assert [j["key"] for j in todo] == ["t|q1|train|param"] and waiting == 1


@pytest.mark.slow
def test_score_jobs_equal_each_row_scored_alone(tmp_path):
    """The study's scoring entry point (whichever scorer it uses) against the library's reference path: the
    merged adapter activated by hooks and the label builder's answer log-likelihood."""
    import scoring
    from batch_scorer import Job
    from fcprag_plugin import LoraAdapter, WeightedAdapterMerger
    from fcprag_tools.label_builder.metrics import answer_logprob
    from fcprag_plugin import activate

    from helpers import make_adapter_dir

    model = tiny_model("llama", seed=3, bos_token_id=2, eos_token_id=3, pad_token_id=0).eval()
    tok = tiny_tokenizer()
    tok.chat_template = None
    store = {f"p{i}": LoraAdapter.from_pretrained(make_adapter_dir(tmp_path / f"a{i}", seed=i)) for i in range(4)}
    jobs_ = [Job("a", "what is the capital of france ?", ["paris", "the paris"], [], "param", ["p0", "p1", "p2"],
                 {"s:012": [1.0, 1.0, 1.0], "s:01": [1.0, 1.0, 0.0], "w": [0.2, 2.5, 0.3], "zero": [0.0] * 3}),
             Job("b", "where is rome ?", ["italy"], [], "param", ["p3", "p1"], {"s:01": [1.0, 1.0], "x": [3.0, 0.5]})]
    for j in jobs_:
        j.encode(tok)
    slot = scoring.make_slot(model, store, max_adapters=4)
    got = scoring.score_jobs(model, tok, slot, jobs_, store, batch_size=3, max_tokens=200)
    slot.remove()
    assert [(g["key"], g["name"]) for g in got] == [(j.key, n) for j in jobs_ for n in j.rows]
    k = 0
    for j in jobs_:
        for name, w in j.rows.items():
            ref = -float("inf")
            for gold in j.gold:
                if any(w):
                    merged = WeightedAdapterMerger("cat").merge([store[p] for p in j.pids], w).adapter
                    with activate(model, merged):
                        ref = max(ref, answer_logprob(model, j.prompt_ids, gold))
                else:
                    ref = max(ref, answer_logprob(model, j.prompt_ids, gold))
            assert got[k]["logprob"] == pytest.approx(ref, abs=1e-4), (j.key, name)
            k += 1
    assert len({round(g["logprob"], 3) for g in got}) > 3  # the rows really differ


def test_summary_means_and_paired_differences_against_prag_sum():
    import heldout

    g = torch.Generator().manual_seed(2)
    base = torch.randn(60, generator=g)
    gain = 0.3 + 0.1 * torch.randn(60, generator=g)
    table = {f"q{i}": {"prag_sum": float(base[i]), "learned": float(base[i] + gain[i]), "loo:0": 0.0}
             for i in range(60)}
    table["partial"] = {"prag_sum": 5.0}  # a question without every method is left out
    s = heldout.summarise(table)
    assert s["n_questions"] == 60 and set(s["methods"]) == {"prag_sum", "learned"}
    assert s["methods"]["prag_sum"]["gold_loglik"] == pytest.approx(float(base.mean()), abs=1e-6)
    d = s["paired"]["learned"]
    assert d["delta_loglik"] == pytest.approx(float(gain.mean()), abs=1e-6)
    lo, hi = d["ci95"]
    assert lo < d["delta_loglik"] < hi and hi - lo < 0.1  # the paired CI is narrow: the base variation cancels


def test_oracle_job_weights_follow_the_leave_one_out_deltas():
    import heldout
    from batch_scorer import Job

    job = Job("k", "q", ["a"], [], "param", ["x", "y"], {"prag_sum": [2.0, 1.0]})
    res = {"prag_sum": -1.0, "loo:0": -3.0, "loo:1": -1.5, "loo:2": -0.5}  # position 0 helps most, 2 hurts
    o = heldout.oracle_job(job, ["x", "y", "x"], res)
    w = o.rows["oracle"]
    assert sum(w) == pytest.approx(3.0) and w[0] > w[1]  # positions 0 and 2 (same passage) add up on pid x


@pytest.mark.parametrize("args,msg", [
    (["--data", "/nonexistent.jsonl", "--controller", "/tmp", "--out", "OUT"], "--data /nonexistent.jsonl: file not found"),
    (["--data", "DATA", "--controller", "/nonexistent", "--out", "OUT"], "--controller /nonexistent: no config.json"),
    (["--data", "DATA", "--controller", "CTRL", "--out", "OUT", "--limit", "0"], "--limit 0: expected a positive"),
])
def test_run_all_user_errors_are_one_line_exit_2(tmp_path, args, msg, capsys):
    import run_all

    data = _data_file(tmp_path / "d.jsonl", 2)
    (tmp_path / "ctrl").mkdir()
    (tmp_path / "ctrl" / "config.json").write_text("{}")
    args = [str(data) if x == "DATA" else str(tmp_path / "ctrl") if x == "CTRL" else str(tmp_path / "o") if x == "OUT"
            else x for x in args]
    with pytest.raises(SystemExit) as e:
        run_all.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and msg in err


def _ctrl_with_trained(tmp_path: Path, ids_text: str) -> Path:
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    (ctrl / "config.json").write_text("{}")
    (ctrl / "train_question_ids.json").write_text(ids_text)
    return ctrl


@pytest.mark.parametrize("keep", [False, True])
def test_run_all_leaves_out_the_controllers_training_questions(tmp_path, monkeypatch, capsys, keep):
    import run_all

    class Stop(Exception):
        pass

    seen = {}
    real = prepare.retrieval

    def spy(*args, **kwargs):  # run the real retrieval, then stop before the model loads
        seen["rows"] = real(*args, **kwargs)
        raise Stop

    monkeypatch.setattr(prepare, "retrieval", spy)
    data = _data_file(tmp_path / "d.jsonl", 6)
    ctrl = _ctrl_with_trained(tmp_path, json.dumps({"ids": ["q0", "q2", "not-in-file"]}))
    with pytest.raises(Stop):
        run_all.main(["--data", str(data), "--controller", str(ctrl), "--out", str(tmp_path / "o"), "--limit", "3"]
                     + (["--keep-trained"] if keep else []))
    ids = [r["id"] for r in seen["rows"]]
    assert ids == (["q0", "q1", "q2"] if keep else ["q1", "q3", "q4"])  # --limit counts the remaining questions
    err = capsys.readouterr().err
    assert ("leaving out 2 question(s)" in err) is (not keep)


@pytest.mark.parametrize("text", ["not json", '{"ids": "q0"}', '{"other": []}'])
def test_run_all_bad_trained_ids_file_is_one_line_exit_2(tmp_path, capsys, text):
    import run_all

    ctrl = _ctrl_with_trained(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        run_all.main(["--data", str(_data_file(tmp_path / "d.jsonl", 2)), "--controller", str(ctrl),
                      "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train_question_ids.json" in err


@pytest.fixture()
def toy_study(tmp_path, monkeypatch):
    """Two toy datasets (4 questions each, 6 passages) with real tiny adapters, and the study's stages pointed at
    them: the tiny model, hash embeddings, a tmp cache and work folder."""
    import study

    from helpers import hash_embed, make_adapter_dir

    monkeypatch.setattr(common, "HERE", tmp_path)
    monkeypatch.setattr(study, "WORK", tmp_path / "work")
    monkeypatch.setattr(study, "STUDY_TIMINGS", tmp_path / "timings.jsonl")
    monkeypatch.setattr(study, "SCOPE", tmp_path / "scope.json")
    monkeypatch.setattr(study, "CURVE_SIZES", study.CURVE_SIZES)
    monkeypatch.setattr(study, "DATASETS", {"da": None, "db": None})
    model = tiny_model("llama", seed=5, bos_token_id=2, eos_token_id=3, pad_token_id=0).eval()
    tok = tiny_tokenizer()
    tok.chat_template = None
    monkeypatch.setattr(common, "load_model", lambda dtype="float32": (model, tok))
    texts = {}
    for d, ds in enumerate(["da", "db"]):
        rows, logs = [], []
        for q in range(4):
            ps = []
            for k in range(6):
                text = f"{WORDS[(q + k + d) % 12]} is a {WORDS[(q * 3 + k) % 12]} ."
                pid = f"{d}{q}{k}0beef"
                make_adapter_dir(common.work_dir(ds) / "adapters" / pid, seed=100 * d + 10 * q + k)
                logs.append({"pid": pid})
                ps.append({"pid": pid, "text": text, "title": pid, "rank": k, "bm25": 6.0 - k, "supporting": k == 0})
                texts[prepare.text_key(text)] = text
            question = f"what is {WORDS[q + d]} ?"
            texts[prepare.text_key(question)] = question
            rows.append({"id": f"q{q}", "dataset": ds, "split": "test" if q % 2 else "train", "question": question,
                         "answer": [WORDS[q + d]], "passages": ps})
        common.write_jsonl(common.cache_dir(ds) / "retrieval.jsonl", rows)
        common.write_jsonl(common.cache_dir(ds) / "adapters.jsonl", logs)
    E = hash_embed(list(texts.values()), 16)
    emb = {k: E[i] for i, k in enumerate(texts)}
    monkeypatch.setattr(study, "load_emb", lambda: emb)
    monkeypatch.setattr(study, "_encoder_info", lambda: (16, "hash-16"))
    from helpers import hash_encoder

    monkeypatch.setattr(study, "_train_encoder", lambda: hash_encoder(16))
    return study


@pytest.mark.slow
def test_stages_label_grid_and_evaluate_a_toy_study_and_resume_without_rescoring(toy_study):
    import argparse

    import jobs

    study = toy_study
    args = argparse.Namespace(threads=1, questions=2, batch_size=8, limit=None)
    study.cmd_labels(args)
    for ds in ("da", "db"):
        labels = common.read_jsonl(common.cache_dir(ds) / "labels_train.jsonl")
        assert len(labels) == 2 * 20 and {x["group"] for x in labels} == {f"{ds}:q0", f"{ds}:q2"}
        assert len({tuple(x["deltas"]) for x in labels}) > 1  # real, differing labels
    study.cmd_grids(args)
    best = study.best_fixed()
    assert set(best) == {"kappa", "cos", "bm25"}
    study.cmd_eval(args)
    res = common.read_jsonl(common.cache_dir("da") / "results_test.jsonl")
    keys = {r["key"] for r in res}
    assert keys == {f"da|q{q}|{c}|{m}" for q in (1, 3) for c, m in
                    [("clean", "param"), ("clean", "combine"), ("replace", "param"), ("repeat", "param"),
                     ("alt", "param")]}
    names = {r["name"] for r in res if r["key"] == "da|q1|clean|param"}
    assert {"prag_sum", "average", "random", "oracle", "best_kappa", "best_cos", "best_bm25", "loo:0"} <= names
    meta = common.read_jsonl(common.cache_dir("da") / "test_meta.jsonl")
    assert len(meta) == 2 * 4
    # resuming scores nothing again; a new controller adds only its own rows
    n_train = len(common.read_jsonl(common.cache_dir("da") / "results_train.jsonl"))
    study.cmd_labels(args)
    study.cmd_grids(args)
    assert len(common.read_jsonl(common.cache_dir("da") / "results_train.jsonl")) == n_train
    from fcprag_plugin import FusionController

    FusionController.random(embed_dim=16, seed=7, embedding_model="hash-16").save_pretrained(
        study.WORK / "controllers" / "kl-paper-k1" / "s0")
    study.cmd_eval(args)
    res2 = common.read_jsonl(common.cache_dir("da") / "results_test.jsonl")
    added = res2[len(res):]
    # not the chosen configuration (no CV result yet): scored on param/clean only
    assert {r["name"] for r in added} == {"learned:kl-paper-k1:s0"}
    assert {r["key"] for r in added} == {"da|q1|clean|param", "da|q3|clean|param"}
    common.write_json(common.cache_dir("controllers") / "kl-paper-k1-s0.json",
                      {"candidate": "kl-paper-k1", "seed": 0, "cv": {"gain": 0.01}})
    assert study.chosen_candidate() == "kl-paper-k1"
    study.cmd_eval(args)  # now chosen: its rows under every condition and prompt, nothing else again
    added = common.read_jsonl(common.cache_dir("da") / "results_test.jsonl")[len(res2):]
    assert {r["name"] for r in added} == {"learned:kl-paper-k1:s0"}
    assert {r["key"] for r in added} == keys - {"da|q1|clean|param", "da|q3|clean|param"}
    calib = [m["calibration"]["learned:kl-paper-k1:s0"] for m in common.read_jsonl(
        common.cache_dir("da") / "test_meta.jsonl") if m.get("calibration")]
    assert len(calib) == 2 + 3 * 2  # clean (q1, q3), then replace, repeat, alt once the controller was chosen
    assert all(len(c) == 3 and 0 <= c[0] <= 1 and c[1] > 0 and c[2] == 1.0 for c in calib)
    assert len(jobs.label_rows()) == 35


def test_freeze_keeps_the_complete_training_questions_drops_alt_and_refuses_after_test_results(toy_study,
                                                                                            monkeypatch):
    import argparse
    import shutil

    import adapters

    study = toy_study
    every = {ds: {p["pid"]: {} for r in common.read_jsonl(common.cache_dir(ds) / "retrieval.jsonl")
                  for p in r["passages"]} for ds in ("da", "db")}
    monkeypatch.setattr(adapters, "load_augs", lambda datasets: every)
    rows = common.read_jsonl(common.cache_dir("db") / "retrieval.jsonl")
    q2 = next(r for r in rows if r["id"] == "q2")
    shutil.rmtree(common.work_dir("db") / "adapters" / q2["passages"][5]["pid"])  # db:q2 is incomplete
    order_before, _ = study.adapter_plan()
    study.cmd_freeze(argparse.Namespace(reason="toy"))
    sc = study.scope()
    assert sc["train_ids"] == {"da": ["q0", "q2"], "db": ["q0"]} and "alt" not in sc["conditions"]
    assert [(r["dataset"], r["id"]) for r in study.train_questions_in_order()] == [("da", "q0"), ("db", "q0"),
                                                                                ("da", "q2")]
    order, _ = study.adapter_plan()
    test_rest = {(r["dataset"], p["pid"]) for ds in ("da", "db") for r in common.read_jsonl(
        common.cache_dir(ds) / "retrieval.jsonl") if r["split"] == "test" for p in r["passages"][3:]}
    assert test_rest <= set(order_before) and not test_rest & set(order)
    assert not {("db", p["pid"]) for p in q2["passages"]} & set(order)
    with pytest.raises(SystemExit, match="frozen once"):
        study.cmd_freeze(argparse.Namespace(reason="again"))
    study.SCOPE.unlink()
    common.write_jsonl(common.cache_dir("da") / "results_test.jsonl", [{"key": "x", "name": "y", "logprob": 0}])
    with pytest.raises(SystemExit, match="before any"):
        study.cmd_freeze(argparse.Namespace(reason="late"))


def test_train_stage_trains_candidates_per_seed_and_eval_scores_them_side_features_included(toy_study):
    import argparse

    study = toy_study
    args = argparse.Namespace(threads=1, questions=2, batch_size=8, limit=None)
    study.cmd_labels(args)
    only = ["kl-paper-k1", "risk-side-query"]
    study.cmd_train(argparse.Namespace(threads=1, epochs=2, seeds=[0, 1], only=only))
    chosen = study.chosen_candidate()
    assert chosen in only
    # seed 0 of every candidate, the other seeds of the chosen configuration only
    assert sorted(study.learned_dirs()) == sorted([f"learned:{c}:s0" for c in only] + [f"learned:{chosen}:s1"])
    m = json.loads((common.HERE / "cache" / "controllers" / "risk-side-query-s0.json").read_text())
    assert m["cv"]["verdict"] in {"better_than_uniform", "unproven"} and m["options"]["side_features"]
    pooled = common.read_jsonl(study.WORK / "labels_train_pooled_side.jsonl")
    assert len(pooled) == 80 and all(len(x["adapter_stats"]) == 3 for x in pooled)
    study.cmd_train(argparse.Namespace(threads=1, epochs=2, seeds=[0, 1], only=only))  # nothing left to train
    assert study.chosen_candidate() == chosen  # its seed 1 does not change the choice
    study.CURVE_SIZES = (2,)
    study.cmd_curve(argparse.Namespace(threads=1, epochs=2))
    curve = {p.name: json.loads(p.read_text()) for p in (common.HERE / "cache" / "curve").glob("*.json")}
    assert set(curve) == {"2-s0.json", "4-s0.json"} and all(c["candidate"] == chosen for c in curve.values())
    assert curve["2-s0.json"]["cv"]["n_groups"] == 2 and curve["4-s0.json"]["cv"]["n_groups"] == 4
    study.cmd_eval(args)
    names = {r["name"] for r in common.read_jsonl(common.cache_dir("db") / "results_test.jsonl")}
    assert {f"learned:{c}:s0" for c in only} | {f"learned:{chosen}:s1"} <= names


def test_eval_passes_score_the_primary_rows_first_then_perturbations_other_methods_and_combine():
    import study

    passes = study.eval_passes("risk-side-kappa", ["clean", "replace", "repeat"])
    assert [(c, m) for c, m, _ in passes] == [(("clean",), ("param",)), (("replace", "repeat"), ("param",)),
                                              (("clean",), ("param",)), (("clean",), ("combine",))]
    primary, pert, rest, combine = (k for _, _, k in passes)
    for name in ("prag_sum", "average", "random", "best_kappa", "loo:0", "learned:risk-side-kappa:s2"):
        assert primary(name)
    assert not primary("learned:kl-paper-k1:s0") and rest("learned:kl-paper-k1:s0")
    assert pert("learned:risk-side-kappa:s1") and not pert("random") and not pert("loo:0")
    assert combine("prag_sum") and not combine("best_cos")


def test_selection_reads_seed_0_only_so_the_chosen_configurations_later_seeds_cannot_change_it(tmp_path):
    import analysis

    for cand, seed, gain in [("kl-paper-k1", 0, 0.02), ("risk-paper-k1", 0, 0.01), ("risk-paper-k1", 1, 0.5),
                             ("kl-paper-k1", 1, -0.5), ("kl-side-k1", 0, None)]:
        common.write_json(tmp_path / f"{cand}-s{seed}.json",
                          {"candidate": cand, "seed": seed, "cv": None if gain is None else {"gain": gain}})
    assert analysis.cv_gains(tmp_path) == {"kl-paper-k1": [0.02], "risk-paper-k1": [0.01]}
    assert analysis.select(analysis.cv_gains(tmp_path)) == "kl-paper-k1"


def test_selection_prefers_the_best_cv_gain_and_breaks_near_ties_toward_the_paper():
    import analysis

    assert analysis.select({"kl-paper-k1": [0.0, 0.0], "risk-side-query": [0.01, 0.02]}) == "risk-side-query"
    # within TIE of the best: fewer options changed wins
    assert analysis.select({"kl-paper-k1": [0.0100], "risk-paper-k1": [0.0105], "risk-side-query": [0.0108]}) \
        == "kl-paper-k1"
    assert analysis.changes_from_paper("risk-side-kappa") == 3 and analysis.changes_from_paper("kl-paper-k1") == 0


def test_holm_matches_the_step_down_definition():
    import analysis

    p = {"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5}
    adj = analysis.holm(p)
    # sorted: a 0.01*4=0.04, c 0.03*3=0.09, b 0.04*2=0.08 -> max(0.09, 0.08)=0.09, d 0.5*1 -> 0.5
    assert adj == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})


def test_sign_flip_and_stratified_bootstrap_behave():
    import analysis

    g = torch.Generator().manual_seed(3)
    shift = (0.5 + 0.2 * torch.randn(40, generator=g)).tolist()
    noise = (0.2 * torch.randn(40, generator=g)).tolist()
    assert analysis.sign_flip_p(shift, "s", n=2000) < 0.01
    assert analysis.sign_flip_p(noise + [-x for x in noise], "s", n=2000) > 0.5  # exactly symmetric: mean 0
    point, lo, hi = analysis.paired_bootstrap({"a": shift[:25], "b": noise[:15]}, "s", n=2000)
    assert point == pytest.approx((sum(shift[:25]) + sum(noise[:15])) / 40)
    assert lo < point < hi


def test_analysis_averages_seeds_and_runs_the_registered_comparisons():
    import analysis

    rows = {"hotpotqa": [], "2wiki": []}
    for ds, n in (("hotpotqa", 6), ("2wiki", 4)):
        for q in range(n):
            for cond, mode in (("clean", "param"), ("clean", "combine"), ("replace", "param")):
                key = f"{ds}|q{q}|{cond}|{mode}"
                rows[ds] += [{"key": key, "name": "prag_sum", "logprob": -2.0 - q},
                             {"key": key, "name": "average", "logprob": -2.5 - q},
                             {"key": key, "name": "learned:risk-paper-k1:s0", "logprob": -1.8 - q},
                             {"key": key, "name": "learned:risk-paper-k1:s1", "logprob": -1.9 - q},
                             {"key": key, "name": "learned:kl-paper-k1:s0", "logprob": -2.0 - q}]
    out = analysis.analyse(rows, {"risk-paper-k1": [0.02, 0.03], "kl-paper-k1": [0.0]})
    assert out["chosen"] == "risk-paper-k1"
    assert out["primary"]["n"] == 10 and out["primary"]["delta_loglik"] == pytest.approx(0.15)  # seeds averaged
    sec = out["secondary"]
    assert sec["primary@2wiki"]["n"] == 4 and sec["average@param/clean"]["delta_loglik"] == pytest.approx(-0.5)
    assert sec["learned:risk-paper-k1@param/replace"]["n"] == 10 and sec["learned:risk-paper-k1@param/alt"]["n"] == 0
    assert all(v["p_holm"] >= v["p"] for v in sec.values() if v.get("n"))
