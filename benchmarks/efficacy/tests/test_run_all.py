"""``run_all.py``: greedy answers scored by PRAG's rules for every row, the scale grid, extra controllers, PEFT's
Arrow router as the public peer, any model via ``--model``, ``--ids``, reuse of a work folder, and one-line user
errors. Everything runs on a tiny random Llama saved to disk (``helpers.save_tiny_lm``) and loaded by ``--model``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import hash_encoder, make_adapter_dir, save_tiny_lm, tiny_model
from test_study import _data_file

import adapters
import arrow_router
import common
import heldout
import prepare
import run_all

ARROW, ARROW_WHY = arrow_router.status()
needs_arrow = pytest.mark.skipif(not ARROW, reason=f"no Arrow in this stack: {ARROW_WHY}")
GEN_FIELDS = ("f1", "em", "acc")


@pytest.fixture()
def world(tmp_path, monkeypatch):
    """A saved tiny LM, a fixed-cosine controller (trained on q1), a scale-only one (kappa 2) and 4 questions."""
    import fcprag_plugin.encoding
    from fcprag_plugin import FusionController

    enc = hash_encoder(16)
    monkeypatch.setattr(fcprag_plugin.encoding, "TextEncoder", lambda *a, **k: enc)
    lm = save_tiny_lm(tmp_path / "lm", seed=5)
    ctrl = tmp_path / "ctrl"
    FusionController.fixed(g=0.9, tau=0.05, embed_dim=16, scorer="cosine").save_pretrained(ctrl)
    (ctrl / "train_question_ids.json").write_text(json.dumps({"ids": ["q1"]}))
    so = tmp_path / "so"
    FusionController.uniform(embed_dim=16, kappa=2.0).save_pretrained(so)
    data = _data_file(tmp_path / "d.jsonl", 4)
    base = ["--data", str(data), "--controller", str(ctrl), "--model", str(lm), "--threads", "1",
            "--questions", "2", "--scales", "0.5,2", "--device", "cpu"]
    return {"tmp": tmp_path, "lm": lm, "ctrl": ctrl, "so": so, "data": data, "base": base}


def _load(lm: Path):
    from fcprag_tools.label_builder.model_io import load_model

    return load_model(str(lm), device="cpu")


def _rows(out: Path) -> list[dict]:
    return common.read_jsonl(out / "eval.jsonl")


def test_generate_writes_every_field_scored_by_prags_rules_and_resumes_without_rescoring(world):
    from fcprag_plugin import LoraAdapter, WeightedAdapterMerger, activate
    from fcprag_tools.label_builder.metrics import (answer_in_text, answer_logprob, exact_match, extract_answer, f1_score,
                                             greedy_generate)
    from batch_scorer import Job

    out = world["tmp"] / "o"
    args = world["base"] + ["--out", str(out), "--generate", "--extra-controller", f"scale_only={world['so']}"]
    run_all.main(args)
    s = json.loads((out / "summary.json").read_text())
    rows = ({"prag_sum", "average", "learned", "learned_same_total", "oracle", "scale:0.5", "scale:2", "scale_only"}
            | ({"arrow"} if ARROW else set()))
    assert s["n_questions"] == 3 and s["settings"]["left_out_trained"] == 1 and set(s["methods"]) == rows
    assert s["settings"]["arrow"]["scored"] is ARROW and s["settings"]["generate"] is True
    assert s["settings"]["controllers"]["scale_only"]["uniform_or_scale_only"] is True
    results = _rows(out)
    assert {r["name"] for r in results} == rows | {"loo:0", "loo:1", "loo:2"}
    assert len(results) == 3 * (len(rows) + 3)  # one row per (question, method): nothing scored twice
    # every row's answer follows PRAG's rules from its own raw generation
    for r in results:
        answers = [common.read_jsonl(world["data"])[int(r["key"].split("|")[1][1:])]["answer"]]
        assert r["prediction"] == extract_answer(r["generation"], False, scoring="prag")
        assert r["f1"] == pytest.approx(f1_score(r["prediction"], answers), abs=1e-5)
        assert r["em"] == exact_match(r["prediction"], answers) and r["acc"] == answer_in_text(r["generation"], answers)
    # the summary is the per-question table's means and paired differences, for every metric
    tables = {m: heldout.per_question(results, m) for m in ("logprob",) + GEN_FIELDS}
    for m in rows:
        for metric, field in (("logprob", "gold_loglik"),) + tuple((f, f) for f in GEN_FIELDS):
            vals = [v[m] for v in tables[metric].values()]
            assert s["methods"][m][field] == pytest.approx(sum(vals) / 3)
        if m == "prag_sum":
            continue
        p = s["paired"][m]
        assert p["against"] == "prag_sum"
        for metric, d, ci in (("logprob", "delta_loglik", "ci95"),) + tuple(
                (f, f"delta_{f}", f"ci95_{f}") for f in GEN_FIELDS):
            diffs = [v[m] - v["prag_sum"] for v in tables[metric].values()]
            assert p[d] == pytest.approx(sum(diffs) / 3)
            assert p[ci][0] - 1e-9 <= p[d] <= p[ci][1] + 1e-9
    # rows with the same weights agree: the scale-only controller (kappa 2) is scale:2; a fixed controller keeps
    # PRAG's total, so its same-total row is prag_sum
    by = {(r["key"], r["name"]): r for r in results}
    for key in tables["logprob"]:
        assert by[key, "scale_only"]["w"] == by[key, "scale:2"]["w"] == [2.0, 2.0, 2.0]
        assert by[key, "scale_only"]["logprob"] == pytest.approx(by[key, "scale:2"]["logprob"], abs=1e-5)
        assert by[key, "scale_only"]["generation"] == by[key, "scale:2"]["generation"]
        assert by[key, "learned_same_total"]["logprob"] == pytest.approx(by[key, "prag_sum"]["logprob"], abs=1e-5)
    assert any(abs(by[k, "learned"]["logprob"] - by[k, "prag_sum"]["logprob"]) > 1e-4 for k in tables["logprob"])
    # independent reference for one question: merge the adapters by hand, activate, score and generate one row
    model, tok = _load(world["lm"])
    key = sorted(tables["logprob"])[0]
    q = next(r for r in common.read_jsonl(out / "retrieval.jsonl") if r["id"] == key.split("|")[1])
    job = Job(key, q["question"], q["answer"], [], "param", [], {}).encode(tok)
    ads = [LoraAdapter.from_pretrained(out / "adapters" / p["pid"]) for p in q["passages"]]
    for name in ("prag_sum", "scale:0.5", "learned"):
        merged = WeightedAdapterMerger("cat").merge(ads, by[key, name]["w"]).adapter
        with activate(model, merged):
            lp = max(answer_logprob(model, job.prompt_ids, g) for g in job.gold)
            gen = greedy_generate(model, tok, job.prompt_ids, 16)
        assert by[key, name]["logprob"] == pytest.approx(lp, abs=1e-4)
        assert by[key, name]["generation"] == gen
    if ARROW:  # PEFT's own Arrow wrap, scored one alias at a time without the batched path
        from peft import ArrowConfig, create_arrow_model

        wrapped = create_arrow_model(model, [str(out / "adapters" / p["pid"]) for p in q["passages"]],
                                     ArrowConfig(top_k=3, router_temperature=1.0, rng_seed=0))
        lp = max(answer_logprob(model, job.prompt_ids, g) for g in job.gold)
        gen = greedy_generate(model, tok, job.prompt_ids, 16)
        wrapped.unload()
        assert by[key, "arrow"]["logprob"] == pytest.approx(lp, abs=1e-4) and by[key, "arrow"]["generation"] == gen
    # a rerun scores nothing; without --generate the summary keeps only the log-lik. fields, from the same rows
    n = len(results)
    run_all.main(args)
    assert len(_rows(out)) == n and json.loads((out / "summary.json").read_text()) == s
    run_all.main([x for x in args if x != "--generate"])
    plain = json.loads((out / "summary.json").read_text())
    assert len(_rows(out)) == n and plain["settings"]["max_new_tokens"] is None
    assert all(set(v) == {"gold_loglik"} for v in plain["methods"].values())
    assert all(set(v) == {"delta_loglik", "ci95", "against"} for v in plain["paired"].values())
    assert plain["paired"]["learned"] == {k: s["paired"]["learned"][k] for k in ("delta_loglik", "ci95", "against")}
    # another controller under the same name rescores only its rows (and the oracle, rescored with any row)
    from fcprag_plugin import FusionController

    other = world["tmp"] / "ctrl2"
    FusionController.fixed(g=0.5, tau=0.2, embed_dim=16, scorer="cosine").save_pretrained(other)
    (other / "train_question_ids.json").write_text(json.dumps({"ids": ["q1"]}))
    run_all.main([x if x != str(world["ctrl"]) else str(other) for x in args])
    new = _rows(out)[n:]
    # (its same-total row, [1, 1, 1] for any fixed controller, has the same weights: reused)
    assert {r["name"] for r in new} == {"learned", "oracle"} and len(new) == 6


def test_combine_prompt_reuses_the_adapters_and_leaves_the_param_summary(world):
    out = world["tmp"] / "o"
    args = world["base"] + ["--out", str(out), "--no-arrow", "--scales", ""]
    run_all.main(args)
    s = json.loads((out / "summary.json").read_text())
    assert set(s["methods"]) == {"prag_sum", "average", "learned", "learned_same_total", "oracle"}
    assert s["settings"]["arrow"] == {**arrow_router.settings(), "scored": False,
                                      "why": "--no-arrow" if ARROW else ARROW_WHY}
    n_adapters = len(common.read_jsonl(out / "adapters.jsonl"))
    run_all.main(args + ["--prompt", "combine"])
    c = json.loads((out / "summary_combine.json").read_text())
    assert c["n_questions"] == 3 and c["settings"]["prompt"] == "combine"
    assert len(common.read_jsonl(out / "adapters.jsonl")) == n_adapters  # adapters reused, not trained again
    assert json.loads((out / "summary.json").read_text()) == s
    assert c["methods"]["prag_sum"]["gold_loglik"] != pytest.approx(s["methods"]["prag_sum"]["gold_loglik"])


@needs_arrow
def test_arrow_with_one_expert_is_that_adapter_alone_and_leaves_the_model_as_it_was(tmp_path):
    from peft import PeftModel

    from fcprag_plugin import LoraAdapter, activate

    model = tiny_model("llama", seed=1234)
    d = make_adapter_dir(tmp_path / "a", seed=3)
    ids = torch.tensor([[2, 5, 9, 17, 33, 40, 41]])
    with torch.no_grad():
        base = model(ids).logits
        wrapped = arrow_router.arrow_model(model, [d])
        got = model(ids).logits
        wrapped.unload()
        after = model(ids).logits
        peft = PeftModel.from_pretrained(model, str(d))
        ref = model(ids).logits
        peft.unload()
        with activate(model, LoraAdapter.from_pretrained(d)):
            lib = model(ids).logits
    assert (got - base).abs().max() > 1e-2  # the adapter does something
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, lib, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, base, atol=0, rtol=0)
    assert all(type(m).__module__.startswith("torch") for n, m in model.named_modules() if n.endswith("_proj"))


@needs_arrow
def test_arrow_routes_each_token_to_a_softmax_mixture_over_singular_vector_prototypes(tmp_path):
    """One layer's Arrow delta against the method written out: prototype e = top right singular vector of
    B_e A_e (checked against an exact SVD; PEFT finds it by power iteration, whose small error the sharp softmax
    amplifies, so the routing below uses PEFT's prototypes), coefficients softmax(|x . proto_e| / T) over the top
    k experts of each token, delta = sum_e coeff_e s B_e A_e x."""
    from fcprag_plugin import LoraAdapter

    model = tiny_model("llama", seed=1234)
    dirs = [make_adapter_dir(tmp_path / f"a{i}", seed=i) for i in range(3)]
    ads = [LoraAdapter.from_pretrained(d) for d in dirs]
    ids = torch.tensor([[2, 5, 9, 17, 33, 40, 41, 50]])
    name = next(k for k in ads[0].modules if k.endswith("layers.1.mlp.down_proj"))
    mods = [a.modules[name] for a in ads]
    dW = [m.scaling * m.B.double() @ m.A.double() for m in mods]
    for top_k in (3, 2):
        seen = {}
        wrapped = arrow_router.arrow_model(model, dirs, top_k=top_k)
        layer = model.model.layers[1].mlp.down_proj
        h = layer.register_forward_hook(lambda m, i, o: seen.update(x=i[0].detach(), y=o.detach()))
        with torch.no_grad():
            model(ids)
            delta = seen["y"] - layer.base_layer(seen["x"])
        h.remove()
        protos = layer.lora_arrow["arrow_router"].prototypes.double()  # [E, in]
        wrapped.unload()
        for e in range(3):
            assert float((protos[e] @ torch.linalg.svd(dW[e])[2][0]).abs()) > 1 - 1e-6
        x = seen["x"].reshape(-1, seen["x"].shape[-1]).double()
        sim = (x @ protos.T).abs()
        top = sim.topk(top_k, dim=1)
        coeff = torch.full_like(sim, float("-inf")).scatter(1, top.indices, top.values).softmax(1)
        ref = sum(coeff[:, e:e + 1] * (x @ dW[e].T) for e in range(3))
        torch.testing.assert_close(delta.reshape(ref.shape).double(), ref, atol=1e-4, rtol=1e-3)
        assert ((coeff > 0).sum(1) == top_k).all()


def test_device_and_dtype_float32_matches_the_cpu_and_bfloat16_stays_close(world):
    """The whole run on CUDA where there is one (else the CPU again): float32 there gives the CPU's numbers,
    bfloat16 close ones; adapters are trained on that device and saved float32 either way."""
    from safetensors.torch import load_file

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    runs = {}
    for device, dtype in (("cpu", "float32"), (dev, "float32"), (dev, "bfloat16")):
        out = world["tmp"] / f"o-{device}-{dtype}"
        args = [device if x == "cpu" else x for x in world["base"]]
        run_all.main(args + ["--out", str(out), "--dtype", dtype, "--generate"])
        s = json.loads((out / "summary.json").read_text())
        assert s["settings"]["device"].startswith(device) and s["settings"]["dtype"] == dtype
        pid = common.read_jsonl(out / "adapters.jsonl")[0]["pid"]
        assert {v.dtype for v in load_file(out / "adapters" / pid / "adapter_model.safetensors").values()} == {
            torch.float32}
        runs[device, dtype] = {(r["key"], r["name"]): r for r in _rows(out)}
        assert all(torch.isfinite(torch.tensor(r["logprob"])) and "f1" in r for r in runs[device, dtype].values())
    cpu, f32, bf16 = runs["cpu", "float32"], runs[dev, "float32"], runs[dev, "bfloat16"]
    assert cpu.keys() == f32.keys() == bf16.keys()
    for k in cpu:
        assert f32[k]["logprob"] == pytest.approx(cpu[k]["logprob"], abs=2e-3)
        assert bf16[k]["logprob"] == pytest.approx(cpu[k]["logprob"], abs=0.02)  # values span ~0.2


def _spy_retrieval(monkeypatch) -> dict:
    class Stop(Exception):
        pass

    seen: dict = {"Stop": Stop}
    real = prepare.retrieval

    def spy(*args, **kwargs):  # the real retrieval, then stop before the model loads
        seen["rows"] = real(*args, **kwargs)
        raise Stop

    monkeypatch.setattr(prepare, "retrieval", spy)
    return seen


@pytest.mark.parametrize("fmt", ["json", "lines"])
def test_ids_keep_only_those_questions_in_file_order_before_the_trained_ones_leave_and_limit_counts(
        tmp_path, monkeypatch, capsys, fmt):
    seen = _spy_retrieval(monkeypatch)
    data = _data_file(tmp_path / "d.jsonl", 6)
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    (ctrl / "config.json").write_text("{}")
    (ctrl / "train_question_ids.json").write_text(json.dumps({"ids": ["q1"]}))
    ids = ["q4", "q1", "q3", "q5", "other-file-id"]
    f = tmp_path / "ids.txt"
    f.write_text(json.dumps({"ids": ids}) if fmt == "json" else "\n".join(ids) + "\n\n")
    with pytest.raises(seen["Stop"]):
        run_all.main(["--data", str(data), "--controller", str(ctrl), "--out", str(tmp_path / "o"), "--ids", str(f),
                      "--limit", "2"])
    assert [r["id"] for r in seen["rows"]] == ["q3", "q4"]  # file order, q1 (trained) left out, then 2 kept
    assert "1 of the 5 ids in" in capsys.readouterr().err  # an id of another file is skipped, with a note


def test_a_work_folder_built_elsewhere_is_reused_without_training_and_keeps_its_other_questions(world, monkeypatch):
    """The background job's layout (prepare.retrieval with exclude + adapters.build(root=...)) for 3 questions;
    run_all --ids on 2 of them finds every adapter by passage id and trains none."""
    root = world["tmp"] / "fresh"
    root.mkdir()
    model, tok = _load(world["lm"])
    for p in model.parameters():
        p.requires_grad_(False)
    rows = prepare.retrieval(world["data"], root / "retrieval.jsonl", 1.0, 3, dataset="hotpotqa",
                             exclude=frozenset({"q0"}))
    augs = {"hotpotqa": {x["pid"]: x for x in prepare.augmentation(rows, root / "augment.jsonl")}}
    items = [("hotpotqa", pid) for pid in dict.fromkeys(p["pid"] for r in rows for p in r["passages"])]
    adapters.build(items, augs, 12, len(items), 1, 128, model=model, tok=tok, root=root,
                   base_model=os.path.abspath(world["lm"]))
    before = {name: (root / name).read_text() for name in ("retrieval.jsonl", "augment.jsonl", "adapters.jsonl")}

    def no_training(*a, **k):
        raise AssertionError("adapters.build called: an adapter was not reused")

    monkeypatch.setattr(adapters, "build", no_training)
    (world["tmp"] / "ids.json").write_text(json.dumps({"ids": ["q2", "q3"]}))
    run_all.main(world["base"] + ["--out", str(root), "--ids", str(world["tmp"] / "ids.json"), "--no-arrow"])
    s = json.loads((root / "summary.json").read_text())
    assert s["n_questions"] == 2 and s["settings"]["ids"].endswith("ids.json")
    for name, text in before.items():  # the lead's rows are kept as they were (same passages, same pids)
        assert (root / name).read_text() == text
    # another model's work folder is refused in one line
    other = save_tiny_lm(world["tmp"] / "lm2", seed=6)
    args = world["base"] + ["--out", str(root), "--ids", str(world["tmp"] / "ids.json"), "--no-arrow"]
    with pytest.raises(SystemExit) as e:
        run_all.main([str(other) if x == str(world["lm"]) else x for x in args])
    assert e.value.code == 2


def _no_gated_mlp_model(path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import tiny_tokenizer

    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=16, n_layer=1, n_head=2, n_positions=128)).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("extra,msg", [
    (["--scales", "0.5,x"], "--scales 0.5,x: 'x' is not a number"),
    (["--scales", "1,2"], "--scales 1,2: 1 is prag_sum"),
    (["--scales", "-2"], "--scales -2: -2 is not a finite number >= 0"),
    (["--scales", "2,2"], "--scales 2,2: 2 is listed twice"),
    (["--extra-controller", "noequals"], "--extra-controller noequals: expected NAME=DIR"),
    (["--extra-controller", "prag_sum=CTRL"], "not be a built-in row name"),
    (["--extra-controller", "a=CTRL", "--extra-controller", "a=CTRL"], "the name a is given twice"),
    (["--extra-controller", "a=/nonexistent"], "--extra-controller a=/nonexistent: no config.json"),
    (["--ids", "/nonexistent"], "--ids /nonexistent: file not found"),
    (["--ids", "IDS:q8\nq9\n"], "none of its 2 id(s) is in --data"),
    (["--ids", "IDS:\n\n"], "no question ids in it"),
    (["--ids", "IDS:{\"ids\": "], "cannot read it"),
    (["--ids", "IDS:{\"ids\": [1]}"], "'ids' must be a list of question id strings"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: expected a positive integer"),
    (["--top-k", "0"], "--top-k 0: expected a positive integer"),
    (["--dtype", "int8"], "--dtype int8: expected one of auto"),
    (["--device", "bogus"], "--device 'bogus'"),
    (["--gguf-file", "x.gguf"], "--gguf-file needs --model"),
    (["--prompt", "bogus"], "argument --prompt: invalid choice"),
    (["--generate", "--max-new-tokens", "two"], "argument --max-new-tokens: invalid int value"),
    (["--model", "EMPTY"], "could not be loaded"),
    (["--model", "GPT2"], "no Linear layer named gate_proj/up_proj/down_proj"),
    (["--data", "BADDATA"], "field 'answer' missing"),
])
def test_bad_option_values_are_one_line_and_exit_2(tmp_path, capsys, extra, msg):
    data = _data_file(tmp_path / "d.jsonl", 2)
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    (ctrl / "config.json").write_text("{}")
    args = ["--data", str(data), "--controller", str(ctrl), "--out", str(tmp_path / "o")]
    for x in extra:
        if x.startswith("IDS:"):
            (tmp_path / "ids").write_text(x[4:])
            x = str(tmp_path / "ids")
        elif x == "EMPTY":
            (tmp_path / "empty").mkdir()
            x = str(tmp_path / "empty")
        elif x == "GPT2":
            x = str(_no_gated_mlp_model(tmp_path / "gpt2"))
        elif x == "BADDATA":
            (tmp_path / "bad.jsonl").write_text(json.dumps({"id": "q0", "question": "q", "passages": [],
                                                            "titles": [], "supporting_titles": []}) + "\n")
            x = str(tmp_path / "bad.jsonl")
        args.append(x.replace("CTRL", str(ctrl)))
    with pytest.raises(SystemExit) as e:
        run_all.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert last.startswith("run_all.py: ") and msg in last
    assert all(not line.startswith("run_all.py") or line == last for line in err.splitlines())
    assert "Traceback" not in err


@pytest.mark.parametrize("text,msg", [("{\"ids\": ", "cannot read it (JSONDecodeError"),
                                      ("{\"ids\": [1]}", "'ids' must be a list of question id strings")])
def test_a_bad_train_question_ids_file_is_one_line_naming_it(tmp_path, capsys, text, msg):
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    (ctrl / "config.json").write_text("{}")
    (ctrl / "train_question_ids.json").write_text(text)
    with pytest.raises(SystemExit) as e:
        run_all.main(["--data", str(_data_file(tmp_path / "d.jsonl", 2)), "--controller", str(ctrl), "--out",
                      str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"run_all.py: {ctrl / 'train_question_ids.json'}: ") and msg in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("generation,answers,expected", [
    # PRAG cuts at the first ',', '.' or newline; SQuAD normalisation; acc reads the whole generation
    (" Paris, the capital.\nMore", ["paris"], ("Paris", 1.0, 1.0, 1.0)),
    # [it, is, in, new, york, city] vs [new, york]: p 2/6, r 1, f1 0.5
    (" it is in New York City. Yes", ["Big Apple", "New York"], ("it is in New York City", 0.5, 0.0, 1.0)),
    (" yes it is", ["yes"], ("yes it is", 0.0, 0.0, 1.0)),  # HotpotQA's yes/no rule: no partial credit
    (" I do not know", ["no"], ("I do not know", 0.0, 0.0, 0.0)),
])
def test_a_generation_is_scored_by_prags_rules(generation, answers, expected):
    import scoring
    from batch_scorer import Job

    r = scoring.finish(Job("k", "q", answers, [], "param", [], {}), "prag_sum", -1.0, generation)
    assert (r["prediction"], r["f1"], r["em"], r["acc"]) == pytest.approx(expected)
    assert r["generation"] == generation


def test_stop_ids_do_not_take_the_unknown_token_for_a_missing_im_end():
    import scoring
    from helpers import tiny_tokenizer

    model = tiny_model("llama", seed=0, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    assert scoring.stop_ids(model, tiny_tokenizer()) == {3}  # [UNK] (1) would end every unknown word
