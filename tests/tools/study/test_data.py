"""Question files (shared schema, PRAG's layout), the split, BM25 and a user's retrieval file, the augmentation's
parser, and the resumable unit store."""

from __future__ import annotations

import json

import pytest

from fcprag_plugin.errors import FcpragError
from fcprag_tools.lm.shard import ShardInfo
from fcprag_tools.study import augment, data
from fcprag_tools.lm.units import UnitStore


def test_shared_schema_and_prag_layout_read_alike(tmp_path):
    shared = {"id": "a", "question": "Who?", "answer": "Bo", "passages": ["T1: x y.", "T2: z."],
              "titles": ["T1", "T2"], "supporting_titles": ["T2"]}
    (tmp_path / "s.jsonl").write_text(json.dumps(shared) + "\n")
    prag = [{"_id": "a", "question": "Who?", "answer": "Bo", "context": [["T1", ["x ", "y."]], ["T2", ["z."]]],
             "supporting_facts": [["T2", 0]]}]
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "s.json").write_text(json.dumps(prag))
    a, b = data.read_questions(tmp_path / "s.jsonl"), data.read_questions(tmp_path / "p" / "s.json")
    assert a == b and a[0]["passages"] == ["T1: x y.", "T2: z."] and a[0]["answers"] == ["Bo"]
    assert a[0]["dataset"] == "s" and a[0]["subtask"] == "all"


def test_popqa_and_complexwebquestions_files_read_without_passages(tmp_path):
    popqa = [{"id": 7, "question": "What is Bo's occupation?", "possible_answers": '["singer", "vocalist"]'}]
    cwq = [{"ID": "WebQTrn-1", "question": "Who?", "answers": [{"answer": "Ann", "aliases": ["A.", "Ann"]}]}]
    (tmp_path / "popqa.json").write_text(json.dumps(popqa))
    (tmp_path / "cwq.json").write_text(json.dumps(cwq))
    p, c = data.read_questions(tmp_path / "popqa.json")[0], data.read_questions(tmp_path / "cwq.json")[0]
    assert (p["id"], p["answers"], p["passages"], p["dataset"]) == ("7", ["singer", "vocalist"], None, "popqa")
    assert (c["id"], c["answers"], c["passages"], c["dataset"]) == ("WebQTrn-1", ["Ann", "A."], None, "cwq")


def test_several_files_keep_their_datasets_and_subtasks_and_refuse_a_shared_id(tmp_path):
    rec = lambda i, **kw: json.dumps({"id": i, "question": "q", "answer": "a", "passages": ["T: p"], **kw})  # noqa
    (tmp_path / "hot.jsonl").write_text(rec("a", type="bridge") + "\n" + rec("b", dataset="other") + "\n")
    (tmp_path / "wiki.jsonl").write_text(rec("c", type="inference") + "\n")
    qs = data.read_question_files([tmp_path / "hot.jsonl", tmp_path / "wiki.jsonl"])
    assert [(q["id"], q["dataset"], q["subtask"]) for q in qs] == [("a", "hot", "bridge"), ("b", "other", "all"),
                                                                  ("c", "wiki", "inference")]
    (tmp_path / "dup.jsonl").write_text(rec("a") + "\n")
    with pytest.raises(FcpragError, match="dup.jsonl: field 'id': question id 'a' is also in .*hot.jsonl"):
        data.read_question_files([tmp_path / "hot.jsonl", tmp_path / "dup.jsonl"])


@pytest.mark.parametrize("line,culprit", [({"id": "a", "question": "q", "passages": ["p"]}, "'answer'"),
                                          ({"id": "a", "question": "q", "answer": "x", "passages": "p"},
                                           "'passages'")])
def test_a_bad_question_names_the_file_line_and_field(tmp_path, line, culprit):
    (tmp_path / "q.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(FcpragError, match=f"q.jsonl:1: field {culprit}"):
        data.read_questions(tmp_path / "q.jsonl")


def test_split_is_seeded_and_keeps_both_sides():
    ids = [f"q{i}" for i in range(10)]
    t = data.split(ids, 0.3, 0)
    assert len(t) == 3 and t == data.split(list(reversed(ids)), 0.3, 0) and t != data.split(ids, 0.3, 1)
    assert len(data.split(["a", "b"], 0.9, 0)) == 1


@pytest.mark.parametrize("text", ['{"ids": ["q1", "q3"]}', '["q1", "q3"]', "q1\n\nq3\n"])
def test_train_ids_read_in_each_format_and_hold_out_the_rest(tmp_path, text, caplog):
    (tmp_path / "ids").write_text(text)
    train = data.read_ids(tmp_path / "ids")
    assert train == ["q1", "q3"]
    assert data.split_by_ids(["q0", "q1", "q2", "q3"], train + ["elsewhere"], "--train-ids ids") == {"q0", "q2"}
    assert "1 listed id(s) are not among the questions" in caplog.text


@pytest.mark.parametrize("ids,needle", [(["x"], "none of the questions' ids"), (["a", "b"], "every one of")])
def test_a_split_by_ids_without_both_sides_is_refused(ids, needle):
    with pytest.raises(FcpragError, match=needle):
        data.split_by_ids(["a", "b"], ids, "--train-ids f")


def test_an_ids_file_without_ids_is_named(tmp_path):
    (tmp_path / "ids.json").write_text('{"ids": []}')
    with pytest.raises(FcpragError, match="--train-ids .*ids.json: expected JSON"):
        data.read_ids(tmp_path / "ids.json")


def test_bm25_ranks_the_matching_passage_first_and_a_given_file_is_used_as_is():
    pytest.importorskip("bm25s")
    q = {"question": "Which river flows through Paris?", "passages": ["Berlin: a city.", "Seine: the river of Paris.",
                                                                      "Rome: old city."], "supporting": ["Seine"]}
    top = data.retrieve(q, 2)
    assert top[0]["title"] == "Seine" and top[0]["supporting"] and top[0]["pid"] == data.passage_id(q["passages"][1])
    given = data.retrieve(q, 2, {"passages": ["Rome: old city.", "Berlin: a city."], "scores": [2.0, 1.0]})
    assert [p["title"] for p in given] == ["Rome", "Berlin"] and [p["rank"] for p in given] == [0, 1]


def test_parse_qa_json_then_lines_then_fallback_pairs_from_the_passage_only():
    assert augment.parse_qa('x [{"question": "Who?", "answer": "Bo"}] y') == [
        {"question": "Who?", "answer": "Bo", "source": "model-json"}]
    assert augment.parse_qa("Question: Where?\nAnswer: Paris")[0]["source"] == "model-lines"
    pairs = augment.complete_pairs([], "Eiffel: The tower was built in 1889. It stands in Paris.")
    assert pairs[0]["question"] == "What do you know about Eiffel?"
    assert {p["answer"] for p in pairs[1:]} == {"1889", "Paris"}
    assert all(p["answer"] in "Eiffel: The tower was built in 1889. It stands in Paris." for p in pairs)


def test_unit_store_drops_a_partial_line_and_merges_parts(tmp_path):
    st = UnitStore(tmp_path / "s.jsonl")
    st.append([{"id": "a", "v": 1}])
    with open(tmp_path / "s.jsonl", "a") as f:
        f.write('{"id": "b", "v"')  # a killed process
    assert list(st.done()) == ["a"]
    assert (tmp_path / "s.jsonl").read_text() == '{"id": "a", "v": 1}\n'
    for r in range(2):
        UnitStore(tmp_path / "s.jsonl", ShardInfo(r, 2)).append([{"id": f"p{r}", "v": r}])
    assert set(st.done()) == {"a", "p0", "p1"}
    st.merge()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"] and set(st.done()) == {"a", "p0", "p1"}


def test_augmentation_out_of_device_memory_goes_on_in_halves(monkeypatch, caplog):
    """A simulated out-of-memory error for generate calls of more than 2 prompts: the batch of 3 passages (6 prompts)
    is generated one passage at a time, one log line, the same rows as without the error."""
    import logging

    import torch

    from fcprag_tools.lm import batched
    from helpers import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama", bos_token_id=2, eos_token_id=3, pad_token_id=0), tiny_tokenizer()
    items = [("p1", "paris : the city of france is paris ."), ("p2", "berlin : a city in germany ."),
             ("p3", "rome : the king of italy was born in rome .")]
    want = augment.augment_batch(model, tok, items, max_new_tokens=6)
    real, sizes = batched.batched_greedy, []

    def greedy(m, t, prompts, *a, **k):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(m, t, prompts, *a, **k)

    monkeypatch.setattr(batched, "batched_greedy", greedy)
    with caplog.at_level(logging.WARNING):
        got = augment.augment_batch(model, tok, items, max_new_tokens=6)
    assert sizes == [6, 2, 2, 2]
    assert [r.getMessage() for r in caplog.records if "out of device memory" in r.getMessage()] == [
        "augmentation: out of device memory at a batch of 3; going on with batches of 1"]
    assert got == want
