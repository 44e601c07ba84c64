"""``fcprag study`` under torchrun: two CPU processes share the heavy stages and end where one process ends."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from fcprag_tools.cli import main
from fcprag_tools.study import check_summary

ARGS = ["--top-k", "2", "--scales", "2", "--max-new-tokens", "3", "--test-fraction", "0.5", "--epochs", "2",
        "--no-progress", "--group", "2", "--chunk", "1", "--aug-batch", "2", "--device", "cpu"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process(tiny_study):
    root = tiny_study["root"]
    common = ["study", tiny_study["questions"], "--model", tiny_study["model"], *ARGS]
    assert main(common + ["--out", str(root / "one")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={_port()}", "-m", "fcprag_tools.cli", *common,
                           "--out", str(root / "two")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = (json.loads((root / d / "summary.json").read_text()) for d in ("one", "two"))
    assert check_summary(two) == [] and (two["n_train"], two["n_test"]) == (one["n_train"], one["n_test"])
    assert not list((root / "two").glob("*.part*"))  # every part merged by rank 0
    for f in ("augment.jsonl", "adapters.jsonl", "labels.jsonl", "eval.jsonl"):
        rows = [json.loads(x) for x in (root / "two" / f).read_text().splitlines()]
        ref = {r["id"]: r for r in map(json.loads, (root / "one" / f).read_text().splitlines())}
        assert sorted(r["id"] for r in rows) == sorted(ref), f  # every unit once, by one of the ranks
        if f == "augment.jsonl":
            assert all(r == ref[r["id"]] for r in rows)
    for name, m in one["methods"].items():  # adapters trained in other groups: the same up to float rounding
        assert two["methods"][name]["logprob"] == pytest.approx(m["logprob"], abs=1e-3), name
