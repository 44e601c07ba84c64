"""``fcprag run prag [options] -- SCRIPT ARGS`` in a fresh process, on the PRAG-shaped double."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from prag_double.world import DOUBLE_SCRIPT, build_world, dense_reference, read_capture

pytestmark = pytest.mark.slow  # every test runs the CLI (torch, the host double) in a fresh process


def _run_cli(options: list[str], script_args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fcprag_tools.cli", "run", "prag", *options, "--", str(DOUBLE_SCRIPT), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def _check(world, cap, records, weights_per_q):
    for t, w in enumerate(weights_per_q):
        dws, _, _ = read_capture(cap, t)
        ref = dense_reference(world, t, dict(enumerate(w)))
        assert set(dws) == set(ref)
        for m in ref:
            torch.testing.assert_close(dws[m], ref[m], rtol=1e-5, atol=1e-5)
        assert records[t]["merge_weights"] == pytest.approx(w, abs=1e-5)
        assert records[t]["test_id"] == t and records[t]["question"] == world.records[t]["question"]


def test_cli_uniform_with_data_file(tmp_path):
    """No controller, the question only reachable through --data-file: every passage of every question merged."""
    world = build_world(tmp_path / "w", ns=(2, 3, 2))
    cap, log = tmp_path / "cap", tmp_path / "log.jsonl"
    cap.mkdir()
    proc = _run_cli(["--log", str(log), "--data-file", str(world.data_file)], world.args(cap, "none"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 3 questions" in proc.stdout  # the script's own output, run as __main__
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["context_source"] for r in records] == ["data_file"] * 3
    _check(world, cap, records, [[1.0] * len(r["passages"]) for r in world.records])


def test_cli_failure_is_reported(tmp_path):
    world = build_world(tmp_path / "w", ns=(2,))
    proc = _run_cli([], world.args(None, "none"), tmp_path)  # no context anywhere
    assert proc.returncode == 2
    assert "set_context" in proc.stderr and str(world.adapter_path(0, 0)) in proc.stderr


def test_cli_use_slot(tmp_path):
    """--use-slot: no merged PEFT layers are built, the logits are the dense reference's; a fixed capacity that is
    too small fails with the counts named."""
    from prag_double.world import reference_logits

    world = build_world(tmp_path / "w", ns=(2, 3))
    cap, log = tmp_path / "cap", tmp_path / "log.jsonl"
    cap.mkdir()
    proc = _run_cli(["--use-slot", "--log", str(log)], world.args(cap), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["use_slot"] for r in records] == [True, True]
    for t, rec in enumerate(world.records):
        dws, logits, _ = read_capture(cap, t)
        assert dws == {}  # the merge lives in the slot
        ref = dense_reference(world, t, {p: 1.0 for p in range(len(rec["passages"]))})
        torch.testing.assert_close(logits, reference_logits(world, ref, rec["question"]), rtol=1e-4, atol=1e-4)
    proc = _run_cli(["--use-slot", "--slot-max-adapters", "2"], world.args(None), tmp_path)
    assert proc.returncode == 2
    assert "merges 3 adapters but the fused slot holds --slot-max-adapters 2" in proc.stderr


@pytest.mark.integration
def test_cli_with_controller_and_real_encoder(tmp_path):
    """A controller directory; the embeddings come from the packaged all-MiniLM-L6-v2 in the subprocess."""
    from fcprag_plugin.controller import ControllerConfig, FusionController
    from fcprag_plugin.encoding import TextEncoder

    enc = TextEncoder()
    ctrl = FusionController(ControllerConfig(embed_dim=enc.dim, score_hidden=[8], calib_hidden=8,
                                             controller_mode="fixed",
                                             scorer="cosine", fixed_g=0.9, fixed_tau=0.02))
    cdir = ctrl.save_pretrained(tmp_path / "ctrl")
    world = build_world(tmp_path / "w", ns=(3, 2))
    cap, log = tmp_path / "cap", tmp_path / "log.jsonl"
    cap.mkdir()
    proc = _run_cli(["--controller", str(cdir), "--log", str(log)], world.args(cap), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    expected = [ctrl.predict(r["question"], r["passages"], enc).merge_weights[0].tolist() for r in world.records]
    assert max(abs(x - 1) for w in expected for x in w) > 0.01
    _check(world, cap, records, expected)
