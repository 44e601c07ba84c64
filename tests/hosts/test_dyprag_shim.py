"""The DyPRAG shim used in-process (``install`` / ``uninstall`` / context manager) on the test double's modules:
exact restoration, context resolution, capture-buffer hygiene and every error path."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from dyprag_double import harness as H
from fcprag_plugin.controller import FusionController
from fcprag_plugin.errors import HookError
from fcprag_plugin.hosts import dyprag
from fcprag_tools.launch import launch_dyprag
from fcprag_plugin.hosts.context import clear_context, explicit_context, set_context

TEXTS = ["the famous bridge in the old town was built by person one",
         "unrelated text about weather and cooking",
         "sports scores from last year in another city"]
QUESTION = "who built the famous bridge in the old town"


def embed(i: int) -> torch.Tensor:
    return torch.randn(1, 16, generator=torch.Generator().manual_seed(100 + i))


def dyprag_question(h, question, passages, extra_calls=0, merge=None):
    """DyPRAG's loop for one question (locals named as in inference_dyprag.py); returns the translator outputs."""
    with torch.no_grad():
        for j in range(extra_calls):
            h.translator(embed(-1 - j))
        all_deltas = [h.translator(embed(i)) for i, _ in enumerate(passages)]
    merged = merge(all_deltas) if merge else \
        {k: torch.stack([d[k] for d in all_deltas]).mean(dim=0) for k in all_deltas[0]}
    h.utils.delta_inject(h.model, merged)
    return all_deltas, merged


def anonymous_question(h, n):
    """The same loop from a function without 'question' / 'passages' locals."""
    with torch.no_grad():
        outs = [h.translator(embed(i)) for i in range(n)]
    h.utils.delta_inject(h.model, {k: torch.stack([o[k] for o in outs]).mean(dim=0) for k in outs[0]})
    return outs


def injected(model) -> dict[str, torch.Tensor]:
    return {n: m.delta for n, m in model.named_modules() if "delta" in vars(m)}


# ----------------------------------------------------------------------------- install / uninstall
def test_uninstall_restores_exactly(host):
    cls = host.projector.ParameterTranslator
    orig_inject, orig_remove, orig_fwd = host.utils.delta_inject, host.utils.delta_remove, vars(cls)["forward"]
    shim = dyprag.install(utils=host.utils, projector=host.projector)
    assert dyprag.current() is shim and shim.active
    assert host.utils.delta_inject is not orig_inject and vars(cls)["forward"] is not orig_fwd
    assert host.utils.delta_remove is orig_remove  # delta_remove needs no patch: same keys
    dyprag.uninstall()
    assert host.utils.delta_inject is orig_inject and vars(cls)["forward"] is orig_fwd
    assert dyprag.current() is None and not shim.active
    dyprag.uninstall()  # no-op

    with dyprag.installed(mode="cat", utils=host.utils, projector=host.projector) as s:
        assert s.mode == "cat" and host.utils.delta_inject is not orig_inject
    with pytest.raises(HookError, match=r"mode 'delta' is not one of \['separate', 'cat'"):
        dyprag.install(mode="delta", utils=host.utils, projector=host.projector)
    assert host.utils.delta_inject is orig_inject and vars(cls)["forward"] is orig_fwd

    dyprag.install(utils=host.utils, projector=host.projector)
    outer = dyprag.install(mode="cat", utils=host.utils, projector=host.projector)  # replaces, never stacks
    assert host.utils.delta_inject.__fcprag_original__ is orig_inject
    with dyprag.installed(utils=host.utils, projector=host.projector) as inner:  # restores the outer one after
        assert dyprag.current() is inner and host.utils.delta_inject.__fcprag_original__ is orig_inject
    assert dyprag.current() is outer and outer.active and dyprag.is_installed()
    assert host.utils.delta_inject.__fcprag_original__ is orig_inject
    assert vars(cls)["forward"].__fcprag_original__ is orig_fwd
    dyprag.uninstall()
    assert host.utils.delta_inject is orig_inject and vars(cls)["forward"] is orig_fwd
    assert not dyprag.is_installed()


def test_install_by_import_name(host):
    # utils / projector importable by name (the script's directory is on sys.path): the default
    shim = dyprag.install()
    assert shim.utils is host.utils and shim.projector is host.projector
    dyprag.uninstall()


def test_name_imported_before_install_is_patched_too(host, monkeypatch):
    orig = host.utils.delta_inject
    fake_main = types.ModuleType("__main__")
    fake_main.delta_inject = orig  # as after 'from utils import delta_inject'
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    dyprag.install(utils=host.utils, projector=host.projector)
    assert fake_main.delta_inject is host.utils.delta_inject is not orig
    dyprag.uninstall()
    assert fake_main.delta_inject is orig and host.utils.delta_inject is orig


# ----------------------------------------------------------------------------- the merge on a live model
@pytest.mark.parametrize("mode", ["separate", "cat"])
def test_reweights_a_live_model(host, encoder16, tmp_path, mode):
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    log = tmp_path / "log.jsonl"
    with dyprag.install(ctrl, encoder16, mode, log, utils=host.utils, projector=host.projector) as shim:
        outs, _ = dyprag_question(host, QUESTION, TEXTS)
        assert shim.merges == 1 and shim.last_record["n"] == 3
        assert shim.captured == []  # consumed by this question
        got = injected(host.model)
        u = H.controller_u(ctrl, encoder16, QUESTION, TEXTS)
        ref = (H.reference_separate if mode == "separate" else H.reference_delta)(outs, u)
        assert set(got) == set(ref)
        for m, d in ref.items():
            torch.testing.assert_close(got[m].double(), d, rtol=1e-5, atol=1e-7)
        host.utils.delta_remove(host.model, outs[0])
        assert injected(host.model) == {}
    rec = json.loads(log.read_text())
    assert rec["question"] == QUESTION and rec["n"] == 3 and rec["context_source"] == "caller_locals"
    assert rec["u"] == pytest.approx(u, rel=1e-6)


def test_adapter_stats_come_from_the_translator_outputs(host, encoder16):
    """A controller trained with adapter_stats and retrieval_rank gets, per passage, the statistics of the update
    DyPRAG injects for it (B @ A, scaling 1) and the passage's position as its rank."""
    from fcprag_plugin.adapter import LoraAdapter, LoraModule
    from fcprag_plugin.controller import ControllerConfig

    ctrl = FusionController(ControllerConfig(embed_dim=16, score_hidden=[8], calib_hidden=8, init="random", seed=4,
                                             side_features=["retrieval_rank", "adapter_stats"])).eval()
    with dyprag.install(ctrl, encoder16, "cat", utils=host.utils, projector=host.projector) as shim:
        outs, _ = dyprag_question(host, QUESTION, TEXTS)
        got = list(shim.last_record["merge_weights"])
    prefix = "base_model.model."
    by_hand = []
    for i, o in enumerate(outs):  # the translator's keys, parsed here without the shim's helpers
        mods = {}
        for k in o:
            if k.endswith(".lora_A.weight"):
                m = k[:-len(".lora_A.weight")]
                mods[m[len(prefix):]] = LoraModule(o[k].reshape(o[k].shape[-2:]),
                                                   o[m + ".lora_B.weight"].reshape(o[m + ".lora_B.weight"].shape[-2:]))
        by_hand.append(LoraAdapter(mods, {}, f"output {i}"))
    ref = ctrl.predict(QUESTION, TEXTS, encoder16, retrieval_ranks=[1.0, 2.0, 3.0], adapter_stats=by_hand)
    assert got == pytest.approx(ref.merge_weights[0].tolist(), abs=1e-6)
    assert len(set(round(w, 6) for w in got)) > 1  # not uniform: the check can fail


def test_uniform_log_is_strict_json(host, tmp_path):
    log = tmp_path / "log.jsonl"
    with dyprag.install(log=log, utils=host.utils, projector=host.projector):
        dyprag_question(host, QUESTION, TEXTS[:2])

    def no_nan(c):
        raise AssertionError(f"non-standard JSON constant {c}")

    rec = json.loads(log.read_text(), parse_constant=no_nan)
    assert rec["tau"] is None and rec["merge_weights"] == [1.0, 1.0] and rec["controller_mode"] == "uniform"


def _dyprag_loop(h, test_ids):
    for test_id in test_ids:  # noqa: B007  (DyPRAG's main() loop variable; the shim reads it from this frame)
        dyprag_question(h, QUESTION, TEXTS[:2])


def test_log_records_the_hosts_question_index(host, tmp_path):
    """Issue 13: like the PRAG shim's, the log's test_id is the host loop's question index (DyPRAG's main() has a
    local 'test_id'), or set_context(..., test_id=...); None when neither gives one."""
    log = tmp_path / "log.jsonl"
    with dyprag.install(log=log, utils=host.utils, projector=host.projector):
        _dyprag_loop(host, (7, 8))
        set_context(QUESTION, TEXTS[:2], test_id=42)
        anonymous_question(host, 2)
        dyprag_question(host, QUESTION, TEXTS[:2])
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["test_id"] for r in recs] == [7, 8, 42, None]


def test_dyprag_passages_list_local_is_found(host, encoder16):
    """DyPRAG's own loop holds the passage texts in 'passages_list' ('passages' is their joined string)."""
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    with dyprag.install(ctrl, encoder16, utils=host.utils, projector=host.projector) as shim:
        question, passages_list, passages = QUESTION, TEXTS[:2], "passage 1: ...passage 2: ..."  # noqa: F841
        anonymous_question(host, 2)
    assert shim.last_record["question"] == QUESTION and shim.last_record["context_source"] == "caller_locals"
    u = H.controller_u(ctrl, encoder16, QUESTION, TEXTS[:2])
    assert shim.last_record["u"] == pytest.approx(u, abs=1e-6)


# ----------------------------------------------------------------------------- context
def test_missing_context_is_an_error_and_clears_the_capture(host, encoder16):
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    with dyprag.install(ctrl, encoder16, utils=host.utils, projector=host.projector) as shim:
        with pytest.raises(HookError, match=r"cannot tell which question.*set_context.*'question'.*'passages'"):
            anonymous_question(host, 2)
        assert shim.captured == []
        assert injected(host.model) == {}  # nothing was injected
        dyprag_question(host, QUESTION, TEXTS)  # the next question is not out of step
        assert set(injected(host.model))


def test_explicit_context_wins_and_is_used_once(host, encoder16, tmp_path):
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    log = tmp_path / "log.jsonl"
    with dyprag.install(ctrl, encoder16, "cat", log, utils=host.utils, projector=host.projector):
        set_context(QUESTION, TEXTS[:2])
        outs = anonymous_question(host, 2)
        assert explicit_context() is None
        got = injected(host.model)
        u = H.controller_u(ctrl, encoder16, QUESTION, TEXTS[:2])
        for m, d in H.reference_delta(outs, u).items():
            torch.testing.assert_close(got[m].double(), d, rtol=1e-5, atol=1e-7)
        with pytest.raises(HookError, match="set_context"):
            anonymous_question(host, 2)  # a stale context is never reused
        set_context("an explicit question about the famous bridge", TEXTS[1:])
        dyprag_question(host, QUESTION, TEXTS[1:])  # explicit beats the caller's locals
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["context_source"] for r in recs] == ["set_context", "set_context"]
    assert recs[1]["question"] == "an explicit question about the famous bridge"


# ----------------------------------------------------------------------------- out of step
def test_extra_translator_call_is_an_error(host):
    with dyprag.install(utils=host.utils, projector=host.projector) as shim:
        with pytest.raises(HookError, match=r"captured 4 ParameterTranslator output\(s\).*3 passage\(s\)"):
            dyprag_question(host, QUESTION, TEXTS, extra_calls=1)
        assert shim.captured == [] and injected(host.model) == {}
        dyprag_question(host, QUESTION, TEXTS)
        assert set(injected(host.model))


def test_merged_not_the_mean_is_an_error(host):
    with dyprag.install(utils=host.utils, projector=host.projector) as shim:
        with pytest.raises(HookError, match=r"key 'base_model\.model\.model\.layers\.\d\.mlp\..*not the plain mean"):
            dyprag_question(host, QUESTION, TEXTS,
                            merge=lambda ds: {k: torch.stack([d[k] for d in ds]).sum(dim=0) for k in ds[0]})
        assert shim.captured == [] and injected(host.model) == {}
        with pytest.raises(HookError, match="does not have the keys"):
            dyprag_question(host, QUESTION, TEXTS,
                            merge=lambda ds: {k: torch.stack([d[k] for d in ds]).mean(dim=0) for k in list(ds[0])[2:]})
        assert shim.captured == []


def test_translator_error_clears_the_capture(host):
    with dyprag.install(utils=host.utils, projector=host.projector) as shim:
        with torch.no_grad():
            host.translator(embed(0))
            assert len(shim.captured) == 1
            with pytest.raises(RuntimeError):
                host.translator(torch.randn(1, 7))  # wrong width
        assert shim.captured == []


# ----------------------------------------------------------------------------- bad inputs
def test_bad_mode(host):
    with pytest.raises(HookError, match=r"mode 'svd' is not one of \['separate', 'cat'\]"):
        dyprag.install(mode="svd", utils=host.utils, projector=host.projector)
    assert dyprag.current() is None


def test_missing_or_wrong_host_modules(host):
    with pytest.raises(HookError, match="cannot import DyPRAG's 'no_such_dyprag_utils' module"):
        dyprag.install(utils="no_such_dyprag_utils", projector=host.projector)
    empty = types.ModuleType("utils")
    with pytest.raises(HookError, match="utils has no function 'delta_inject'"):
        dyprag.install(utils=empty, projector=host.projector)
    with pytest.raises(HookError, match="projector has no class 'ParameterTranslator'"):
        dyprag.install(utils=host.utils, projector=types.ModuleType("projector"))
    assert dyprag.current() is None


def test_launch_errors(tmp_path):
    with pytest.raises(HookError, match=r"option\(s\) \['data_file'\] do not apply"):
        launch_dyprag(tmp_path / "x.py", [], data_file="d.jsonl")
    with pytest.raises(HookError, match=r"x\.py: script not found"):
        launch_dyprag(tmp_path / "x.py", [])
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "inference_dyprag.py").write_text("print('hi')\n")
    before = {n: sys.modules.get(n) for n in H.HOST_MODULES}
    with pytest.raises(HookError, match="cannot import DyPRAG's '(utils|projector)' module|'utils' was imported from"):
        launch_dyprag(lone / "inference_dyprag.py", [])
    assert {n: sys.modules.get(n) for n in H.HOST_MODULES} == before
    assert dyprag.current() is None
