"""Sharding: rank/world from the launcher, part files, and a real 2-process torchrun run (gloo, CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fcprag_tools.cli import main
from fcprag_plugin.errors import LabelFileError
from fcprag_plugin.training import load_labels
from fcprag_tools.label_builder.manifest import read_manifest
from fcprag_tools.label_builder.parts import shard_records
from fcprag_tools.lm.shard import ShardInfo, output_path, part_path, shard_from_env
from helpers import make_adapter_dir, save_tiny_lm


def test_shard_from_env_torchrun_and_accelerate_and_plain():
    assert shard_from_env({}) == ShardInfo(0, 1, 0)
    group = {"MASTER_ADDR": "127.0.0.1"}
    assert shard_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", **group}) == ShardInfo(3, 4, 1)
    assert shard_from_env({"RANK": "1", "WORLD_SIZE": "2", **group}).local_rank == 1
    with pytest.raises(LabelFileError, match=r"RANK=2, WORLD_SIZE=2: expected 0 <= RANK < WORLD_SIZE"):
        shard_from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(LabelFileError, match=r"WORLD_SIZE='two': expected an integer"):
        shard_from_env({"RANK": "0", "WORLD_SIZE": "two"})


def test_shards_partition_records_round_robin(tmp_path):
    recs = list(range(11))
    shards = [shard_records(recs, r, 3) for r in range(3)]
    assert shards[0] == [0, 3, 6, 9] and shards[2] == [2, 5, 8]
    assert sorted(x for s in shards for x in s) == recs
    assert part_path(tmp_path / "labels.jsonl", 1, 4) == tmp_path / "labels.part1-of4.jsonl"
    assert part_path(tmp_path / "labels", 0, 2) == tmp_path / "labels.part0-of2.jsonl"
    assert output_path(tmp_path / "l.jsonl", ShardInfo(0, 1)) == tmp_path / "l.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def small_world(tmp_path):
    model = save_tiny_lm(tmp_path / "lm", seed=0)
    ads = [make_adapter_dir(tmp_path / f"passage_{i}", seed=i) for i in range(3)]
    questions = ["What is the capital of France?", "Who wrote the book?", "Which river is in Paris?",
                 "When was the king born?", "Where is the tower?"]
    recs = [{"id": f"q{i}", "question": q, "answer": ["paris", "the king"][i % 2],
             "passages": [f"passage {j}" for j in range(1 + i % 3)], "adapters": [str(a) for a in ads[: 1 + i % 3]]}
            for i, q in enumerate(questions)]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {"model": model, "manifest": manifest}


def _torchrun(common: list[str], out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "fcprag_tools.cli"] + common + ["--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "merged 5 records from 2 files" in proc.stdout
    return proc


def _single(common: list[str], out: Path) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(common + ["--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process(small_world, tmp_path):
    """With --batch-size 1 (one row per forward) the 2-process labels are the 1-process labels byte for byte."""
    common = ["labels", "build", str(small_world["manifest"]), "--model", str(small_world["model"]),
              "--max-new-tokens", "3", "--empty-generation", "zero", "--no-progress", "--threads", "1",
              "--batch-size", "1"]
    single, dist_out = tmp_path / "single.jsonl", tmp_path / "dist.jsonl"
    _single(common, single)
    _torchrun(common, dist_out)
    parts = [tmp_path / "dist.part0-of2.jsonl", tmp_path / "dist.part1-of2.jsonl"]
    ids = [[json.loads(l)["id"] for l in p.read_text().splitlines()] for p in parts]
    assert ids == [["q0", "q2", "q4"], ["q1", "q3"]]  # i % world == rank

    merged = tmp_path / "merged.jsonl"
    assert main(["labels", "merge", *map(str, parts), "--manifest", str(small_world["manifest"]),
                 "--out", str(merged)]) == 0
    assert merged.read_text() == single.read_text()  # exactly the same labels, in manifest order
    assert dist_out.read_text() == single.read_text()  # rank 0 merged at the end as well


@pytest.mark.slow
def test_torchrun_batched_with_scales_matches_one_process(small_world, tmp_path):
    """Batched (the default --batch-size 16), a record's rounding depends on its batch neighbours, which differ
    between the ranks: the labels agree within the batched path's tolerance. The scale fields go through the
    merge."""
    common = ["labels", "build", str(small_world["manifest"]), "--model", str(small_world["model"]),
              "--max-new-tokens", "3", "--empty-generation", "zero", "--no-progress", "--threads", "1",
              "--scales", "0.5,1,3"]
    single, dist_out = tmp_path / "single.jsonl", tmp_path / "dist.jsonl"
    _single(common, single)
    _torchrun(common, dist_out)
    one = [json.loads(l) for l in single.read_text().splitlines()]
    two = [json.loads(l) for l in dist_out.read_text().splitlines()]
    assert [r["id"] for r in two] == [r["id"] for r in one] == ["q0", "q1", "q2", "q3", "q4"]
    for x, y in zip(one, two):
        assert list(x) == list(y) and x["scales"] == [0.5, 1.0, 3.0]
        for k in x:
            if k.startswith(("answer_logprob", "metric_")):
                assert y[k] == pytest.approx(x[k], abs=1e-5), (x["id"], k)
            else:  # greedy texts, f1 / em, the scales and everything else: identical
                assert y[k] == x[k], (x["id"], k)


def test_trainer_parser_accepts_builder_output(small_world, tmp_path):
    out = tmp_path / "labels.jsonl"
    assert main(["labels", "build", str(small_world["manifest"]), "--model", str(small_world["model"]),
                 "--out", str(out), "--max-new-tokens", "2", "--empty-generation", "zero", "--no-progress"]) == 0
    ls = load_labels(out)
    assert [r.id for r in ls.records] == [r.id for r in read_manifest(small_world["manifest"])]
    raw = [json.loads(l) for l in out.read_text().splitlines()]
    for rec, obj in zip(ls.records, raw):
        assert rec.deltas == pytest.approx([obj["metric_all"] - w for w in obj["metric_without"]])
        assert rec.metric == "answer_logprob" and rec.n == len(obj["passages"])
        assert "f1_without" in rec.extra  # the other metrics ride along as extra fields
