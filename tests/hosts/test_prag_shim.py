"""The PRAG shim end to end: the PRAG-shaped double (tests/prag_double) run as a script under the launcher.

Every merged update is compared with an independent dense reference ``sum_i w~_i s_i B_i A_i`` built from the
adapter files, with ``w~`` recomputed from the controller's formula. Note: test functions here avoid local
variables named ``question`` + ``passages`` unless they mean them (the shim reads callers' locals).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fcprag_plugin.compat import peft_has_stale_config_bug
from fcprag_plugin.controller import ControllerConfig, FusionController
from fcprag_plugin.errors import HookError, MergeError
from fcprag_plugin.hosts import prag
from fcprag_tools.launch import launch_prag, run_script
from helpers import (files_reference, fixed_controller, fixed_weights_by_hand, hash_embed, hash_encoder,
                     save_side_feature_controller)
from prag_double.world import DOUBLE_SCRIPT, World, build_world, dense_reference, read_capture, reference_logits

STALE = peft_has_stale_config_bug()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return build_world(tmp_path_factory.mktemp("prag_world"))


@pytest.fixture(autouse=True)
def _no_shim_leaks():
    yield
    prag.uninstall()
    prag.clear_context()


def random_controller_dir(path: Path) -> Path:
    """An untrained controller, sharpened (spread scores, gate open, low tau), saved to disk for the shim."""
    ctrl = FusionController(ControllerConfig(embed_dim=16, score_hidden=[32, 16], calib_hidden=16,
                                             controller_mode="random",
                                             seed=0))
    with torch.no_grad():
        ctrl.score_net[-1].weight.mul_(20.0)
        ctrl.calib_net[-1].bias.copy_(torch.tensor([4.0, -4.0]))  # g ~ 0.98, tau ~ 0.09
    return ctrl.save_pretrained(path)


def launch_double(world: World, tmp: Path, *, context: str = "locals", sample: int = -1, **options
                  ) -> tuple[Path, list[dict]]:
    cap = tmp / "cap"
    cap.mkdir(exist_ok=True)
    log = tmp / "fusion.jsonl"
    rc = launch_prag(str(DOUBLE_SCRIPT), world.args(cap, context, sample), log=log, **options)
    assert rc == 0
    assert not prag.is_installed()  # launch uninstalls afterwards
    return cap, [json.loads(line) for line in log.read_text().splitlines()]


def assert_merged(world: World, cap: Path, t: int, weights: dict[int, float], *, logits: bool = False) -> None:
    dws, got_logits, _ = read_capture(cap, t)
    ref = dense_reference(world, t, weights)
    assert set(dws) == set(ref)
    for module in ref:
        torch.testing.assert_close(dws[module], ref[module], rtol=1e-5, atol=1e-5, msg=f"q{t} {module}")
    if logits:
        want = reference_logits(world, ref, world.records[t]["question"])
        torch.testing.assert_close(got_logits, want, rtol=1e-4, atol=1e-4)


def check_log(world: World, records: list[dict], expected_w: list[list[float]], source: str, mode: str = "cat"):
    assert len(records) == len(expected_w)
    for t, (rec, w) in enumerate(zip(records, expected_w)):
        n = len(world.records[t]["passages"])
        assert rec["test_id"] == t
        assert rec["question"] == world.records[t]["question"]
        assert rec["adapter_paths"] == [str(world.adapter_path(t, p)) for p in range(n)]
        assert rec["adapters"] == [str(p) for p in range(n)]
        assert rec["n"] == n and len(rec["scores"]) == n and len(rec["probabilities"]) == n
        assert rec["merge_weights"] == pytest.approx(w, abs=1e-5)
        assert sum(rec["probabilities"]) == pytest.approx(1.0, abs=1e-5)
        assert rec["context_source"] == source
        assert rec["mode"] == mode
        assert rec["merge_time_s"] > 0
        assert isinstance(rec["g"], float)


# ----------------------------------------------------------------------------- the bug, and its repair
def test_without_shim_the_double_shows_peft_behaviour(world, tmp_path):
    """peft < 0.19: from question 2 on only passage 0 (and names never seen before) are merged; >= 0.19: all."""
    assert not prag.is_installed()
    cap = tmp_path / "cap"
    cap.mkdir()
    run_script(DOUBLE_SCRIPT, world.args(cap))
    seen: set[int] = set()
    for t, rec in enumerate(world.records):
        n = len(rec["passages"])
        if STALE:
            merged = {0} | {p for p in range(1, n) if p not in seen}
        else:
            merged = set(range(n))
        seen |= set(range(1, n))
        assert_merged(world, cap, t, {p: 1.0 for p in merged})
        layers = read_capture(cap, t)[2]["layers_per_adapter"]
        assert {int(k) for k, v in layers.items() if v > 0} == merged


@pytest.mark.skipif(not STALE, reason="peft >= 0.19 fixed the stale peft_config after unload()")
def test_bug_reproduces_issue_pattern(world, tmp_path):
    cap = tmp_path / "cap"
    cap.mkdir()
    run_script(DOUBLE_SCRIPT, world.args(cap))
    got = [sorted(int(k) for k, v in read_capture(cap, t)[2]["layers_per_adapter"].items() if v > 0)
           for t in range(4)]
    assert got == [[0, 1, 2], [0, 3], [0], [0]]


def test_shim_merges_every_passage_with_fixed_controller(world, tmp_path, caplog):
    cap, records = launch_double(world, tmp_path, controller=fixed_controller(), encoder=hash_encoder(16))
    expected = [fixed_weights_by_hand(r["question"], r["passages"]) for r in world.records]
    assert max(abs(x - 1) for w in expected for x in w) > 0.3  # clearly non-uniform: the weights matter
    for t, w in enumerate(expected):
        assert_merged(world, cap, t, dict(enumerate(w)), logits=True)
        layers = read_capture(cap, t)[2]["layers_per_adapter"]
        assert all(v > 0 for v in layers.values())
    check_log(world, records, expected, "caller_locals")
    # the fusion never wrote into the base model
    from safetensors.torch import load_file

    base = load_file(str(cap / "base.safetensors"))
    assert torch.equal(base["before"], base["after"])
    stale_warnings = [r for r in caplog.records if "leaves peft_config" in r.getMessage()]
    assert len(stale_warnings) == (1 if STALE else 0)  # one-time warning, only where peft has the bug


def test_shim_with_random_controller_directory(world, tmp_path):
    cdir = random_controller_dir(tmp_path / "ctrl")
    cap, records = launch_double(world, tmp_path, controller=str(cdir), encoder=hash_encoder(16))
    ctrl, enc = FusionController.from_pretrained(cdir), hash_encoder(16)
    expected = []
    for r in world.records:
        with torch.no_grad():
            out = ctrl(enc.encode([r["question"]]), enc.encode(r["passages"]).unsqueeze(0))
        expected.append(out.merge_weights[0].tolist())
        assert records[len(expected) - 1]["g"] == pytest.approx(float(out.g[0]), abs=1e-5)
        assert records[len(expected) - 1]["tau"] == pytest.approx(float(out.tau[0]), abs=1e-5)
        assert records[len(expected) - 1]["scores"] == pytest.approx(out.scores[0].tolist(), abs=1e-5)
    assert max(abs(x - 1) for w in expected for x in w) > 0.3
    for t, w in enumerate(expected):
        assert_merged(world, cap, t, dict(enumerate(w)))
    check_log(world, records, expected, "caller_locals")
    assert all(r["controller_mode"] == "random" for r in records)


def test_uniform_equals_prags_merge(world, tmp_path):
    """No controller: w~ = 1, the merge is PRAG's sum of passage updates (and peft's own, where not buggy)."""
    cap, records = launch_double(world, tmp_path, controller=None)
    for t, rec in enumerate(world.records):
        assert_merged(world, cap, t, {p: 1.0 for p in range(len(rec["passages"]))})
    check_log(world, records, [[1.0] * len(r["passages"]) for r in world.records], "caller_locals")
    assert all(r["tau"] is None and r["controller_mode"] == "uniform" for r in records)  # NaN logged as null
    plain = tmp_path / "plain"
    plain.mkdir()
    run_script(DOUBLE_SCRIPT, world.args(plain))
    for t in range(len(world.records) if not STALE else 1):  # peft < 0.19 itself is right on question 1 only
        a, b = read_capture(cap, t)[0], read_capture(plain, t)[0]
        for module in a:
            torch.testing.assert_close(a[module], b[module], rtol=1e-6, atol=1e-6)


def test_uniform_controller_object_matches_none(world, tmp_path):
    cap, records = launch_double(world, tmp_path, controller=FusionController.uniform(16), sample=2)
    assert [r["merge_weights"] for r in records] == [[1.0] * 3, [1.0] * 4]
    assert_merged(world, cap, 1, {p: 1.0 for p in range(4)})


def test_svd_mode_is_the_best_rank_k_approximation(world, tmp_path):
    cap, records = launch_double(world, tmp_path, controller=fixed_controller(), encoder=hash_encoder(16),
                                 mode="svd")
    k = 4  # the largest adapter rank
    for t, r in enumerate(world.records):
        w = fixed_weights_by_hand(r["question"], r["passages"])
        ref = dense_reference(world, t, dict(enumerate(w)))
        dws, _, _ = read_capture(cap, t)
        for module, d in ref.items():
            U, S, Vh = torch.linalg.svd(d)
            best = (U[:, :k] * S[:k]) @ Vh[:k]
            torch.testing.assert_close(dws[module], best, rtol=1e-4, atol=1e-4)
    assert all(r["mode"] == "svd" for r in records)


# ----------------------------------------------------------------------------- where the question comes from
def test_context_from_set_context(world, tmp_path):
    cap, records = launch_double(world, tmp_path, sample=2, context="set_context", controller=fixed_controller(),
                                 encoder=hash_encoder(16))
    expected = [fixed_weights_by_hand(r["question"], r["passages"]) for r in world.records[:2]]
    for t, w in enumerate(expected):
        assert_merged(world, cap, t, dict(enumerate(w)))
    check_log(world, records, expected, "set_context")


def test_context_from_data_file(world, tmp_path):
    cap, records = launch_double(world, tmp_path, sample=2, context="none", controller=fixed_controller(),
                                 encoder=hash_encoder(16), data_file=world.data_file)
    expected = [fixed_weights_by_hand(r["question"], r["passages"]) for r in world.records[:2]]
    for t, w in enumerate(expected):
        assert_merged(world, cap, t, dict(enumerate(w)))
    check_log(world, records, expected, "data_file")


def test_context_from_data_directory(world, tmp_path):
    cap, records = launch_double(world, tmp_path, context="none", controller=None, data_file=world.root, sample=2)
    assert [r["context_source"] for r in records] == ["data_file"] * 2
    assert_merged(world, cap, 1, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})


def test_no_context_is_an_error_not_a_uniform_merge(world, tmp_path):
    cap = tmp_path / "cap"
    cap.mkdir()
    with pytest.raises(HookError) as e:
        launch_prag(str(DOUBLE_SCRIPT), world.args(cap, "none"), controller=fixed_controller(),
                    encoder=hash_encoder(16))
    msg = str(e.value)
    assert "set_context" in msg and str(world.adapter_path(0, 0)) in msg
    assert not (cap / "q0.safetensors").exists()  # nothing was merged or predicted
    assert not prag.is_installed()


# ----------------------------------------------------------------------------- adapters that are not really there
def test_zero_weight_adapter_is_named(tmp_path):
    bad = build_world(tmp_path / "w", ns=(2,), zero_b=[(0, 1)])
    with pytest.raises(HookError) as e:
        launch_prag(str(DOUBLE_SCRIPT), bad.args(tmp_path), controller=None)
    assert str(bad.adapter_path(0, 1)) in str(e.value) and "zero" in str(e.value)


@pytest.mark.skipif(not STALE, reason="needs peft < 0.19 (the stale peft_config bug)")
def test_stale_config_without_repair_is_caught_and_named(world, tmp_path):
    """With the repair switched off, peft 0.13.2 loads passage 1 of question 2 nowhere: the check names it."""
    cap = tmp_path / "cap"
    cap.mkdir()
    with prag.installed(controller=None, repair=False):
        with pytest.raises(HookError) as e:
            run_script(DOUBLE_SCRIPT, world.args(cap))
    msg = str(e.value)
    assert str(world.adapter_path(1, 1)) in msg and "no LoRA layers" in msg and "0.19" in msg
    assert (cap / "q0.safetensors").exists() and not (cap / "q1.safetensors").exists()


def _peft_model(adapter_dirs):
    from peft import PeftModel

    from helpers import tiny_model

    pm = PeftModel.from_pretrained(tiny_model(), str(adapter_dirs[0]), adapter_name="0", is_trainable=False)
    for i, d in enumerate(adapter_dirs[1:], start=1):
        pm.load_adapter(str(d), adapter_name=str(i))
    return pm


def test_adapter_without_layers_is_named(adapter_dirs):
    from fcprag_plugin.compat import live_lora_layers

    with prag.installed(controller=None):  # installed first: the shim records where each adapter came from
        pm = _peft_model(adapter_dirs)
        for _, layer in live_lora_layers(pm.base_model.model, "1"):  # as if its weights were loaded nowhere
            del layer.lora_A["1"], layer.lora_B["1"]
        prag.set_context("q", ["a", "b", "c"])
        with pytest.raises(HookError) as e:
            pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
    assert str(adapter_dirs[1]) in str(e.value) and "adapter '1'" in str(e.value)
    assert "merge" not in pm.peft_config


@pytest.mark.skipif(not STALE, reason="needs peft < 0.19 (the stale peft_config bug)")
def test_shim_installed_after_an_unload_repairs_at_from_pretrained(adapter_dirs):
    """A base model unloaded before the shim was installed still carries the stale config: cleared on reuse."""
    from peft import PeftModel

    first = _peft_model(adapter_dirs)  # a question answered before the shim was installed
    base = first.unload()
    assert set(vars(base)["peft_config"]) == {"0", "1", "2"}  # peft 0.13.2 left it behind
    question, passages = "violin opera", ["a b", "c d", "e f"]  # noqa: F841
    with prag.installed(controller=None):
        pm = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="0")
        for i in (1, 2):
            pm.load_adapter(str(adapter_dirs[i]), adapter_name=str(i))
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
    got, ref = _live_dw(pm, "merge"), files_reference(adapter_dirs, [1.0, 1.0, 1.0])
    for m in ref:
        torch.testing.assert_close(got[m], ref[m], rtol=1e-5, atol=1e-5)


def test_encoder_dimension_is_checked_at_install():
    from fcprag_plugin.errors import ControllerError

    with pytest.raises(ControllerError, match="8-d embeddings but the controller expects 16-d"):
        prag.install(controller=fixed_controller(), encoder=hash_encoder(8))
    assert not prag.is_installed()


def test_n_zero_is_an_error(adapter_dirs):
    pm = _peft_model(adapter_dirs[:1])
    with prag.installed(controller=None):
        with pytest.raises(HookError, match=r"N == 0"):
            pm.add_weighted_adapter([], [], adapter_name="merge", combination_type="cat")


def test_passage_count_mismatch_is_named(adapter_dirs):
    with prag.installed(controller=None):
        pm = _peft_model(adapter_dirs)
        prag.set_context("q", ["only", "two"])
        with pytest.raises(HookError) as e:
            pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
    assert "3 adapters" in str(e.value) and "2 passages" in str(e.value) and str(adapter_dirs[2]) in str(e.value)


# ----------------------------------------------------------------------------- direct use (no launcher)
def _live_dw(pm, name: str) -> dict[str, torch.Tensor]:
    from fcprag_plugin.compat import live_lora_layers

    out = {}
    for module, layer in live_lora_layers(pm.base_model.model, name):
        out[module] = float(layer.scaling[name]) * (layer.lora_B[name].weight.double() @ layer.lora_A[name].weight.double())
    return out


def test_explicit_context_beats_caller_locals_and_is_consumed(adapter_dirs, tmp_path):
    pm = _peft_model(adapter_dirs)
    question = "violin opera senate"  # noqa: F841  (read by the shim from this frame)
    passages = ["violin opera", "glacier comet", "river harbor"]  # noqa: F841
    with prag.installed(controller=fixed_controller(), encoder=hash_encoder(16), log=tmp_path / "l.jsonl") as shim:
        prag.set_context("glacier comet desert", ["tariff orchid", "glacier comet", "falcon bridge"])
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
        assert shim.last_record["context_source"] == "set_context"
        assert shim.last_record["question"] == "glacier comet desert"
        w = fixed_weights_by_hand("glacier comet desert", ["tariff orchid", "glacier comet", "falcon bridge"])
        got, ref = _live_dw(pm, "merge"), files_reference(adapter_dirs, w)
        for m in ref:
            torch.testing.assert_close(got[m], ref[m], rtol=1e-5, atol=1e-5)
        pm.delete_adapter("merge")
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
        assert shim.last_record["context_source"] == "caller_locals"
        assert shim.last_record["question"] == "violin opera senate"
        assert shim.last_record["test_id"] is None


def test_separate_mode_on_a_live_model(adapter_dirs):
    pm = _peft_model(adapter_dirs)
    question = "violin opera senate"
    passages = ["violin opera", "glacier comet", "river harbor"]
    with prag.installed(controller=fixed_controller(), encoder=hash_encoder(16), mode="separate") as shim:
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
    w = fixed_weights_by_hand(question, passages)
    assert shim.last_record["merge_weights"] == pytest.approx(w, abs=1e-5)
    got, ref = _live_dw(pm, "merge"), files_reference(adapter_dirs, w, "separate")
    assert set(got) == set(ref)
    for m in ref:
        torch.testing.assert_close(got[m], ref[m], rtol=1e-5, atol=1e-5)
    assert pm.peft_config["merge"].r == 2
    pm.set_adapter("merge")
    pm(input_ids=torch.tensor([[1, 2, 3]]))  # the re-shaped layers run


def test_existing_merge_name_is_left_to_peft(adapter_dirs):
    pm = _peft_model(adapter_dirs)
    question, passages = "q", ["a", "b", "c"]  # noqa: F841
    with prag.installed(controller=None) as shim:
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
        before = _live_dw(pm, "merge")
        pm.add_weighted_adapter(["0", "1"], [1, 1], adapter_name="merge", combination_type="cat")  # peft: no-op
        assert shim.merges == 1
    after = _live_dw(pm, "merge")
    assert all(torch.equal(before[m], after[m]) for m in before)


# ----------------------------------------------------------------------------- install / uninstall
def _peft_attrs():
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

    return {
        "LoraModel": dict(vars(LoraModel)),
        "PeftModel": dict(vars(PeftModel)),
        "funcs": (LoraModel.add_weighted_adapter, LoraModel.unload, LoraModel.merge_and_unload,
                  PeftModel.load_adapter, PeftModel.from_pretrained.__func__),
    }


def test_uninstall_restores_peft_exactly():
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

    before = _peft_attrs()
    shim = prag.install(controller=None)
    again = prag.install(controller=fixed_controller(), encoder=hash_encoder(16))  # idempotent: no double wrap
    assert LoraModel.add_weighted_adapter is not before["funcs"][0]
    assert LoraModel.add_weighted_adapter.__wrapped__ is before["funcs"][0]
    assert PeftModel.load_adapter.__wrapped__ is before["funcs"][3]
    assert PeftModel.from_pretrained.__func__.__wrapped__ is before["funcs"][4]
    if STALE:
        assert LoraModel.unload.__wrapped__ is before["funcs"][1]
    assert not shim.active and again.active
    shim.uninstall()  # a stale handle does nothing
    assert prag.is_installed()
    prag.uninstall()
    after = _peft_attrs()
    assert set(after["LoraModel"]) == set(before["LoraModel"]) and set(after["PeftModel"]) == set(before["PeftModel"])
    for k, v in before["LoraModel"].items():
        assert after["LoraModel"][k] is v, k
    for k, v in before["PeftModel"].items():
        assert after["PeftModel"][k] is v, k
    for a, b in zip(after["funcs"], before["funcs"]):
        assert a is b
    prag.uninstall()  # twice is fine


def test_installed_context_manager_restores_previous_state():
    from peft.tuners.lora import LoraModel

    original = LoraModel.add_weighted_adapter
    outer = prag.install(controller=None)
    with prag.installed(controller=fixed_controller(), encoder=hash_encoder(16)) as inner:
        assert inner.active and not outer.active
    assert outer.active
    prag.uninstall()
    with prag.installed(controller=None):
        assert LoraModel.add_weighted_adapter is not original
    assert LoraModel.add_weighted_adapter is original and not prag.is_installed()


def test_bad_options_fail_at_install():
    with pytest.raises(MergeError, match="unknown merge mode 'kat'"):
        prag.install(mode="kat")
    with pytest.raises(HookError, match="nowhere.json"):
        prag.install(data_file="/nowhere.json")
    assert not prag.is_installed()


def test_launch_returns_the_scripts_exit_status(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert launch_prag(str(script), []) == 3
    assert not prag.is_installed()


@pytest.mark.integration
def test_a_side_feature_network_runs_with_what_prag_has(world, tmp_path, caplog):
    """A network on retrieval rank + adapter statistics at kappa 4 (the real MiniLM encoder) under PRAG: PRAG keeps
    no retrieval scores and needs none; the ranks are the passage order, the statistics come from the adapters PRAG
    loaded. Weights = the controller's own prediction with those inputs; merges = dense reference."""
    from fcprag_plugin import LoraAdapter
    from fcprag_plugin.encoding import TextEncoder

    shipped = save_side_feature_controller(tmp_path / "side-ctrl")
    cap, records = launch_double(world, tmp_path, controller=str(shipped))
    ctrl, enc = FusionController.from_pretrained(shipped), TextEncoder()
    assert ctrl.config.side_features == ["retrieval_rank", "adapter_stats"] and ctrl.config.kappa == 4.0
    for t, r in enumerate(world.records):
        n = len(r["passages"])
        ads = [LoraAdapter.from_pretrained(world.adapter_path(t, p)) for p in range(n)]
        want = ctrl.predict(r["question"], r["passages"], enc, retrieval_ranks=[float(i + 1) for i in range(n)],
                            adapter_stats=ads).merge_weights[0].tolist()
        assert records[t]["merge_weights"] == pytest.approx(want, abs=1e-5)
        assert sum(want) == pytest.approx(4.0 * n, rel=1e-4)  # its total: PRAG's sum times kappa 4
        assert_merged(world, cap, t, dict(enumerate(want)))
    assert not [m for m in caplog.messages if "retrieval" in m]  # nothing it needs was missing
