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
    assert (root / "two" / "translator" / "translator.json").is_file()  # trained on rank 0, read by both
    assert {"dyprag", "dyprag_combine", "dyprag_recommended"} <= set(two["methods"])
    for f in ("augment.jsonl", "adapters.jsonl", "labels.jsonl", "eval.jsonl", "dyprag_generated.jsonl",
              "dyprag_cosine.jsonl"):
        rows = [json.loads(x) for x in (root / "two" / f).read_text().splitlines()]
        ref = {r["id"]: r for r in map(json.loads, (root / "one" / f).read_text().splitlines())}
        assert sorted(r["id"] for r in rows) == sorted(ref), f  # every unit once, by one of the ranks
        if f == "augment.jsonl":
            assert all(r == ref[r["id"]] for r in rows)
    for name, m in one["methods"].items():  # adapters trained in other groups: the same up to float rounding
        assert two["methods"][name]["logprob"] == pytest.approx(m["logprob"], abs=1e-3), name


@pytest.mark.parametrize("command", ["study", "labels build"])
def test_several_processes_without_a_process_group_are_refused(tiny_study, monkeypatch, capsys, command):
    """WORLD_SIZE > 1 set by hand (no launcher, so no MASTER_ADDR): one line, exit 2, nothing written."""
    root = tiny_study["root"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    out = root / "out"
    if command == "study":
        argv = ["study", tiny_study["questions"], "--model", tiny_study["model"], *ARGS, "--out", str(out)]
    else:
        manifest = root / "manifest.jsonl"
        manifest.write_text(json.dumps({"id": "q0", "question": "what ?", "answer": "paris", "passages": ["p"],
                                        "adapters": [str(root / "a")]}) + "\n")
        argv = ["labels", "build", str(manifest), "--model", tiny_study["model"], "--out",
                str(root / "labels.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "WORLD_SIZE=2 without MASTER_ADDR" in err[0] and "torchrun" in err[0], err
    assert not out.exists() and not (root / "labels.jsonl").exists()


def _torchrun_popen(common: list[str], out) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_addr=127.0.0.1", f"--master_port={_port()}", "-m", "fcprag_tools.cli", *common,
                             "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's worker of ``rank`` (a child of the launcher whose environment has RANK=rank)."""
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == launcher and \
                    f"RANK={rank}".encode() in open(f"/proc/{d}/environ", "rb").read().split(b"\0"):
                return int(d)
        except OSError:
            continue
    return None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks' processes under /proc")
def test_a_killed_rank_resumes_with_one_or_two_processes(tiny_study):
    """Rank 1 of a two-process study is killed in the augment stage (its part file has a unit, the study is not
    finished); the folder resumes to the one-process study's rows with one process and, from a copy, with two."""
    import shutil
    import signal
    import time

    root = tiny_study["root"]
    common = ["study", tiny_study["questions"], "--model", tiny_study["model"], *ARGS]
    assert main(common + ["--out", str(root / "one")]) == 0
    proc, part = _torchrun_popen(common, root / "killed"), root / "killed" / "augment.part1-of2.jsonl"
    deadline = time.monotonic() + 600
    while not (part.is_file() and part.read_text().count("\n") >= 1) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    pid = _rank_pid(proc.pid, 1)
    assert pid is not None, proc.communicate()[0][-3000:]
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=300) != 0
    killed = root / "killed"
    assert not (killed / "summary.json").exists() and list(killed.glob("*.part*-of2.jsonl"))
    shutil.copytree(killed, root / "killed2")

    assert main(common + ["--out", str(killed)]) == 0  # one process folds the two-process parts
    proc = _torchrun_popen(common, root / "killed2")
    log = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, log[-3000:]
    ref = {f: {r["id"]: r for r in map(json.loads, (root / "one" / f).read_text().splitlines())}
           for f in ("augment.jsonl", "eval.jsonl")}
    for out in (killed, root / "killed2"):
        assert not list(out.glob("*.part*")) and check_summary(json.loads((out / "summary.json").read_text())) == []
        for f in ("augment.jsonl", "eval.jsonl"):
            rows = [json.loads(x) for x in (out / f).read_text().splitlines()]
            assert sorted(r["id"] for r in rows) == sorted(ref[f]), (out, f)  # every unit once
            for r in rows:
                if f == "augment.jsonl":
                    assert r == ref[f][r["id"]]
                else:  # adapters trained in other groups: the same up to float rounding
                    assert r["logprob"] == pytest.approx(ref[f][r["id"]]["logprob"], abs=1e-3), r["id"]
