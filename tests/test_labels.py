"""Label files: parsing (JSON Lines and JSON array), validation errors naming file/line/field, skip mode."""

import json

import pytest

from fcprag_plugin.errors import LabelFileError
from fcprag_plugin.labels import load_labels, validate_record
from fcprag_tools.synthetic import write_labels


def rec(i=0, **kw):
    r = {"id": f"q{i}", "query": f"question {i}?", "passages": [f"passage {i} a", f"passage {i} b"],
         "deltas": [0.5, -0.25]}
    r.update(kw)
    return {k: v for k, v in r.items() if v is not _DROP}


_DROP = object()


def write_jsonl(path, objs, raw_lines=None):
    lines = [json.dumps(o) for o in objs] if raw_lines is None else raw_lines
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_and_array_give_the_same_records(tmp_path):
    objs = [rec(0), rec(1, metric_all=0.8, metric_without=[0.3, 1.0], deltas=_DROP),
            rec(2, group="g", split="train", answer=["x", "y"], metric="f1", adapters=["a0", "a1"], note="kept")]
    a = load_labels(write_jsonl(tmp_path / "l.jsonl", objs))
    arr = tmp_path / "l.json"
    arr.write_text(json.dumps(objs, indent=2), encoding="utf-8")
    b = load_labels(arr)
    assert [r.id for r in a] == [r.id for r in b] == ["q0", "q1", "q2"]
    for x, y in zip(a, b):
        assert (x.query, x.passages, x.deltas, x.group, x.split, x.extra) == \
               (y.query, y.passages, y.deltas, y.group, y.split, y.extra)
    # deltas from metrics: metric_all - metric_without_i (independently recomputed)
    assert a.records[1].deltas == pytest.approx([0.8 - 0.3, 0.8 - 1.0])
    assert a.records[2].extra == {"note": "kept"} and a.records[2].answer == ["x", "y"]
    # line numbers: JSONL one per line; the array's elements start on distinct lines
    assert [r.line for r in a] == [1, 2, 3]
    text_lines = arr.read_text().splitlines()
    for r in b:
        assert text_lines[r.line - 1].strip() == "{", (r.line, text_lines[r.line - 1])
    assert len({r.line for r in b}) == 3


def test_blank_lines_are_ignored_and_numbering_is_physical(tmp_path):
    p = write_jsonl(tmp_path / "l.jsonl", None, ["", json.dumps(rec(0)), "   ", json.dumps(rec(1))])
    ls = load_labels(p)
    assert [r.line for r in ls] == [2, 4]


# ---------------------------------------------------------------------------------------------- errors
BAD = [
    # (record, field named in the message, fragment of the explanation)
    (rec(id=_DROP), "id", "missing"),
    (rec(id=3), "id", "expected a non-empty string"),
    (rec(query=""), "query", "empty"),
    (rec(query=["q"]), "query", "expected a non-empty string"),
    (rec(passages="one passage"), "passages", "expected a list"),
    (rec(passages=[]), "passages", "at least one"),
    (rec(passages=["fine", "  "]), "passages[1]", "empty"),
    (rec(passages=["fine", 5]), "passages[1]", "expected a non-empty string"),
    (rec(deltas=[0.1, 0.2, 0.3]), "deltas", "has 3 values but 'passages' has 2"),
    (rec(deltas=[0.1]), "deltas", "has 1 values but 'passages' has 2"),
    (rec(deltas="0.1,0.2"), "deltas", "expected a list of 2 numbers"),
    (rec(deltas=[0.1, "0.2"]), "deltas[1]", "expected a finite number"),
    (rec(deltas=[True, 0.2]), "deltas[0]", "expected a finite number"),
    (rec(deltas=[0.1, None]), "deltas[1]", "expected a finite number"),
    (rec(deltas=_DROP), "deltas", "is missing"),
    (rec(deltas=_DROP, metric_all=0.5), "metric_without", "missing"),
    (rec(deltas=_DROP, metric_without=[0.1, 0.2]), "metric_all", "missing"),
    (rec(deltas=_DROP, metric_all="high", metric_without=[0.1, 0.2]), "metric_all", "expected a finite number"),
    (rec(deltas=_DROP, metric_all=1.0, metric_without=[0.1]), "metric_without", "has 1 values"),
    (rec(metric_all=1.0, metric_without=[0.1, 0.2], deltas=[0.9, 0.5]), "deltas[1]", "expected them to agree"),
    (rec(adapters=["only/one"]), "adapters", "expected a list of 2 paths"),
    (rec(adapters=["a", ""]), "adapters[1]", "empty"),
    (rec(answer=5), "answer", "expected a string or a list of strings"),
    (rec(metric=1), "metric", "expected a non-empty string"),
    (rec(group=[1]), "group", "expected a string or an integer"),
    (rec(group=True), "group", "expected a string or an integer"),
    (rec(split="training"), "split", "expected one of"),
]


@pytest.mark.parametrize("bad,field,fragment", BAD, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD)])
def test_each_validation_error_names_file_line_and_field(tmp_path, bad, field, fragment):
    p = write_jsonl(tmp_path / "labels.jsonl", [rec(0), rec(1), bad, rec(3)])
    with pytest.raises(LabelFileError) as ei:
        load_labels(p)
    msg = str(ei.value)
    assert f"{p}:3:" in msg, msg
    assert f"field '{field}'" in msg, msg
    assert fragment in msg, msg


def test_non_finite_numbers_are_rejected(tmp_path):
    # Python's json reads NaN / Infinity / -Infinity; the label file must not smuggle them in
    for i, token in enumerate(["NaN", "Infinity", "-Infinity"]):
        p = write_jsonl(tmp_path / f"nf{i}.jsonl", None, [
            json.dumps(rec(0)),
            f'{{"id": "x", "query": "q", "passages": ["a", "b"], "deltas": [0.1, {token}]}}'])
        with pytest.raises(LabelFileError) as ei:
            load_labels(p)
        msg = str(ei.value)
        assert f"{p}:2:" in msg and "field 'deltas[1]'" in msg and "finite" in msg, msg
    p = write_jsonl(tmp_path / "nf_metric.jsonl", None, [
        '{"id": "x", "query": "q", "passages": ["a"], "metric_all": NaN, "metric_without": [0.0]}'])
    with pytest.raises(LabelFileError, match=r"nf_metric.jsonl:1: field 'metric_all'.*finite"):
        load_labels(p)
    # finite inputs whose difference overflows
    p = write_jsonl(tmp_path / "overflow.jsonl", [rec(0, deltas=_DROP, metric_all=1.7e308,
                                                       metric_without=[-1.7e308, 0.0])])
    with pytest.raises(LabelFileError, match=r"overflow.jsonl:1: field 'metric_without'.*not finite"):
        load_labels(p)


def test_duplicate_id_names_both_lines(tmp_path):
    p = write_jsonl(tmp_path / "dup.jsonl", [rec(0), rec(1), rec(0)])
    with pytest.raises(LabelFileError) as ei:
        load_labels(p)
    msg = str(ei.value)
    assert f"{p}:3:" in msg and "field 'id'" in msg and "'q0'" in msg and "line 1" in msg, msg


def test_not_an_object_and_bad_json(tmp_path):
    p = write_jsonl(tmp_path / "l.jsonl", None, [json.dumps(rec(0)), "[1, 2]"])
    with pytest.raises(LabelFileError, match=r"l.jsonl:2: record is a list, expected a JSON object"):
        load_labels(p)
    p = write_jsonl(tmp_path / "broken.jsonl", None, [json.dumps(rec(0)), '{"id": "q1", "query": '])
    with pytest.raises(LabelFileError, match=r"broken.jsonl:2: not valid JSON"):
        load_labels(p)


def test_json_array_errors_name_the_element_line(tmp_path):
    objs = [rec(0), rec(1), rec(2, deltas=[0.1])]
    p = tmp_path / "arr.json"
    p.write_text(json.dumps(objs, indent=1), encoding="utf-8")
    lines = p.read_text().splitlines()
    third_start = [i + 1 for i, line in enumerate(lines) if line.strip() == "{"][2]
    with pytest.raises(LabelFileError) as ei:
        load_labels(p)
    assert f"{p}:{third_start}: field 'deltas'" in str(ei.value)
    # a syntax error inside an array cannot be skipped: it always fails, with its line
    p2 = tmp_path / "arr_broken.json"
    p2.write_text('[\n{"id": "a", "query": "q", "passages": ["p"], "deltas": [0]},\n{"id": oops}\n]', encoding="utf-8")
    with pytest.raises(LabelFileError, match=r"arr_broken.json:3: not valid JSON"):
        load_labels(p2, on_error="skip")
    p3 = tmp_path / "arr_tail.json"
    p3.write_text('[{"id": "a", "query": "q", "passages": ["p"], "deltas": [0]}]\n{"x": 1}', encoding="utf-8")
    with pytest.raises(LabelFileError, match=r"arr_tail.json:2: unexpected text after"):
        load_labels(p3)


def test_file_level_errors(tmp_path):
    with pytest.raises(LabelFileError, match=r"missing.jsonl: label file not found"):
        load_labels(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n \n", encoding="utf-8")
    with pytest.raises(LabelFileError, match=r"empty.jsonl: label file is empty"):
        load_labels(tmp_path / "empty.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(json.dumps(rec(0)).encode() + b"\n" + b'{"id": "caf\xe9"}\n')
    with pytest.raises(LabelFileError, match=r"latin.jsonl:2: not valid UTF-8"):
        load_labels(tmp_path / "latin.jsonl")
    with pytest.raises(LabelFileError, match=r"on_error is 'ignore'"):
        load_labels(tmp_path / "latin.jsonl", on_error="ignore")


def test_skip_mode_counts_and_keeps_good_records_unchanged(tmp_path):
    objs = [rec(0), rec(1, deltas=[0.1]), rec(2), rec(3, query=""), rec(0), None, rec(6)]
    lines = [json.dumps(o) for o in objs[:5]] + \
            ['{"id": "q5", "query": "x", "passages": ["a", "b"], "deltas": [0.1, Infinity]}', "{not json",
             json.dumps(objs[6])]
    p = write_jsonl(tmp_path / "mixed.jsonl", None, lines)
    ls = load_labels(p, on_error="skip")
    assert [r.id for r in ls] == ["q0", "q2", "q6"]
    assert [r.deltas for r in ls] == [[0.5, -0.25]] * 3
    assert [(s.line, s.field) for s in ls.skipped] == [(2, "deltas"), (4, "query"), (5, "id"), (6, "deltas[1]"),
                                                      (7, None)]
    assert ls.skip_counts() == {"deltas": 1, "query": 1, "id": 1, "deltas[1]": 1, "<json>": 1}
    assert all(s.message.startswith(f"{p}:{s.line}:") for s in ls.skipped)
    assert "5 skipped" in ls.summary()
    with pytest.raises(LabelFileError, match=r"mixed.jsonl:2: field 'deltas'"):
        load_labels(p)  # fail mode stops at the first one


def test_skip_mode_with_nothing_left_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "allbad.jsonl", [rec(0, deltas=[1.0]), rec(1, passages=[])])
    with pytest.raises(LabelFileError, match=r"allbad.jsonl: no valid records \(2 skipped"):
        load_labels(p, on_error="skip")


def test_group_int_is_kept_as_its_string_and_used_for_splits():
    r = validate_record(rec(0, group=12))
    assert r.group == "12" and r.group_key == "group:12"
    assert validate_record(rec(1)).group_key == "id:q1"


def test_schema_file_matches_the_parser():
    import importlib.resources as ir

    schema = json.loads(ir.files("fcprag_plugin").joinpath("schemas/labels.schema.json").read_text("utf-8"))
    from fcprag_plugin.labels import KNOWN_SPLITS, OPTIONAL, REQUIRED

    assert set(schema["required"]) == set(REQUIRED)
    assert set(schema["properties"]) == set(REQUIRED) | set(OPTIONAL)
    assert set(schema["properties"]["split"]["enum"]) == set(KNOWN_SPLITS)
    import jsonschema  # the test extra

    jsonschema.validate(rec(0), schema)
    jsonschema.validate(rec(1, deltas=_DROP, metric_all=1.0, metric_without=[0.0, 0.5]), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rec(2, deltas=_DROP), schema)


def test_f1_scale_labels_are_read_and_checked(tmp_path):
    """Answer-level scale labels: f1_at_scales with scales and f1_all; every bad form is one message naming the
    file, the line and the field."""
    good = rec(0, metric_all=-1.0, metric_without=[-1.5, -1.1], scales=[0.5, 1, 2], metric_at_scales=[-2, -1, -0.5],
               f1_all=0.5, f1_at_scales=[0.0, 0.5, 1.0])
    good.pop("deltas", None)
    path = write_jsonl(tmp_path / "ok.jsonl", [good])
    r = load_labels(path).records[0]
    assert r.f1_all == 0.5 and r.f1_at_scales == [0.0, 0.5, 1.0] and "f1_all" not in r.extra
    assert r.f1_scale_gains == {0.5: -0.5, 1.0: 0.0, 2.0: 0.5}
    assert json.loads((write_labels([r], tmp_path / "back.jsonl")).read_text())["f1_at_scales"] == [0.0, 0.5, 1.0]
    for change, field, what in (({"f1_all": None}, "f1_all", "is missing"),
                                ({"f1_at_scales": [0.0, 0.5]}, "f1_at_scales", "has 2 values but 'scales' has 3"),
                                ({"f1_at_scales": [0.0, 1.5, 1.0]}, "f1_at_scales[1]", "expected an F1 in [0, 1]"),
                                ({"f1_all": 2.0}, "f1_all", "expected an F1 in [0, 1]"),
                                ({"scales": None, "metric_at_scales": None}, "scales", "is missing")):
        bad = {k: v for k, v in {**good, **change}.items() if v is not None}
        p = write_jsonl(tmp_path / "bad.jsonl", [bad])
        with pytest.raises(LabelFileError) as e:
            load_labels(p)
        assert str(e.value).startswith(f"{p}:1: field '{field}': ") and what in str(e.value), (change, str(e.value))
