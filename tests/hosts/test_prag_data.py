"""Mapping PRAG adapter paths ``.../{group}/data_{test_id}/passage_{pid}`` back to PRAG's data file."""

from __future__ import annotations

import json

import pytest

from fcprag_plugin.errors import HookError
from fcprag_plugin.hosts.prag_data import PragDataFile, common_test_id, parse_adapter_path

RECORDS = [{"question": f"q{t}", "passages": [f"p{t}.{p}" for p in range(3)]} for t in range(3)]


def _path(root, t, p, group="dev"):
    return str(root / "offline" / "m" / group / f"data_{t}" / f"passage_{p}")


def test_parse_adapter_path():
    p = parse_adapter_path("/x/offline/llama/rank=2/dev/data_12/passage_3/")
    assert (p.group, p.test_id, p.pid) == ("dev", 12, 3)
    assert parse_adapter_path("/x/dev/data_1/adapter_3") is None
    assert parse_adapter_path("data_1/passage_0") is None  # no group folder
    assert parse_adapter_path(None) is None
    a, b = parse_adapter_path("/r/dev/data_4/passage_0"), parse_adapter_path("/r/dev/data_4/passage_1")
    assert common_test_id([a, b]) == 4
    assert common_test_id([a, parse_adapter_path("/r/dev/data_5/passage_1")]) is None
    assert common_test_id([a, None]) is None


@pytest.mark.parametrize("as_dir", [False, True])
@pytest.mark.parametrize("ext", [".json", ".jsonl"])
def test_lookup_picks_passages_by_pid(tmp_path, as_dir, ext):
    f = tmp_path / f"dev{ext}"
    if ext == ".json":
        f.write_text(json.dumps(RECORDS))
    else:
        f.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    data = PragDataFile(tmp_path if as_dir else f)
    parsed = [parse_adapter_path(_path(tmp_path, 2, p)) for p in (2, 0)]
    ctx = data.context(parsed)
    assert ctx == {"question": "q2", "passages": ["p2.2", "p2.0"], "test_id": 2, "data_file": str(f)}


def test_missing_data_file(tmp_path):
    with pytest.raises(HookError, match="nope.json: PRAG data file not found"):
        PragDataFile(tmp_path / "nope.json")


def test_file_of_another_group_is_refused(tmp_path):
    f = tmp_path / "bridge.json"
    f.write_text(json.dumps(RECORDS))
    with pytest.raises(HookError) as e:
        PragDataFile(f).context([parse_adapter_path(_path(tmp_path, 0, 0, "comparison"))])
    assert "comparison" in str(e.value) and str(f) in str(e.value)


def test_directory_without_the_group_file(tmp_path):
    (tmp_path / "dev.json").write_text(json.dumps(RECORDS))
    with pytest.raises(HookError, match=r"no data file 'other.json' or 'other.jsonl'"):
        PragDataFile(tmp_path).context([parse_adapter_path(_path(tmp_path, 0, 0, "other"))])


def test_test_id_out_of_range(tmp_path):
    f = tmp_path / "dev.json"
    f.write_text(json.dumps(RECORDS))
    with pytest.raises(HookError) as e:
        PragDataFile(f).context([parse_adapter_path(_path(tmp_path, 7, 0))])
    assert "test_id 7" in str(e.value) and "3 records" in str(e.value) and str(f) in str(e.value)


def test_pid_out_of_range(tmp_path):
    f = tmp_path / "dev.json"
    f.write_text(json.dumps(RECORDS))
    with pytest.raises(HookError, match=r"passage 5 does not exist, .*dev.json: record 1 has 3 passages"):
        PragDataFile(f).context([parse_adapter_path(_path(tmp_path, 1, 5))])


@pytest.mark.parametrize("record, key", [({"passages": ["a"]}, "question"), ({"question": "q"}, "passages"),
                                         ({"question": "q", "passages": ["a", 3]}, "passages")])
def test_bad_record_names_file_record_and_key(tmp_path, record, key):
    f = tmp_path / "dev.json"
    f.write_text(json.dumps([record]))
    with pytest.raises(HookError) as e:
        PragDataFile(f).context([parse_adapter_path(_path(tmp_path, 0, 0))])
    assert f"{f}: record 0" in str(e.value) and f"'{key}'" in str(e.value)


def test_bad_json_names_file_and_line(tmp_path):
    """One reader (fileio.read_records) whatever the suffix: '[' first is a JSON array, else JSON Lines."""
    f = tmp_path / "dev.json"
    f.write_text("{not json")
    with pytest.raises(HookError, match="dev.json:1: not valid JSON"):
        PragDataFile(f).context([parse_adapter_path(_path(tmp_path, 0, 0))])
    g = tmp_path / "d2" / "dev.jsonl"
    g.parent.mkdir()
    g.write_text(json.dumps(RECORDS[0]) + "\n{oops\n")
    with pytest.raises(HookError, match="dev.jsonl:2: not valid JSON"):
        PragDataFile(g).context([parse_adapter_path(_path(tmp_path, 0, 0))])
    h = tmp_path / "d3" / "dev.json"
    h.parent.mkdir()
    h.write_text("[\n" + json.dumps(RECORDS[0]) + ",\n{oops}\n]")
    with pytest.raises(HookError, match="dev.json:3: not valid JSON"):
        PragDataFile(h).context([parse_adapter_path(_path(tmp_path, 0, 0))])
    h.write_text(json.dumps({"question": "q"}))  # one object: a JSON Lines file of one record, which lacks passages
    with pytest.raises(HookError, match=r"dev.json: record 0: key 'passages' must be a list of strings"):
        PragDataFile(h).context([parse_adapter_path(_path(tmp_path, 0, 0))])


def test_adapters_of_different_questions(tmp_path):
    f = tmp_path / "dev.json"
    f.write_text(json.dumps(RECORDS))
    a, b = _path(tmp_path, 0, 0), _path(tmp_path, 1, 1)
    with pytest.raises(HookError) as e:
        PragDataFile(f).context([parse_adapter_path(a), parse_adapter_path(b)])
    assert a in str(e.value) and b in str(e.value)
