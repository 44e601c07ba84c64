"""Label builder inputs: manifest validation (file/line/field in every error) and ``from-prag`` conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fcprag_tools.cli import main
from fcprag_plugin.errors import LabelFileError
from fcprag_tools.label_builder.manifest import from_prag, read_manifest
from helpers import make_adapter_dir

GOOD = {"id": "q1", "question": "Who?", "answer": "Paris", "passages": ["p one", "p two"], "adapters": ["a0", "a1"]}


def _manifest(tmp_path: Path, *objs, raw: str | None = None) -> Path:
    p = tmp_path / "manifest.jsonl"
    text = "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)
    p.write_text(text + (raw or ""), encoding="utf-8")
    return p


def test_reads_records_and_resolves_relative_adapters(tmp_path):
    p = _manifest(tmp_path, GOOD, "", dict(GOOD, id="q2", answer=["Paris", "City of Paris"], group="g",
                                           adapters=["/abs/a0", "a1"]))
    recs = read_manifest(p)
    assert [r.id for r in recs] == ["q1", "q2"]
    assert recs[0].adapters == [tmp_path / "a0", tmp_path / "a1"] and recs[0].answers == ["Paris"]
    assert recs[1].adapters[0] == Path("/abs/a0") and recs[1].answers == ["Paris", "City of Paris"]
    assert recs[1].extra == {"group": "g"} and recs[1].line == 3


@pytest.mark.parametrize("obj, match", [
    ("{not json", r"manifest\.jsonl:2: not valid JSON"),
    ([1, 2], r"manifest\.jsonl:2: expected a JSON object"),
    ({k: v for k, v in GOOD.items() if k != "answer"}, r"manifest\.jsonl:2: field 'answer' is missing"),
    (dict(GOOD, id=7), r"manifest\.jsonl:2: field 'id': expected a non-empty string, got 7"),
    (dict(GOOD, question="  "), r"manifest\.jsonl:2: field 'question': expected a non-empty string"),
    (dict(GOOD, answer=[]), r"manifest\.jsonl:2: field 'answer': expected a list of at least 1"),
    (dict(GOOD, answer=["ok", 3]), r"manifest\.jsonl:2: field 'answer\[1\]': expected a non-empty string, got 3"),
    (dict(GOOD, passages=["a", ""]), r"manifest\.jsonl:2: field 'passages\[1\]': expected a non-empty string"),
    (dict(GOOD, adapters=["a0"]), r"manifest\.jsonl:2: field 'adapters' has 1 entries but 'passages' has 2"),
    (dict(GOOD, passages="one"), r"manifest\.jsonl:2: field 'passages': expected a list"),
    (dict(GOOD, id="q0"), r"manifest\.jsonl:2: field 'id': duplicate id 'q0' \(first on line 1\)"),
    (dict(GOOD, split="tran"), r"manifest\.jsonl:2: field 'split': expected one of \['train'"),
    (dict(GOOD, group=[1]), r"manifest\.jsonl:2: field 'group': expected a string or an integer"),
])
def test_bad_manifest_lines_name_file_line_field(tmp_path, obj, match):
    p = _manifest(tmp_path, dict(GOOD, id="q0"), obj)
    with pytest.raises(LabelFileError, match=match):
        read_manifest(p)


def test_missing_and_empty_manifest(tmp_path):
    with pytest.raises(LabelFileError, match=r"nope\.jsonl: manifest not found"):
        read_manifest(tmp_path / "nope.jsonl")
    with pytest.raises(LabelFileError, match=r"manifest\.jsonl: the manifest has no records"):
        read_manifest(_manifest(tmp_path, ""))


def test_cli_reports_bad_manifest_line(tmp_path, capsys):
    p = _manifest(tmp_path, GOOD, dict(GOOD, id="q2", passages=[1, 2]))
    assert main(["labels", "build", str(p), "--model", "unused", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "manifest.jsonl:2: field 'passages[0]'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- PRAG layout
def _prag_tree(tmp_path: Path, missing: tuple[tuple[int, int], ...] = ()) -> tuple[Path, Path]:
    """PRAG's layout: an augmented data file (JSON array) and {root}/data_{test_id}/passage_{pid} adapters."""
    data = [
        {"question": "Who wrote it?", "answer": "the king", "passages": ["a", "b", "c"], "type": "bridge",
         "augment": [{"passage": "a"}, {"passage": "b"}, {"passage": "c"}], "qid": "x0"},
        {"question": "Where is it?", "answer": ["Paris", "paris city"], "passages": ["d", "e"]},
        {"question": "When?", "answer": "1990", "passages": ["f"]},
    ]
    f = tmp_path / "data_aug" / "bridge.json"
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps(data, indent=1), encoding="utf-8")
    root = tmp_path / "offline"
    for tid, rec in enumerate(data):
        for pid in range(len(rec["passages"])):
            d = root / f"data_{tid}" / f"passage_{pid}"
            if (tid, pid) in missing:
                d.mkdir(parents=True)  # PRAG creates the folder before training: present but empty
                continue
            make_adapter_dir(d, seed=tid * 10 + pid)
    return f, root


def test_from_prag_builds_manifest_in_order(tmp_path):
    f, root = _prag_tree(tmp_path)
    res = from_prag(f, root)
    assert res.missing == [] and res.total == 3
    ids = [r["id"] for r in res.records]
    assert ids == ["bridge-0", "bridge-1", "bridge-2"]
    r0 = res.records[0]
    assert r0["adapters"] == [str((root / "data_0" / f"passage_{i}").resolve()) for i in range(3)]
    assert r0["source_id"] == "x0" and r0["type"] == "bridge" and r0["test_id"] == 0
    assert res.records[1]["answer"] == ["Paris", "paris city"]
    out = tmp_path / "manifest.jsonl"
    assert main(["labels", "from-prag", "--data-aug", str(f), "--adapters-root", str(root), "--out", str(out),
                 "--id-prefix", "hq"]) == 0
    recs = read_manifest(out)  # what from-prag writes is a valid manifest
    assert [r.id for r in recs] == ["hq0", "hq1", "hq2"] and recs[2].n == 1


def test_from_prag_lists_missing_adapters(tmp_path, capsys):
    f, root = _prag_tree(tmp_path, missing=((1, 1),))
    res = from_prag(f, root)
    assert res.missing == [("bridge-1", 1, root.resolve() / "data_1" / "passage_1")]
    assert res.incomplete_ids == ["bridge-1"] and [r["id"] for r in res.records] == ["bridge-0", "bridge-2"]
    out = tmp_path / "m.jsonl"
    args = ["labels", "from-prag", "--data-aug", str(f), "--adapters-root", str(root), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "1 adapters missing in 1 of 3 records" in err and "bridge-1 passage 1" in err
    assert str(root.resolve() / "data_1" / "passage_1") in err and "nothing written" in err
    assert not out.exists()
    assert main(args + ["--on-missing", "skip"]) == 0
    cap = capsys.readouterr()
    assert "bridge-1 passage 1" in cap.err and "1 left out (missing adapters)" in cap.out
    assert [r.id for r in read_manifest(out)] == ["bridge-0", "bridge-2"]
    # --limit: PRAG's --sample trains only the first records
    assert main(args + ["--limit", "1"]) == 0
    assert [r.id for r in read_manifest(out)] == ["bridge-0"]


def test_from_prag_errors_name_the_culprit(tmp_path):
    f, root = _prag_tree(tmp_path)
    data = json.loads(f.read_text())
    data[1]["augment"] = [{"passage": "d"}]
    f.write_text("[\n" + ",\n".join(json.dumps(r) for r in data) + "\n]\n")  # one record a line: line 3 is record 1
    with pytest.raises(LabelFileError, match=r"bridge\.json:3: field 'augment' has 1 entries but "
                                             r"'passages' has 2"):
        from_prag(f, root)
    jl = tmp_path / "aug.jsonl"
    jl.write_text(json.dumps(data[0]) + "\n" + json.dumps({"question": "q", "passages": ["x"]}) + "\n")
    with pytest.raises(LabelFileError, match=r"aug\.jsonl:2: field 'answer' is missing"):
        from_prag(jl, root)
    with pytest.raises(LabelFileError, match=r"nowhere: adapters root is not a directory"):
        from_prag(f, tmp_path / "nowhere")
