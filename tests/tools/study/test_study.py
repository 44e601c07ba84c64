"""``fcprag study`` end to end on a tiny model, its resume after an interrupt in each stage, and its errors."""

from __future__ import annotations

import json

import pytest

from fcprag_plugin.errors import FcpragError
from fcprag_tools.cli import main
from fcprag_tools.options import ModelPart
from fcprag_tools.study import StudyOptions, check_summary, run_study
from fcprag_tools.study import adapters as ad
from fcprag_tools.study import preflight, scoring, summary
from fcprag_tools.study.options import study_training
from fcprag_tools.study.run import StudyRun
from fcprag_tools.study.stages import augmentation
from fcprag_tools.study.stages.controllers import warn_if_too_few
from fcprag_tools.study.stages.retrieval import retrieve_questions
from helpers import hash_encoder

FAST = dict(top_k=2, scales=(2.0, 4.0), max_new_tokens=3, aug_max_new_tokens=6, progress=False, test_fraction=0.5,
            group=2, chunk=1, epochs=2)


def _opts(t, out="out", **kw):
    return StudyOptions.of(questions=t["questions"], model=t["model"], out=str(t["root"] / out),
                           encoder=hash_encoder(), **{**FAST, **kw})


def test_cli_end_to_end_writes_a_checked_summary_report_and_a_loadable_controller(tiny_study, capsys, monkeypatch):
    from fcprag_plugin import FusionController

    moves: dict[str, list[float]] = {}  # every move of every bar, by stage
    bar = StudyRun.bar

    def recording(self, stage, *a, **k):
        b = bar(self, stage, *a, **k)
        update = b.update
        b.update = lambda n=1: (moves.setdefault(stage, []).append(n), update(n))[1]
        return b

    monkeypatch.setattr(StudyRun, "bar", recording)
    out = tiny_study["root"] / "cli"
    rc = main(["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--top-k", "2",
               "--scales", "2,4", "--max-new-tokens", "3", "--test-fraction", "0.5", "--epochs", "2",
               "--no-progress", "--device", "cpu", "--dtype", "float32"])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert check_summary(s) == [] and s["n_train"] == 3 and s["n_test"] == 3
    assert {"prag_sum", "recommended", "average", "scale:2", "scale:4", "learned", "learned_same_total",
            "oracle", "vanilla", "standard_rag", "prag_sum_combine", "recommended_combine", "random_controller",
            "random_controller_combine", "learned_combine", "learned_same_total_combine"} <= set(s["methods"])
    assert s["settings"]["device"] == "cpu" and s["settings"]["dtype"] == "float32"
    # 3 held-out questions in one chunk of rows scored 16 at a time: the bar moves per batch and ends at 3
    assert len(moves["evaluate"]) > 1 and all(0 < m < 3 for m in moves["evaluate"])
    assert sum(moves["evaluate"]) == pytest.approx(3)
    labels = [json.loads(x) for x in (out / "labels.jsonl").read_text().splitlines()]  # the training questions'
    assert len(labels) == 3 and all(r["scales"] == [1.0, 2.0, 4.0] and len(r["metric_without"]) == 2
                                    and len(r["f1_at_scales"]) == 3 for r in labels)
    test_ids = {json.loads(x)["id"] for x in (out / "questions.jsonl").read_text().splitlines()
                if json.loads(x)["split"] == "test"}
    assert not test_ids & {r["id"] for r in labels}  # no held-out question is labelled or trained on
    ctrl = FusionController.from_pretrained(out / "controller")  # what it recommends, a normal controller folder
    assert (ctrl.config.controller_mode == "uniform") == (s["verdict"]["ship"] != "network")
    assert ctrl.config.trained_for["adapter_recipes"][0]["rank"] == [2]  # what it was measured on, whatever ships
    report = (out / "report.md").read_text()
    assert "| param | " + s["verdict"]["ship"] in report and "| combine | " in report
    assert s["verdict"]["settings"]["param"]["ship"] == s["verdict"]["ship"]
    assert s["verdict"]["kappa_learned"] == 1.0  # 3 training questions: the risk rule cannot allow a scale
    assert "with 3 training questions the risk rule cannot allow any scale" in s["verdict"]["why"]
    # the recommended row is the row of what ships, measured on the same questions
    row = {"network": "learned", "prag_sum": "prag_sum"}.get(s["verdict"]["ship"], f"scale:{s['verdict']['kappa']:g}")
    assert s["methods"]["recommended"] == s["methods"][row]
    # every row's subtask F1 is the mean of its per-question F1 in eval.jsonl; the rows run as data says
    qs = {json.loads(x)["id"]: json.loads(x) for x in (out / "questions.jsonl").read_text().splitlines()}
    ev = {json.loads(x)["id"]: json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()}
    for name in ("vanilla", "standard_rag", "prag_sum_combine", "random_controller", "recommended_combine"):
        rows = [ev[f"{q}|{s['verdict']['settings']['combine']['recommended_row']}" if name == "recommended_combine"
                   else f"{q}|{name}"] for q in qs if qs[q]["split"] == "test"]
        f1, em = [r["f1"] for r in rows], [r["em"] for r in rows]
        assert s["methods"][name]["by_subtask"]["q/all"] == {"f1": pytest.approx(sum(f1) / 3),
                                                             "em": pytest.approx(sum(em) / 3), "n": 3}
        assert s["methods"][name]["f1"] == pytest.approx(sum(f1) / 3)
    for q in (q for q in qs if qs[q]["split"] == "test"):
        assert ev[f"{q}|vanilla"]["w"] == [0.0, 0.0] and ev[f"{q}|vanilla"]["prompt"] == "param"
        assert ev[f"{q}|standard_rag"]["w"] == [0.0, 0.0] and ev[f"{q}|standard_rag"]["prompt"] == "combine"
        assert ev[f"{q}|prag_sum_combine"]["w"] == [1.0, 1.0] and ev[f"{q}|prag_sum_combine"]["prompt"] == "combine"
    # "what to run": chosen on the training questions (their candidate rows are scored), measured held out
    w = s["verdict"]["what_to_run"]
    train = [q for q in qs if qs[q]["split"] == "train"]
    means = {c: sum(ev[f"{q}|{c}"]["f1"] for q in train) / len(train) for c in ("vanilla", "standard_rag",
                                                                                "prag_sum", "prag_sum_combine")}
    assert w["chosen_on"] == "training" and w["n_choice"] == 3 and w["row"] in summary.CANDIDATES
    assert all(w["choice_f1"][c] == pytest.approx(m) for c, m in means.items())
    assert w["choice_f1"][w["row"]] == max(w["choice_f1"].values())
    assert set(s["verdict"]["what_to_run_by_dataset"]) == {"q"} and (out / "report.png").is_file()
    # --controller: trains nothing, evaluates it on every question it was not trained on
    out2 = tiny_study["root"] / "given"
    assert main(["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out2), "--top-k", "2",
                 "--scales", "2", "--max-new-tokens", "3", "--no-progress", "--controller",
                 str(out / "controller")]) == 0
    s2 = json.loads((out2 / "summary.json").read_text())
    assert check_summary(s2) == [] and s2["n_test"] == 3 and s2["n_train"] == 0
    trained = set(json.loads((out / "controller" / "train_question_ids.json").read_text())["ids"])
    evaluated = {json.loads(x)["id"] for x in (out2 / "questions.jsonl").read_text().splitlines()}
    assert len(trained) == 3 and not trained & evaluated
    assert not (out2 / "labels.jsonl").exists() and not (out2 / "train").exists()


def _interrupt_at(monkeypatch, module, name, call):
    real, calls = getattr(module, name), []

    def wrapped(*a, **k):
        calls.append(a)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("module,name,call", [(augmentation, "augment_batch", 2), (ad, "train_stacked", 3),
                                              (scoring, "score", 3)])
def test_an_interrupt_in_a_stage_loses_nothing_finished(tiny_study, monkeypatch, module, name, call):
    opts = _opts(tiny_study, aug_batch=2)
    with monkeypatch.context() as m:
        _interrupt_at(m, module, name, call)
        with pytest.raises(KeyboardInterrupt):
            run_study(opts)
    out = tiny_study["root"] / "out"
    before = {f: (out / f).read_text() for f in ("augment.jsonl", "adapters.jsonl", "eval.jsonl")
              if (out / f).exists()}
    trained = [json.loads(x)["id"] for x in before.get("adapters.jsonl", "").splitlines()]
    with monkeypatch.context() as m:
        calls = _interrupt_at(m, ad, "train_stacked", 0)
        scored = _interrupt_at(m, scoring, "score", 0)
        s = run_study(opts)
    assert check_summary(s) == []
    for f, text in before.items():  # what was written is kept as it was, and extended
        assert (out / f).read_text().startswith(text), f
    done_again = {json.loads(x)["id"] for x in (out / "adapters.jsonl").read_text().splitlines()}
    assert len(done_again) == len((out / "adapters.jsonl").read_text().splitlines())  # each adapter once
    assert set(trained) <= done_again and len(calls) == -(-(len(done_again) - len(trained)) // 2)
    ids = [json.loads(x)["id"] for x in (out / "eval.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids))  # no row scored twice
    if name == "score":
        first = [json.loads(x)["id"] for x in before["eval.jsonl"].splitlines()]
        assert not set(first) & {f"{r.qid}|{r.name}" for a in scored for r in a[3]}


def test_a_resume_with_other_settings_is_refused_and_changes_nothing(tiny_study, capsys):
    out = tiny_study["root"] / "o"
    args = ["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--top-k", "2",
            "--scales", "2", "--max-new-tokens", "2", "--no-progress", "--test-fraction", "0.5", "--epochs", "1"]
    assert main(args) == 0
    snap = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(args[:-4] + ["--test-fraction", "0.3", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "test_fraction=0.5" in err and "--test-fraction" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snap
    # --dtype auto is recorded as what it means here; naming that dtype is the same study, answered as complete
    import torch

    meant = "bfloat16" if torch.cuda.is_available() else "float32"
    assert json.loads((out / "settings.json").read_text())["dtype"] == meant
    assert main(args + ["--dtype", meant]) == 0 and "complete" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snap


def test_a_model_without_prags_target_modules_is_one_line(tiny_study, tmp_path, capsys):
    from helpers import tiny_tokenizer

    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "g")
    tiny_tokenizer().save_pretrained(tmp_path / "g")
    capsys.readouterr()
    rc = main(["study", tiny_study["questions"], "--model", str(tmp_path / "g"), "--out", str(tmp_path / "x"),
               "--no-progress", "--top-k", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "gate_proj/up_proj/down_proj" in err


@pytest.mark.parametrize("extra,needle", [(["--retrieval", "nope.jsonl"], "--retrieval nope.jsonl: file not found"),
                                          (["--controller", "."], "--controller .: no config.json"),
                                          (["--test-fraction", "1.5"], "--test-fraction 1.5"),
                                          (["--scales", "2,1"], "scale 1 is prag_sum"),
                                          (["--train-ids", "nope.json"], "--train-ids nope.json: file not found"),
                                          (["--train-ids", "x", "--controller", "."], "--train-ids with --controller")])
def test_bad_inputs_are_one_line_and_write_nothing(tiny_study, capsys, extra, needle):
    out = tiny_study["root"] / "never"
    rc = main(["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--no-progress",
               *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err and not out.exists()


def test_train_ids_decide_the_split(tiny_study, tmp_path):
    ids = [json.loads(x)["id"] for x in open(tiny_study["questions"], encoding="utf-8").read().splitlines()]
    (tmp_path / "train.json").write_text(json.dumps({"ids": ids[:2]}))
    opts = _opts(tiny_study, out=str(tmp_path / "s"), train_ids=str(tmp_path / "train.json"))
    qs = retrieve_questions(StudyRun(tmp_path / "s"), preflight.select_questions(opts.plan, opts.split),
                            opts.plan.top_k)
    assert {q for q, r in qs.items() if r["split"] == "train"} == set(ids[:2]) and len(qs) == len(ids)


def test_a_missing_question_file_is_named(tmp_path, capsys):
    assert main(["study", str(tmp_path / "q.jsonl"), "--model", "m", "--out", str(tmp_path / "o")]) == 2
    assert "QUESTIONS" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_batch_sizes_default_by_device_and_a_given_size_wins(tiny_study):
    cpu = StudyRun(tiny_study["root"] / "out", lm=ModelPart(tiny_study["model"], device="cpu"))
    sizes = cpu.sizes()
    assert (sizes.group, sizes.aug_batch, cpu.batch_size(None)) == (16, 8, 16) and cpu.model is None
    given = StudyRun(tiny_study["root"] / "out", lm=ModelPart(tiny_study["model"], device="cuda"))
    assert given.batch_size(_opts(tiny_study, device="cuda", batch_size=5).batching.batch_size) == 5
    assert given.batches is None  # a given size asks nothing of the device
    with pytest.raises(FcpragError, match="--aug-batch 0"):
        _opts(tiny_study, aug_batch=0).validate()


@pytest.mark.parametrize("content", [b'{"ids": 3}', b'{"ids": []}', b"\xff\xfe\x00bad"])
def test_a_controllers_unreadable_train_ids_are_one_line_naming_the_file(tiny_study, tmp_path, capsys, content):
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    (ctrl / "config.json").write_text("{}")
    (ctrl / "train_question_ids.json").write_bytes(content)
    out = tmp_path / "never"
    rc = main(["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--no-progress",
               "--controller", str(ctrl)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--controller {ctrl}: train_question_ids.json: expected JSON" in err
    assert not (out / "questions.jsonl").exists()


def test_too_few_training_questions_are_announced_before_any_work(tiny_study, caplog):
    runs = iter(range(3))

    def warned(**kw):
        opts = _opts(tiny_study, out=f"few{next(runs)}", **kw)
        run = StudyRun(tiny_study["root"] / opts.out)
        qs = retrieve_questions(run, preflight.select_questions(opts.plan, opts.split), opts.plan.top_k)
        caplog.clear()
        warn_if_too_few(run, qs, opts.train, opts.split, given=False)
        return [r.getMessage() for r in caplog.records if "too few for the risk rule" in r.getMessage()]

    msg = warned()  # 6 questions, half held out: 3 training questions
    assert len(msg) == 1 and msg[0].startswith("3 training questions") and "below about 35" in msg[0]
    assert "about 70 questions at --test-fraction 0.5" in msg[0]
    assert warned(train=study_training(scale_max_loss_share=0.6)) == []  # at 0.6, 3 questions suffice
    assert warned(train=study_training(kappa=2.0)) == []  # a fixed kappa: no rule to starve
