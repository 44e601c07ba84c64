"""The shipped demo set (adapters/demo/): manifest vs the data file, adapter format, QA-pair derivation.

No language model is loaded here (see test_demo_integration.py for the tests that load SmolLM2).
"""

import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from fcprag_plugin import LoraAdapter
import build_demo_adapters as build
import demo_common

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "adapters" / "demo"
DATA = REPO / "data" / "hotpotqa_sample.jsonl.gz"  # the first 3 are the demo's questions


@pytest.fixture(scope="module")
def manifest():
    return json.loads((DEMO / "manifest.json").read_text(encoding="utf-8"))


def _passages(manifest):
    return [(q, p) for q in manifest["questions"] for p in q["passages"]]


def test_manifest_shape_and_settings(manifest):
    assert len(manifest["questions"]) == 3
    assert all(len(q["passages"]) == 3 for q in manifest["questions"])
    t = manifest["training"]
    assert t["lora"] == {"r": 2, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj", "down_proj"],
                         "lora_dropout": 0.0}
    assert t["learning_rate"] == 3e-4
    assert manifest["model"]["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for k in ("torch", "transformers", "peft", "bm25s"):
        assert manifest["versions"][k] != "not installed"
    seeds = [p["training"]["seed"] for _, p in _passages(manifest)]
    assert len(set(seeds)) == len(seeds)  # one seed per adapter
    assert sorted(p["adapter"] for _, p in _passages(manifest)) == sorted(
        f"q{k}/passage_{i}" for k in range(3) for i in range(3))


def test_manifest_matches_the_first_questions_of_the_data_file(manifest):
    rows = [json.loads(line) for line in gzip.decompress(DATA.read_bytes()).decode("utf-8").splitlines()[:3]]
    for q, row in zip(manifest["questions"], rows):
        assert (q["id"], q["question"], q["gold_answer"]) == (row["id"], row["question"], row["answer"])
        for p in q["passages"]:
            assert p["text"] == row["passages"][p["source_index"]]
            assert p["title"] == row["titles"][p["source_index"]]
            assert p["supporting"] == (p["title"] in row["supporting_titles"])


def test_retrieval_is_bm25_top3_recomputed_independently(manifest):
    """BM25, Lucene form (Kamphuis et al. 2020), written out from the formula on bm25s' tokens:
    idf(t) * tf / (tf + k1 * (1 - b + b * |d| / avgdl)), idf(t) = log(1 + (N - df + 0.5) / (df + 0.5)), k1=1.5, b=0.75."""
    bm25s = pytest.importorskip("bm25s")
    rows = [json.loads(line) for line in gzip.decompress(DATA.read_bytes()).decode("utf-8").splitlines()[:3]]
    for q, row in zip(manifest["questions"], rows):
        docs = bm25s.tokenize(row["passages"], stopwords="en", return_ids=False, show_progress=False)
        query = set(bm25s.tokenize([row["question"]], stopwords="en", return_ids=False, show_progress=False)[0])
        n, avgdl = len(docs), sum(len(d) for d in docs) / len(docs)
        scores = []
        for d in docs:
            s = 0.0
            for term in query:
                df = sum(term in doc for doc in docs)
                tf = d.count(term)
                if tf:
                    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                    s += idf * tf / (tf + 1.5 * (1 - 0.75 + 0.75 * len(d) / avgdl))
            scores.append(s)
        expected = sorted(range(n), key=lambda i: (-scores[i], i))[:3]
        assert [p["source_index"] for p in q["passages"]] == expected
        for p in q["passages"]:
            assert p["bm25_score"] == pytest.approx(scores[p["source_index"]], rel=1e-3)


def test_every_adapter_loads_is_trained_and_matches_the_manifest(manifest):
    first = None
    for _, p in _passages(manifest):
        d = DEMO / p["adapter"]
        a = LoraAdapter.from_pretrained(d)
        assert len(a) == 30 * 3  # 30 decoder layers x gate/up/down_proj
        assert {k.split(".")[-1] for k in a.modules} == {"gate_proj", "up_proj", "down_proj"}
        assert set(a.ranks.values()) == {2}
        assert all(m.scaling == pytest.approx(16.0) for m in a.modules.values())  # alpha / r = 32 / 2
        assert a.dtype == torch.bfloat16
        zero_b = [k for k, m in a.modules.items() if not torch.any(m.B != 0)]
        assert zero_b == [], f"{d}: untrained modules {zero_b[:3]}"
        if first is None:
            first = a
        else:  # different passages, different seeds: different adapters
            k = next(iter(a.modules))
            assert not torch.equal(a.modules[k].B, first.modules[k].B)
        cfg = json.loads((d / "adapter_config.json").read_text())
        assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (2, 32, ["down_proj", "gate_proj",
                                                                                        "up_proj"])
        tr = p["training"]
        assert tr["loss_after"]["passage"] < tr["loss_before"]["passage"]
        assert tr["loss_after"]["qa"] < tr["loss_before"]["qa"]


def test_demo_folder_is_at_most_10_mb():
    size = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert size <= 10 * 1024 * 1024, f"adapters/demo is {size / 1e6:.1f} MB"


def test_qa_pairs_come_from_the_passage_alone(manifest):
    for q, p in _passages(manifest):
        pairs = build.derive_qa_pairs(p["text"], max_pairs=manifest["training"]["qa_pairs_per_passage"])
        assert [{k: x[k] for k in ("question", "answer")} for x in pairs] == \
               [{k: x[k] for k in ("question", "answer")} for x in p["qa_pairs"]]
        for x in pairs:
            assert x["answer"] in " ".join(p["text"].split())  # a span of the passage
            assert q["question"].lower() not in x["question"].lower()


def test_derive_qa_pairs_on_a_hand_checked_passage():
    text = ("Foo Bar: Foo Bar is a band from Oslo. It was founded in 1999 by John Smith. "
            "The album was produced by M. Night Shyamalan in World War I. Its name comes from St. Louis.")
    title, sents = build.split_passage(text)
    assert title == "Foo Bar"
    assert sents == ["Foo Bar is a band from Oslo.", "It was founded in 1999 by John Smith.",
                     "The album was produced by M. Night Shyamalan in World War I.", "Its name comes from St. Louis."]
    pairs = build.derive_qa_pairs(text, max_pairs=4)
    assert [(x["question"], x["answer"]) for x in pairs] == [
        ("What do you know about Foo Bar?", "Foo Bar is a band from Oslo."),
        ("Fill in the blank about Foo Bar: Foo Bar is a band from ___.", "Oslo"),
        ("Fill in the blank about Foo Bar: It was founded in ___ by John Smith.", "1999"),
        ("Fill in the blank about Foo Bar: The album was produced by M. Night Shyamalan in ___.", "World War I"),
    ]
    assert build.split_passage('X: The 9th ("9. Division") was a unit. It left.')[1] == [
        'The 9th ("9. Division") was a unit.', "It left."]


def test_load_manifest_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(SystemExit, match=r"manifest\.json: demo manifest not found"):
        demo_common.load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"manifest\.json: not valid JSON"):
        demo_common.load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"model": {}, "questions": [], "training": {}}))
    with pytest.raises(SystemExit, match=r"manifest\.json: missing key 'retrieval'"):
        demo_common.load_manifest(tmp_path)
    q = {"id": "x", "question": "q?", "gold_answer": "a",
         "passages": [{"title": "T", "text": "t", "supporting": True, "adapter": "q0/passage_0"}]}
    (tmp_path / "manifest.json").write_text(json.dumps({"model": {}, "questions": [q], "training": {},
                                                        "retrieval": {}}))
    with pytest.raises(SystemExit, match=r"questions\[0\]\.passages\[0\]\.adapter 'q0/passage_0' is not a directory"):
        demo_common.load_manifest(tmp_path)
    del q["passages"][0]["supporting"]
    (tmp_path / "manifest.json").write_text(json.dumps({"model": {}, "questions": [q], "training": {},
                                                        "retrieval": {}}))
    with pytest.raises(SystemExit, match=r"questions\[0\]\.passages\[0\] has no key 'supporting'"):
        demo_common.load_manifest(tmp_path)


def test_shipped_manifest_loads(manifest):
    man = demo_common.load_manifest(DEMO)
    assert all(Path(p["adapter_path"]).is_dir() for q in man["questions"] for p in q["passages"])
