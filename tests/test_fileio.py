"""fileio.read_records: the one reader of JSON-array-or-JSON-Lines files (labels, PRAG's data, manifests' PRAG
input, the study's questions), against json.loads of each record; errors name file:line."""

import json

import pytest

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_records

RECS = [{"id": "a", "q": "x\u2028y"}, [1, 2], {"id": "c", "nested": {"k": [3]}}]


def test_an_array_and_json_lines_give_the_same_records_with_their_lines(tmp_path):
    lines = tmp_path / "r.jsonl"
    lines.write_text("\n" + "\n\n".join(json.dumps(r, ensure_ascii=False) for r in RECS) + "\n", encoding="utf-8")
    arr = tmp_path / "r.json"  # '[' first: an array, whatever the suffix; elements start on lines 2, 3 and 6
    arr.write_text("\ufeff [\n" + json.dumps(RECS[0]) + ",\n" + json.dumps(RECS[1], indent=1) + "  ,\n"
                   + json.dumps(RECS[2]) + "\n]\n", encoding="utf-8")
    assert read_records(lines, FcpragError) == [(2, RECS[0]), (4, RECS[1]), (6, RECS[2])]
    assert read_records(arr, FcpragError) == [(2, RECS[0]), (3, RECS[1]), (7, RECS[2])]
    assert [r for _, r in read_records(arr, FcpragError)] == json.loads(arr.read_text(encoding="utf-8-sig"))
    empty = tmp_path / "e.json"
    empty.write_text("[ ]")
    assert read_records(empty, FcpragError) == []


@pytest.mark.parametrize("text, where", [
    ('{"a": 1}\n{oops\n', ":2: not valid JSON"),
    ('[\n{"a": 1},\n{oops}\n]', ":3: not valid JSON"),
    ('[\n{"a": 1},\n]', ":3: not valid JSON"),  # a ',' before the closing ']'
    ('[\n{"a": 1}\n{"b": 2}]', ":3: not valid JSON"),  # no ',' between elements
    ('[{"a": 1}]\nmore', ":2: unexpected text after the closing ']' of the array"),
    ('[{"a": 1}', ":1: not valid JSON"),
])
def test_errors_name_the_file_and_line(tmp_path, text, where):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(FcpragError) as e:
        read_records(f, FcpragError)
    assert str(e.value).startswith(f"{f}{where}"), str(e.value)
    with pytest.raises(json.JSONDecodeError):  # the reference agrees the file is not JSON (Lines)
        [json.loads(ln) for ln in text.splitlines() if ln.strip()] if text[0] != "[" else json.loads(text)


def test_invalid_utf8_names_the_line(tmp_path):
    f = tmp_path / "latin.jsonl"
    f.write_bytes(b'{"a": 1}\n{"b": "caf\xe9"}\n')
    with pytest.raises(FcpragError, match=r"latin\.jsonl:2: not valid UTF-8"):
        read_records(f, FcpragError)


def test_a_gzipped_file_reads_as_the_plain_one_and_a_corrupt_one_is_named(tmp_path):
    import gzip

    from fcprag_plugin.errors import LabelFileError
    from fcprag_plugin.training import load_labels
    from fcprag_tools.synthetic import synthetic_records, write_labels

    plain = tmp_path / "r.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in RECS) + "\n", encoding="utf-8")
    packed = tmp_path / "r.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_records(packed, FcpragError) == read_records(plain, FcpragError) == [(1, RECS[0]), (2, RECS[1]),
                                                                                     (3, RECS[2])]
    labels = write_labels(synthetic_records(4, 2, 8, seed=1)[0], tmp_path / "labels.jsonl")
    (tmp_path / "labels.jsonl.gz").write_bytes(gzip.compress(labels.read_bytes()))
    a, b = load_labels(labels), load_labels(tmp_path / "labels.jsonl.gz")
    assert [r.id for r in b.records] == [r.id for r in a.records] and b.sha256 == a.sha256
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"a": 1}\n')[:-6])  # truncated
    with pytest.raises(FcpragError, match=r"bad\.jsonl\.gz: not a readable gzip file"):
        read_records(bad, FcpragError)
    with pytest.raises(LabelFileError, match=r"bad\.jsonl\.gz: not a readable gzip file"):
        load_labels(bad)
