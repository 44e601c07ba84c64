"""fileio: the one reader of JSON-array-or-JSON-Lines files (labels, PRAG's data, manifests' PRAG input, the
study's questions; gzipped or not), the JSON object reader and the one JSON Lines appender, against json.loads of
each record and gzip/json of the standard library; errors name file:line."""

import gzip
import json
import math
from dataclasses import replace

import pytest

from fcprag_plugin.errors import FcpragError, LabelFileError
from fcprag_plugin.fileio import (JsonlAppender, append_json_lines, read_json_if_present, read_json_object,
                                  read_records, write_atomic, write_json_lines)

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


def test_gzipped_files_read_as_their_plain_text(tmp_path):
    """A name ending in .gz is decompressed first (committed study rows are); the records and lines are those of the
    plain file, and so are a label file's records and sha256 (it hashes the content, not the compressed bytes)."""
    from fcprag_plugin.training import load_labels
    from fcprag_tools.synthetic import synthetic_records, write_labels

    text = "\n" + "\n".join(json.dumps(r, ensure_ascii=False) for r in RECS) + "\n"
    (tmp_path / "r.jsonl").write_text(text, encoding="utf-8")
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps(RECS, indent=1).encode("utf-8")))
    assert read_records(tmp_path / "r.jsonl.gz", FcpragError) == read_records(tmp_path / "r.jsonl", FcpragError)
    assert [r for _, r in read_records(tmp_path / "a.json.gz", FcpragError)] == RECS
    plain = write_labels(synthetic_records(5, dim=4)[0], tmp_path / "l.jsonl")
    packed = tmp_path / "l.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_labels(plain), load_labels(packed)
    assert [replace(r, file="") for r in a.records] == [replace(r, file="") for r in b.records]
    assert b.records[0].file == str(packed) and a.sha256 == b.sha256 and len(a.records) == 5


@pytest.mark.parametrize("data", [b"not gzip at all", gzip.compress(b'{"a": 1}\n' * 50)[:-12]])  # cut-off stream
def test_a_broken_gzip_file_is_one_error_naming_it(tmp_path, data):
    f = tmp_path / "r.jsonl.gz"
    f.write_bytes(data)
    with pytest.raises(FcpragError, match=r"r\.jsonl\.gz: not a readable gzip file"):
        read_records(f, FcpragError)
    with pytest.raises((OSError, EOFError)):  # the reference agrees
        gzip.decompress(data)


def test_json_object_reader_names_the_file_line_and_fix(tmp_path):
    f = tmp_path / "c.json"
    assert read_json_if_present(f, FcpragError) is None
    with pytest.raises(FcpragError, match=rf"^{f}: config not found$"):
        read_json_object(f, FcpragError, "config not found")
    f.write_text('{"a": [1,\n 2],\n "b": {"c": null}}')
    assert read_json_object(f, FcpragError, "x") == json.loads(f.read_text())
    f.write_text('{"a": 1,\n oops}')
    with pytest.raises(FcpragError, match=rf"^{f}:2: not valid JSON \(.* at column 2\); delete it$"):
        read_json_if_present(f, FcpragError, fix="delete it")
    f.write_text("[1, 2]")
    with pytest.raises(FcpragError, match=rf"^{f}: expected a JSON object, got list$"):
        read_json_object(f, FcpragError, "x")
    f.write_bytes(b'{"a":\n "caf\xe9"}')
    with pytest.raises(FcpragError, match=rf"^{f}:2: not valid UTF-8"):
        read_json_object(f, FcpragError, "x")


def test_appended_lines_are_strict_json_a_whole_line_each(tmp_path):
    f = tmp_path / "sub" / "log.jsonl"  # the folder is made
    rows = [{"id": "a", "q": "x\u2028y", "v": [1.5, None]}, {"id": "b", "t": (1, 2)}]
    append_json_lines(f, rows[:1])
    with JsonlAppender(f, default=lambda o: sorted(o)) as out:
        out.append(rows[1])
        out.append({"id": "c", "s": {3, 1}})  # default: what json has no type for
        with pytest.raises(ValueError):
            out.append({"id": "d", "v": math.nan})  # strict JSON: refused, nothing written
    raw = f.read_bytes().decode("utf-8")
    assert raw.endswith("\n") and [json.loads(line) for line in raw.split("\n")[:-1]] == [
        {"id": "a", "q": "x\u2028y", "v": [1.5, None]}, {"id": "b", "t": [1, 2]}, {"id": "c", "s": [1, 3]}]
    assert "\u2028" in raw  # written as is (ensure_ascii=False), one record per "\n"-ended line
    whole = tmp_path / "whole.jsonl"  # the whole-file writer writes the same lines
    assert write_json_lines(whole, [json.loads(line) for line in raw.split("\n")[:-1]]) == 3
    assert whole.read_bytes() == f.read_bytes()
    with pytest.raises(ValueError):
        write_json_lines(tmp_path / "nan.jsonl", [{"v": math.inf}])
    assert not (tmp_path / "nan.jsonl").exists()


def test_a_store_resumes_after_a_partial_last_line(tmp_path):
    """A killed append leaves a partial last line: the store's own reader cuts it off, the next append continues, and
    the file then equals one written without the interruption; a reader of another rank's file leaves it alone."""
    from fcprag_tools.lm.store import read_label_lines
    from fcprag_tools.lm.units import UnitStore

    rows = [{"id": f"u{i}", "x": i / 3} for i in range(4)]
    whole = tmp_path / "ref.jsonl"
    append_json_lines(whole, rows)
    f = tmp_path / "units.jsonl"
    store = UnitStore(f)
    store.append(rows[:2])
    partial = json.dumps(rows[2]).encode("utf-8")[:9]
    with f.open("r+b") as h:  # what a kill mid-write leaves
        h.seek(0, 2)
        h.write(partial)
    assert [sl.record for sl in read_label_lines(f, partial="ignore")] == rows[:2]
    assert f.read_bytes().endswith(partial)  # "ignore" reads, and leaves the file as it is
    with pytest.raises(LabelFileError, match=r"units\.jsonl:3: the last line is incomplete"):
        read_label_lines(f)
    assert list(store.done()) == ["u0", "u1"]  # its own file: the partial line is cut off
    store.append(rows[2:])
    assert f.read_bytes() == whole.read_bytes()
    assert store.done() == {r["id"]: r for r in rows}


def test_the_atomic_writer_writes_text_as_utf8_and_bytes_as_given_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    text = "line 1\r\nzweite Zeile \u2028 \U0001f600\n"
    write_atomic(tmp_path / "a" / "t.txt", text)
    assert (tmp_path / "a" / "t.txt").read_bytes() == text.encode("utf-8")  # no newline translation
    data = bytes(range(256))
    write_atomic(tmp_path / "b.bin", data)
    assert (tmp_path / "b.bin").read_bytes() == data
    monkeypatch.setattr("os.replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write_atomic(tmp_path / "b.bin", b"new")
    assert (tmp_path / "b.bin").read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b.bin"]
