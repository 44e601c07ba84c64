"""The verdict a user acts on: decided on training questions only, shipped only above a margin, its power said, ties
said as ties, one runnable next command; the gold-passage ceiling row; the stratified split; ``fcprag report``."""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import random
import re
import shlex
import shutil
import types
from pathlib import Path

import pytest

from fcprag_tools.cli import main
from fcprag_tools.study import ceiling, data, stats
from fcprag_tools.study.adapters import EPOCHS, LEARNING_RATE, LORA
from fcprag_tools.study.verdict import markdown
from fcprag_tools.study.verdict.schema import check_summary
from fcprag_tools.study.stages.rows import held_out_rows

from .test_summary import build, synthetic

TABLE = Path(__file__).resolve().parents[3] / "benchmarks" / "efficacy" / "table"


def test_mde_and_questions_needed_match_a_hand_computation():
    # diffs +-1: mean 0, sd sqrt(4/3) = 1.154701; z_0.975 + z_0.8 = 1.959964 + 0.841621 = 2.801585
    d = stats.detectable([1.0, -1.0, 1.0, -1.0], 0.95, target=0.5)
    assert d["sd"] == pytest.approx(1.154701, abs=1e-6) and d["n_nonzero"] == 4
    assert d["mde"] == pytest.approx(2.801585 * 1.154701 / 2, abs=1e-5)  # 1.61750
    assert d["n_needed"] == 42  # (2.801585 * 1.154701 / 0.5)^2 = 41.86
    # at 99.17% (Bonferroni over six intervals): z_0.995833 = 2.638257
    assert stats.detectable([1.0, -1.0, 1.0, -1.0], 1 - 0.05 / 6, 0.5)["mde"] == pytest.approx(
        (2.638257 + 0.841621) * 1.154701 / 2, abs=1e-5)
    none = stats.detectable([0.0] * 5, 0.95, 0.03)  # no spread: nothing to size a test from
    assert none["mde"] is None and none["n_needed"] is None and none["n_nonzero"] == 0


def _tied(n=6):
    """Every row of every question answers F1 0 (a new user's two-question study, larger)."""
    qs, results = synthetic(n_test=n, n_train=n)
    for r in results.values():
        r["f1"] = r["em"] = r["acc"] = 0.0
    return qs, results


def test_a_planted_tie_is_said_as_a_tie_and_ends_in_one_command_per_decision(tmp_path):
    s, _, _ = build(tmp_path, qs_results=_tied())
    w = s["verdict"]["what_to_run"]
    assert w["row"] == "prag_sum" and "prag_sum" in w["tied"] and len(w["tied"]) == len(w["choice_f1"])
    assert w["vs_standard_rag"]["reading"] == "tie" and not w["vs_standard_rag"]["shown"]
    assert "vs_prag_sum" not in w  # never a row against itself
    text = (tmp_path / "report.md").read_text()
    assert "answers best" not in text and " tie on the 6 training questions" in text
    assert "(a tie)" in text  # the held-out comparison: the same F1 on every question
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]
    assert len(blocks) == 1 + len(s["datasets"])  # one per decision: overall and each dataset
    assert all("fcprag run prag -- src/inference.py" in b and b.removesuffix("; done").endswith(
        "--inference_method prag") and "ARGS" not in b for b in blocks)


PRAG_FLAGS = {"--model_name": str, "--max_new_tokens": int, "--dataset": str, "--num_train_epochs": int,
              "--learning_rate": float, "--inference_method": str, "--lora_rank": int, "--lora_alpha": int}


def prag_parse(words):
    """The arguments of PRAG's src/inference.py (its flag names, all required here): what the command gives it."""
    p = argparse.ArgumentParser()
    for flag, kind in PRAG_FLAGS.items():
        p.add_argument(flag, type=kind, required=True)
    return p.parse_args(words)


@pytest.mark.parametrize("row, method, controller", [
    ("prag_sum", "prag", None), ("prag_sum_combine", "combine", None), ("standard_rag", "icl", None),
    ("recommended", "prag", "OUT/controller"), ("recommended_combine", "combine", "OUT/controller_combine")])
def test_every_choice_has_a_command_to_paste_with_what_the_study_knows(row, method, controller):
    s = {"settings": {"out": "OUT", "controller_trained": True, "model": "/m/Qwen", "max_new_tokens": 24,
                      "model_name": "Qwen/Qwen2.5-1.5B-Instruct"},
         "datasets": {"hotpotqa": {}, "2wiki_dev": {}},
         "verdict": {"what_to_run": {"row": row}, "what_to_run_by_dataset": {"2wiki_dev": {"row": row}},
                     "settings": {"param": {"ship": "network"}, "combine": {"ship": "network"}}}}
    lines = markdown.next_steps(s)
    blocks = [lines[i + 1] for i, x in enumerate(lines) if x == "```bash"]
    assert len(blocks) == 2 and "ARGS" not in " ".join(lines)
    overall, wiki = blocks
    assert overall.startswith('for d in hotpotqa 2wikimultihopqa; do ') and overall.endswith("; done")
    words = shlex.split(wiki)
    head = ["fcprag", "run", "prag"] + (["--controller", controller, "--log", "fusion.jsonl"] if controller else [])
    assert words[:len(head) + 2] == head + ["--", "src/inference.py"]
    got = prag_parse(words[len(head) + 2:])
    assert (got.model_name, got.dataset, got.max_new_tokens, got.inference_method) == \
        ("qwen2.5-1.5b-instruct", "2wikimultihopqa", 24, method)  # PRAG's own names for the model and the data
    assert (got.lora_rank, got.lora_alpha, got.learning_rate, got.num_train_epochs) == \
        (LORA["r"], LORA["lora_alpha"], LEARNING_RATE, EPOCHS)  # the recipe the study trained its adapters with
    said = lines[-2]
    assert "PRAG checkout" in said and "cannot know" in said and said.count(". ") == 0  # one sentence


def test_no_retrieval_and_what_ships_without_answers_each_end_in_a_command():
    s = {"settings": {"out": "runs/s", "controller_trained": True, "model": "m", "max_new_tokens": 16},
         "datasets": {"hotpotqa": {}},
         "verdict": {"what_to_run": {"row": "vanilla"}, "what_to_run_by_dataset": {"hotpotqa": {"row": "vanilla"}},
                     "settings": {"param": {"ship": "network"}, "combine": {"ship": "prag_sum"}}}}
    lines = markdown.next_steps(s)
    assert lines[lines.index("```bash") + 1] == "fcprag study MORE_QUESTIONS.jsonl --model m --out runs/s-more"
    assert "MORE_QUESTIONS.jsonl: other questions" in lines[-2]
    s["verdict"]["what_to_run"] = None  # --no-generate: what ships (the param network) is the command
    lines = markdown.next_steps(s)
    assert lines.count("```bash") == 1 and "--controller runs/s/controller --log fusion.jsonl" in \
        lines[lines.index("```bash") + 1]
    s["verdict"]["settings"]["param"]["ship"] = "prag_sum"  # nothing but PRAG's sum ships
    assert "--controller" not in "".join(markdown.next_steps(s))


def _shuffle_held_out(qs, results, seed=1):
    """Every held-out row's gold log-lik. and F1 replaced by other values; training rows untouched."""
    r = random.Random(seed)
    out = copy.deepcopy(results)
    for k, row in out.items():
        if qs[k.split("|", 1)[0]]["split"] == "test":
            row["logprob"] = row["logprob"] + r.uniform(-1.0, 1.0)
            row["f1"] = r.random()
    return out


def _choices(s):
    v = s["verdict"]
    return ({k: (x["ship"], x["kappa"], x["recommended_row"], x["decided_on"]) for k, x in v["settings"].items()},
            v["what_to_run"]["row"], {d: c["row"] for d, c in v["what_to_run_by_dataset"].items()})


def test_changing_held_out_rows_moves_the_figures_but_no_choice(tmp_path):
    qs, results = synthetic()
    a, _, _ = build(tmp_path / "a", qs_results=(qs, results))
    b, _, _ = build(tmp_path / "b", qs_results=(qs, _shuffle_held_out(qs, results)))
    assert _choices(a) == _choices(b)
    assert a["verdict"]["settings"]["param"]["reweighting"]["delta"] != b["verdict"]["settings"]["param"][
        "reweighting"]["delta"]
    assert a["verdict"]["what_to_run"]["f1"] != b["verdict"]["what_to_run"]["f1"]


def test_gold_passage_weights_are_above_zero_exactly_on_the_supporting_passages():
    ps = [{"title": t} for t in ("A", "B", "C", "D")]
    w = ceiling.gold_passage_weights(ps, ["B", "D", "Z"])
    assert [x > 0 for x in w] == [False, True, False, True] and sum(w) == pytest.approx(4.0)  # PRAG's total
    assert ceiling.gold_passage_weights(ps, ["Z"]) == [1.0] * 4  # none retrieved: PRAG's sum
    assert ceiling.gold_passage_weights(ps, []) is None and ceiling.gold_passage_weights(ps, None) is None


def test_the_study_scores_the_ceiling_row_in_both_settings():
    uniform = types.SimpleNamespace(config=types.SimpleNamespace(kappa=1.0, controller_mode="uniform"))
    q = {"question": "?", "passages": [{"title": "A"}, {"title": "B"}, {"title": "C"}], "supporting_titles": ["C"]}
    rows = held_out_rows(q, {"param": uniform, "combine": uniform}, [2.0], None, lambda pid: None)
    assert rows["gold_passages"] == ("param", [0.0, 0.0, 3.0])
    assert rows["gold_passages_combine"] == ("combine", [0.0, 0.0, 3.0])
    assert "gold_passages" not in held_out_rows({**q, "supporting_titles": []}, {"param": uniform}, [2.0], None,
                                                lambda pid: None)


def test_the_report_says_how_much_of_the_ceiling_the_network_reaches(tmp_path):
    qs, results = synthetic()
    for k, r in list(results.items()):
        q, name = k.split("|", 1)
        if name in ("prag_sum", "prag_sum_combine"):
            results[f"{q}|gold_passages{name[8:]}"] = {**r, "id": f"{q}|gold_passages{name[8:]}",
                                                       "logprob": r["logprob"] + 0.4}
            if name == "prag_sum":
                results[f"{q}|learned"] = {**results[f"{q}|learned"], "logprob": r["logprob"] + 0.1}
    s, _, _ = build(tmp_path, qs_results=(qs, results))
    c = s["ceiling"]["settings"]["param"]
    assert c["gold"] == pytest.approx(0.4) and c["learned"] == pytest.approx(0.1) and c["share"] == pytest.approx(0.25)
    assert "reaches 25.0% of it" in (tmp_path / "report.md").read_text()
    assert s["ceiling"]["settings"]["combine"]["learned"] is None  # no network measured there


def test_the_stratified_split_gives_every_subtask_its_share():
    qs = [{"id": f"{d}{s}{i}", "dataset": d, "subtask": s} for d, subs in (("h", {"b": 79, "c": 21}),
                                                                          ("w", {"i": 14, "c": 17}))
          for s, n in subs.items() for i in range(n)]
    test = data.stratified_split(qs, 0.5, 0)
    assert len(test) == round(0.5 * len(qs))
    for d, s, n in (("h", "b", 79), ("h", "c", 21), ("w", "i", 14), ("w", "c", 17)):
        k = sum(q["id"] in test for q in qs if (q["dataset"], q["subtask"]) == (d, s))
        assert int(0.5 * n) <= k <= int(0.5 * n) + 1, (d, s, k)
    assert test == data.stratified_split(list(reversed(qs)), 0.5, 0) != data.stratified_split(qs, 0.5, 1)
    two = [{"id": "a", "dataset": "x", "subtask": "all"}, {"id": "b", "dataset": "y", "subtask": "all"}]
    assert len(data.stratified_split(two, 0.9, 0)) == 1  # both sides kept
    settings = {"seed": 0, "test_fraction": 0.5}
    assert data.split_method(qs, test, settings).startswith("stratified")
    assert data.split_method(qs, data.split([q["id"] for q in qs], 0.5, 0), settings).startswith("a seeded shuffle")


def _copy_table(dest):
    for name in ("settings.json", "summary.json", "questions.jsonl.gz", "eval.jsonl.gz"):
        shutil.copy(TABLE / name, dest / name)
    return dest


def test_fcprag_report_rebuilds_the_table_study_and_held_out_changes_move_no_choice(tmp_path, capsys):
    a = _copy_table(tmp_path)
    assert main(["report", str(a)]) == 0, capsys.readouterr().err
    s = json.loads((a / "summary.json").read_text())
    assert check_summary(s) == []
    for k, v in s["verdict"]["settings"].items():  # the +0.0001 network does not ship at the 0.02 margin
        assert v["ship"] == "prag_sum" and v["margins"] == {"reweighting": 0.02, "scale": 0.02}
        assert v["decided_on"].startswith("100 training questions") and v["reweighting"]["equivalent"]
    w = s["verdict"]["what_to_run"]
    assert w["target_f1"] == 0.03 and round(100 * w["vs_standard_rag"]["mde_f1"], 1) == 7.3  # as the issue says
    assert w["vs_standard_rag"]["n_needed"] == 596
    by = s["verdict"]["what_to_run_by_dataset"]
    assert round(100 * by["hotpotqa"]["vs_standard_rag"]["mde_f1"], 1) == 8.5
    assert round(100 * by["2wiki"]["vs_standard_rag"]["mde_f1"], 1) == 16.5
    said = ("+2.7 [-2.9, +8.7]: not shown (14 of 100 questions differ; with 100 questions only a true difference of "
            "about 7.3 points or more would have been detected with 80% power; about 596 questions are needed for 3 "
            "points)")  # the minimum detectable effect the right way round
    text = (a / "report.md").read_text()
    assert said in text and "no difference above" not in text and "ARGS" not in text
    qs = {json.loads(x)["id"]: json.loads(x) for x in gzip.open(a / "questions.jsonl.gz", "rt")}
    rows = {json.loads(x)["id"]: json.loads(x) for x in gzip.open(a / "eval.jsonl.gz", "rt")}
    with gzip.open(a / "eval.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in _shuffle_held_out(qs, rows).values())
    assert main(["report", str(a), "--target-f1", "0.05"]) == 0
    s2 = json.loads((a / "summary.json").read_text())
    assert _choices(s2) == _choices(s) and s2["verdict"]["what_to_run"]["target_f1"] == 0.05
    assert s2["verdict"]["what_to_run"]["f1"] != w["f1"]
    assert s2["verdict"]["settings"]["param"]["total"]["delta"] != s["verdict"]["settings"]["param"]["total"]["delta"]


def test_fcprag_report_refuses_a_folder_that_is_not_a_study_in_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a folder" in err
    (tmp_path / "settings.json").write_text(json.dumps({"questions_sha256": "x", "model": "m"}))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "questions.jsonl" in err
    assert main(["report", str(tmp_path), "--target-f1", "0"]) == 2
    assert "--target-f1" in capsys.readouterr().err


@pytest.mark.slow  # a whole tiny study (augmentation, adapters, evaluation: about 30 s); the fast wiring test is above
def test_a_fresh_study_with_a_given_controller_scores_the_ceiling_on_the_supporting_passages(tiny_study, capsys):
    from fcprag_plugin import FusionController

    from .conftest import write_questions

    path = write_questions(tiny_study["root"] / "sup.jsonl", 4, passages=3, seed=3)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for i, r in enumerate(rows):  # one supporting title each, and one question whose support is not retrievable
        r["supporting_titles"] = ["nowhere"] if i == 0 else [r["passages"][i % 3].partition(": ")[0]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctrl = tiny_study["root"] / "ctrl"
    FusionController.scale_only(2.0, embed_dim=384, embedding_model="sentence-transformers/all-MiniLM-L6-v2"
                                ).save_pretrained(ctrl)
    out = tiny_study["root"] / "given"
    assert main(["study", str(path), "--model", tiny_study["model"], "--out", str(out), "--top-k", "2",
                 "--scales", "2", "--max-new-tokens", "2", "--no-progress", "--no-arrow", "--device", "cpu",
                 "--controller", str(ctrl)]) == 0, capsys.readouterr().err
    qs = {json.loads(x)["id"]: json.loads(x) for x in (out / "questions.jsonl").read_text().splitlines()}
    ev = {json.loads(x)["id"]: json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()}
    for q, r in qs.items():
        support = [p["title"] in r["supporting_titles"] for p in r["passages"]]
        for name, prompt in (("gold_passages", "param"), ("gold_passages_combine", "combine")):
            w = ev[f"{q}|{name}"]["w"]
            assert ev[f"{q}|{name}"]["prompt"] == prompt
            assert [x > 0 for x in w] == support if any(support) else w == [1.0, 1.0]
    s = json.loads((out / "summary.json").read_text())
    assert "gold_passages" in s["methods"] and s["ceiling"]["why_absent"] is None
    # the same command with another margin on the finished study: re-reported from its rows, nothing recomputed
    eval_before = (out / "eval.jsonl").read_text()
    assert main(["study", str(path), "--model", tiny_study["model"], "--out", str(out), "--top-k", "2",
                 "--scales", "2", "--max-new-tokens", "2", "--no-progress", "--no-arrow", "--device", "cpu",
                 "--controller", str(ctrl), "--min-gain", "0.5"]) == 0
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["policy"]["min_gain"] == 0.5 and s2["verdict"]["margins"]["reweighting"] == 0.5
    assert (out / "eval.jsonl").read_text() == eval_before


def test_no_generate_says_at_the_start_what_the_report_will_lack(tmp_path, capsys, monkeypatch):
    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.study import pipeline

    def stop(opts):
        raise FcpragError("stopped before any work")

    monkeypatch.setattr(pipeline, "study", stop)
    q = tmp_path / "q.jsonl"
    q.write_text("{}\n")
    assert main(["study", str(q), "--out", str(tmp_path / "o"), "--no-generate"]) == 2
    err = capsys.readouterr().err
    assert err.index("--no-generate: no greedy answers, so report.md will have no F1/EM table, no plot and no "
                     "'what to run'") < err.index("stopped before any work")


def test_fcprag_report_on_unfinished_rows_is_one_line(tmp_path, capsys):
    a = _copy_table(tmp_path)
    rows = [json.loads(x) for x in gzip.open(a / "eval.jsonl.gz", "rt")]
    with gzip.open(a / "eval.jsonl.gz", "wt") as f:  # the rows scored after the verdict are not there yet
        f.writelines(json.dumps(r) + "\n" for r in rows if "random_controller" not in r["id"])
    assert main(["report", str(a)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "do not make a complete summary" in err and "random_controller" in err


def test_a_no_generate_report_says_what_it_lacks_and_still_ends_in_one_command(tmp_path):
    qs, results = synthetic()
    for r in results.values():
        r["f1"] = r["em"] = r["acc"] = None
    s, _, _ = build(tmp_path, qs_results=(qs, results))
    assert s["verdict"]["what_to_run"] is None
    s["settings"]["generate"] = False
    text = markdown.report(s)
    assert "Run with --no-generate" in text and text.count("```bash") == 1
    assert "fcprag run prag --controller" in text  # the param network ships (its CV above the margin)
