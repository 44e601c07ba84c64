"""The shims' ``use_slot`` option: the merge lives in a ``FusedSlot`` instead of merged PEFT modules (PRAG) or
dense ``delta`` tensors (DyPRAG). Every check compares with the default shim path and with an independent dense
reference; the base model must be bit-identical outside a question. Note: test functions avoid local variables
named ``question`` + ``passages`` unless they mean them (the shims read callers' locals).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from dyprag_double import harness as H
from dyprag_double.harness import COUNTS
from fcprag_plugin.compat import peft_has_stale_config_bug
from fcprag_plugin.controller import FusionController
from fcprag_plugin.errors import HookError
from fcprag_plugin.hosts import dyprag, prag
from fcprag_plugin.slot import FusedSlot, fused
from fcprag_tools.launch import launch_dyprag, launch_prag, run_script
from helpers import files_reference, fixed_controller, fixed_weights_by_hand, hash_embed, hash_encoder
from prag_double.world import DOUBLE_SCRIPT, World, build_world, dense_reference, read_capture, reference_logits

STALE = peft_has_stale_config_bug()


@pytest.fixture(autouse=True)
def _no_shim_leaks():
    yield
    prag.uninstall()
    prag.clear_context()
    dyprag.uninstall()


def base_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ============================================================================= PRAG
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def world(request, tmp_path_factory) -> World:
    return build_world(tmp_path_factory.mktemp(f"slot_world_{request.param}"), kind=request.param)


def run_double(world: World, tmp: Path, name: str, **options) -> tuple[Path, list[dict]]:
    cap, log = tmp / name, tmp / f"{name}.jsonl"
    cap.mkdir()
    rc = launch_prag(str(DOUBLE_SCRIPT), world.args(cap, generate=3), log=log, **options)
    assert rc == 0 and not prag.is_installed()
    return cap, [json.loads(line) for line in log.read_text().splitlines()]


def fused_weights_switches(monkeypatch, on_cpu: bool, route: str = "auto") -> list[bool]:
    """Let route 'auto' use fused weights on the CPU (``on_cpu``), set every slot's ``route``, and record every
    switch to fused weights (its result)."""
    monkeypatch.setattr(fused, "AUTO_ON_CPU", on_cpu)
    monkeypatch.setattr(FusedSlot, "route", route)
    switches: list[bool] = []
    to_weights = FusedSlot._to_weights
    monkeypatch.setattr(FusedSlot, "_to_weights", lambda self: switches.append(to_weights(self)) or switches[-1])
    return switches


@pytest.mark.parametrize("on_weights", [False, True], ids=["hooks", "fused_weights"])
def test_prag_slot_equals_default_path_and_dense_reference(world, tmp_path, monkeypatch, on_weights):
    """Four questions in a row (N = 3, 4, 2, 3; ranks 2 and 4): on peft < 0.19 this is the stale-config case.
    The generation runs through the hooks, or (route auto with the CPU allowed) on fused weights."""
    opts = dict(controller=fixed_controller(), encoder=hash_encoder(16))
    default, _ = run_double(world, tmp_path, "default", **opts)
    switches = fused_weights_switches(monkeypatch, on_weights)
    slot, records = run_double(world, tmp_path, "slot", use_slot=True, **opts)
    assert (len(switches) >= len(world.records) and all(switches)) if on_weights else not switches
    from safetensors.torch import load_file

    probes = load_file(str(slot / "base.safetensors"))
    for t, rec in enumerate(world.records):
        w = fixed_weights_by_hand(rec["question"], rec["passages"])
        assert records[t]["merge_weights"] == pytest.approx(w, abs=1e-5)
        assert records[t]["use_slot"] is True and "FusedSlot" in records[t]["slot"]
        d_dw, d_logits, d_info = read_capture(default, t)
        s_dw, s_logits, s_info = read_capture(slot, t)
        assert d_dw and s_dw == {}  # the slot path built no merged PEFT layers ...
        assert all(v > 0 for v in d_info["layers_per_adapter"].values())
        assert set(s_info["layers_per_adapter"]) == set(d_info["layers_per_adapter"])
        assert all(v == 0 for v in s_info["layers_per_adapter"].values())  # ... and no passage's PEFT layers
        torch.testing.assert_close(s_logits, d_logits, rtol=1e-5, atol=1e-5)
        want = reference_logits(world, dense_reference(world, t, dict(enumerate(w))), rec["question"])
        torch.testing.assert_close(s_logits, want, rtol=1e-4, atol=1e-4)
        assert (want - probes["before"]).abs().max() > 1e-3  # the merge matters: the check can fail
        assert s_info["generated"] == d_info["generated"]
        assert torch.equal(probes[f"after_q{t}"], probes["before"])  # nothing of a question outlives it
    assert torch.equal(probes["after"], probes["before"])


def test_prag_slot_uniform_and_growth(tmp_path):
    """No controller: w~ = 1. The slot is sized for question 1 (3 adapters), grows once for question 2 (4)."""
    w = build_world(tmp_path / "w", ns=(3, 4, 2))
    cap = tmp_path / "cap"
    cap.mkdir()
    with prag.installed(controller=None, use_slot=True) as shim:
        run_script(DOUBLE_SCRIPT, w.args(cap))
        assert shim.slots.resizes == 1 and shim.merges == 3
        assert "max_adapters=4" in repr(shim.slots.slots()[0])  # grown for question 2, kept for question 3
    for t, rec in enumerate(w.records):
        want = reference_logits(w, dense_reference(w, t, {p: 1.0 for p in range(len(rec["passages"]))}),
                                rec["question"])
        torch.testing.assert_close(read_capture(cap, t)[1], want, rtol=1e-4, atol=1e-4)


def test_prag_fixed_capacity_too_small_is_named(tmp_path):
    w = build_world(tmp_path / "w", ns=(2, 3))
    cap = tmp_path / "cap"
    cap.mkdir()
    with pytest.raises(HookError, match=r"merges 3 adapters but the fused slot holds max_adapters=2"):
        launch_prag(str(DOUBLE_SCRIPT), w.args(cap), use_slot=True, slot_max_adapters=2)
    assert (cap / "q0.safetensors").exists() and not (cap / "q1.safetensors").exists()
    assert not prag.is_installed()


def _peft_model(adapter_dirs, base=None):
    from peft import PeftModel

    from helpers import tiny_model

    pm = PeftModel.from_pretrained(base if base is not None else tiny_model(), str(adapter_dirs[0]), adapter_name="0")
    for i, d in enumerate(adapter_dirs[1:], start=1):
        pm.load_adapter(str(d), adapter_name=str(i))
    return pm


def _dense_logits(base, dw: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Logits of a deep copy of ``base`` with ``W + dW`` written in (independent of PEFT and of the slot)."""
    import copy

    m = copy.deepcopy(base)
    mods = dict(m.named_modules())
    with torch.no_grad():
        for name, d in dw.items():
            mods[name].weight += d.to(mods[name].weight.dtype)
        return m(input_ids=ids).logits


@pytest.mark.parametrize("mode", ["cat", "separate"])
def test_prag_slot_lifecycle_on_a_live_model(adapter_dirs, mode):
    """from_pretrained -> load_adapter -> add_weighted_adapter -> set_adapter -> disable_adapter -> delete_adapter
    -> unload -> uninstall, against the default shim and a dense reference."""
    from helpers import tiny_model

    base = tiny_model()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        bare = base(input_ids=ids).logits
    pristine = {k: v.clone() for k, v in base.state_dict().items()}
    question = "violin opera senate"
    passages = ["violin opera", "glacier comet", "river harbor"]
    w = fixed_weights_by_hand(question, passages)
    want = _dense_logits(base, files_reference(adapter_dirs, w, mode), ids)
    only_0_want = _dense_logits(base, files_reference(adapter_dirs[:1], [1.0], "cat"), ids)
    # the default shim's result on the same inputs
    with prag.installed(controller=fixed_controller(), encoder=hash_encoder(16), mode=mode):
        ref_pm = _peft_model(adapter_dirs, tiny_model())
        ref_pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
        ref_pm.set_adapter("merge")
        with torch.no_grad():
            default_logits = ref_pm(input_ids=ids).logits
    torch.testing.assert_close(default_logits, want, rtol=1e-4, atol=1e-4)

    with prag.installed(controller=fixed_controller(), encoder=hash_encoder(16), mode=mode, use_slot=True) as shim:
        pm = _peft_model(adapter_dirs, base)
        assert not any(hasattr(m, "lora_A") for m in base.modules())  # no PEFT module was created
        assert pm.active_adapter == "0" and sorted(pm.peft_config) == ["0", "1", "2"]
        assert pm.peft_config["1"].r == 2 and pm.config is base.config and pm.get_base_model() is base
        with torch.no_grad():
            only_0 = pm(input_ids=ids).logits  # PEFT's own state: adapter "0" active
        torch.testing.assert_close(only_0, only_0_want, rtol=1e-4, atol=1e-4)
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
        assert "merge" in pm.peft_config and shim.merges == 1
        slot = shim.slots.slot_of(base)
        with torch.no_grad():
            assert torch.equal(pm(input_ids=ids).logits, only_0)  # not active before set_adapter, like peft
            pm.set_adapter("merge")
            on = pm(input_ids=ids).logits
            got = slot.current_adapter()
            with pm.disable_adapter():
                off = pm(input_ids=ids).logits
            again = pm(input_ids=ids).logits
        for module, d in files_reference(adapter_dirs, w, mode).items():
            torch.testing.assert_close(got.modules[module].delta().double(), d, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(on, default_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(on, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(off, bare) and torch.equal(again, on)
        pm.delete_adapter("merge")
        assert "merge" not in pm.peft_config and pm.active_adapter == "0"  # like PEFT: adapter "0" active again
        with torch.no_grad():
            torch.testing.assert_close(pm.base_model(input_ids=ids).logits, only_0, rtol=1e-6, atol=1e-6)
        unloaded = pm.unload()
        assert unloaded is base and not slot.active
        with torch.no_grad():
            assert torch.equal(base(input_ids=ids).logits, bare)  # bit-identical outside a question
        assert base_hooks(base) > 0  # the slot stays installed between questions ...
        with pytest.raises(HookError, match=r"set_adapter\(\) after unload"):
            pm.set_adapter("0")
    assert base_hooks(base) == 0  # ... and uninstall removes it
    for k, v in base.state_dict().items():
        assert torch.equal(v, pristine[k]), k  # no weight was ever written


def test_prag_slot_two_merges_switch_and_refusals(adapter_dirs, caplog):
    from helpers import tiny_model

    base = tiny_model()
    ids = torch.tensor([[2, 7, 1, 8, 2, 8]])
    question, passages = "q", ["a", "b", "c"]  # noqa: F841  (read by the shim from this frame)
    refs = {k: _dense_logits(base, files_reference(dirs, [1.0] * len(dirs), "cat"), ids)
            for k, dirs in (("all", adapter_dirs), ("two", adapter_dirs[1:]), ("m", adapter_dirs[:2]))}
    with prag.installed(controller=None, use_slot=True) as shim:
        pm = _peft_model(adapter_dirs, base)
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="all", combination_type="cat")
        prag.set_context("q", ["b", "c"])
        pm.add_weighted_adapter(["1", "2"], [1, 1], adapter_name="two", combination_type="cat")
        pm.add_weighted_adapter(["1"], [1], adapter_name="two", combination_type="cat")  # exists: no-op, like peft
        assert shim.merges == 2
        with torch.no_grad():
            for name in ("all", "two", "all"):
                pm.set_adapter(name)
                torch.testing.assert_close(pm(input_ids=ids).logits, refs[name], rtol=1e-4, atol=1e-4)
        with pytest.raises(HookError, match=r"merge_and_unload\(\) with adapter 'all' active"):
            pm.merge_and_unload()
        with pytest.raises(HookError, match=r"adapter '7' is not loaded \(loaded: \['0', '1', '2'\]\)"):
            pm.add_weighted_adapter(["0", "7"], [1, 1], adapter_name="bad", combination_type="cat")
        with pytest.raises(HookError, match=r"set_adapter\('nope'\): no such adapter"):
            pm.set_adapter("nope")
        with pytest.raises(HookError, match=r"an adapter named '1' is already loaded"):
            pm.load_adapter(str(adapter_dirs[0]), adapter_name="1")
        with pytest.raises(HookError, match=r"save_pretrained is a PeftModel feature the fused slot does not"):
            pm.save_pretrained("anywhere")
        from peft import PeftModel

        with pytest.raises(HookError, match=r"call unload\(\) on it first"):
            PeftModel.from_pretrained(pm, str(adapter_dirs[0]), adapter_name="x")
        pm.delete_adapter("1")  # a merge keeps its own copy of its adapters, as PEFT's materialised merge does
        pm.set_adapter("two")
        with torch.no_grad():
            torch.testing.assert_close(pm(input_ids=ids).logits, refs["two"], rtol=1e-4, atol=1e-4)
        assert pm.peft_config["two"].r == 4  # cat of two rank-2 adapters
        for name in ("all", "two", "0", "2"):
            pm.delete_adapter(name)
        assert pm.active_adapter is None and pm.peft_config == {}
        assert pm.merge_and_unload() is base  # nothing active: nothing would be written
        # a trainable from_pretrained stays PEFT's own; PEFT merges such adapters (with the controller's weights)
        tpm = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="0", is_trainable=True)
        assert isinstance(tpm, PeftModel)
        tpm.load_adapter(str(adapter_dirs[1]), adapter_name="1")
        prag.set_context("q", ["a", "b"])
        with caplog.at_level("WARNING", logger="fcprag_plugin"):
            tpm.add_weighted_adapter(["0", "1"], [1, 1], adapter_name="m", combination_type="cat")
        assert "PEFT merges them, not the fused slot" in caplog.text
        tpm.set_adapter("m")
        with torch.no_grad():
            torch.testing.assert_close(tpm(input_ids=ids).logits, refs["m"], rtol=1e-4, atol=1e-4)
        tpm.delete_adapter("m")
        tpm.unload()


def test_prag_slot_bad_options():
    with pytest.raises(HookError, match=r"use_slot supports modes \['cat', 'separate'\], not 'svd'"):
        prag.install(mode="svd", use_slot=True)
    with pytest.raises(HookError, match="only applies with use_slot"):
        prag.install(max_adapters=4)
    with pytest.raises(HookError, match="must be a positive integer.*got 0"):
        prag.install(use_slot=True, max_adapters=0)
    assert not prag.is_installed()


# ============================================================================= DyPRAG
@pytest.mark.parametrize("mode", ["separate", "cat"])
@pytest.mark.parametrize("ctrl", ["fixed", "none"])
@pytest.mark.parametrize("on_weights", [False, True], ids=["hooks", "fused_weights"])
def test_dyprag_slot_equals_default_path_and_reference(double, tmp_path, encoder16, mode, ctrl, monkeypatch,
                                                        on_weights):
    script, data, questions = double
    controller = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16) if ctrl == "fixed" else None
    runs = {}
    # the double decodes without a KV cache (route auto would keep the hooks): fused weights from the write on
    switches = fused_weights_switches(monkeypatch, on_weights, "weights" if on_weights else "auto")
    for use_slot in (False, True):
        rec, out, log = (tmp_path / f"{use_slot}.{x}" for x in ("pt", "json", "jsonl"))
        rc = launch_dyprag(script, ["--data", str(data), "--record", str(rec), "--out", str(out)],
                           controller=controller, encoder=encoder16, mode=mode, log=log, use_slot=use_slot)
        assert rc == 0 and dyprag.current() is None
        runs[use_slot] = (H.load_record(rec), json.loads(out.read_text()),
                          [json.loads(line) for line in log.read_text().splitlines()])
    (d_rec, d_out, _), (s_rec, s_out, s_log) = runs[False], runs[True]
    # the slot was off while the next question's passages were embedded: identical translator outputs
    assert len(d_rec["translator"]) == len(s_rec["translator"]) == sum(COUNTS)
    for a, b in zip(d_rec["translator"], s_rec["translator"]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    ref_fn = H.reference_separate if mode == "separate" else H.reference_delta
    for qi, (outs, q) in enumerate(zip(H.group_outputs(s_rec), questions)):
        d_pred, s_pred = d_rec["predict"][qi], s_rec["predict"][qi]
        assert d_pred["deltas"] and s_pred["deltas"] == {}  # the dense delta path did nothing
        torch.testing.assert_close(s_pred["logits"], d_pred["logits"], rtol=1e-5, atol=1e-5)
        u = H.controller_u(controller, encoder16, q["question"], q["passages"])
        want = H.reference_logits(script.parent, q["question"], ref_fn(outs, u))
        torch.testing.assert_close(s_pred["logits"], want, rtol=1e-4, atol=1e-4)
        assert s_log[qi]["use_slot"] is True and "FusedSlot" in s_log[qi]["slot"]
        assert s_log[qi]["u"] == pytest.approx(u, rel=1e-6)
    assert [p["text"] for p in s_out] == [p["text"] for p in d_out]
    assert (len(switches) >= len(questions) and all(switches)) if on_weights else not switches
    # the update matters (the comparison can fail): the largest question's logits move off the bare model
    bare = H.reference_logits(script.parent, questions[4]["question"], {})
    assert (s_rec["predict"][4]["logits"] - bare).abs().max() > 1e-4


TEXTS = ["the famous bridge in the old town was built by person one",
         "unrelated text about weather and cooking",
         "sports scores from last year in another city"]
QUESTION = "who built the famous bridge in the old town"


def _one_question(h, n: int = 3):
    question, passages = QUESTION, TEXTS[:n]  # noqa: F841  (read by the shim from this frame)
    with torch.no_grad():
        outs = [h.translator(torch.randn(1, 16, generator=torch.Generator().manual_seed(100 + i)))
                for i in range(n)]
    merged = {k: torch.stack([o[k] for o in outs]).mean(dim=0) for k in outs[0]}
    h.utils.delta_inject(h.model, merged)
    return outs, merged


def _strict_delta_remove(model, adapter_weights):
    """DyPRAG's own delta_remove deletes ``delta`` unconditionally (an AttributeError when there is none)."""
    for module in sorted({k.rsplit(".", 2)[0] for k in adapter_weights}):
        obj = model
        for part in module.split("."):
            obj = getattr(obj, part)
        delattr(obj, "delta")


@pytest.mark.parametrize("mode", ["separate", "cat"])
def test_dyprag_slot_on_a_live_model(host, encoder16, mode, monkeypatch):
    monkeypatch.setattr(host.utils, "delta_remove", _strict_delta_remove)
    ids = host.tokenizer(QUESTION).input_ids
    with torch.no_grad():
        bare = host.model(input_ids=ids).logits
    ctrl = FusionController.fixed(g=0.9, tau=0.05, embed_dim=16)
    with dyprag.installed(ctrl, encoder16, mode, utils=host.utils, projector=host.projector, use_slot=True) as shim:
        outs, merged = _one_question(host)
        assert {n for n, m in host.model.named_modules() if "delta" in vars(m)} == set()
        slot = shim.slots.slot_of(host.model)
        assert slot is not None and slot.active
        u = H.controller_u(ctrl, encoder16, QUESTION, TEXTS)
        ref = (H.reference_separate if mode == "separate" else H.reference_delta)(outs, u)
        with torch.no_grad():
            got = host.model(input_ids=ids).logits[0, -1]
        torch.testing.assert_close(got, H.reference_logits(host.src, QUESTION, ref), rtol=1e-4, atol=1e-4)
        host.utils.delta_remove(host.model, merged)  # DyPRAG's strict version would raise without the patch
        assert not slot.active
        with torch.no_grad():
            assert torch.equal(host.model(input_ids=ids).logits, bare)
        assert base_hooks(host.model) > 0
    assert base_hooks(host.model) == 0 and host.utils.delta_remove is _strict_delta_remove


def test_dyprag_slot_errors(host, tmp_path, monkeypatch):
    with dyprag.installed(utils=host.utils, projector=host.projector, use_slot=True, max_adapters=2):
        with pytest.raises(HookError, match=r"merges 3 adapters but the fused slot holds max_adapters=2"):
            _one_question(host, 3)
        _one_question(host, 2)
    # a translator that returns a real batch of factors ([2, r, in]): one slot cannot hold them
    cls = host.projector.ParameterTranslator
    plain = cls.forward
    monkeypatch.setattr(cls, "forward",
                        lambda self, x: {k: v.unsqueeze(0).expand(2, *v.shape) for k, v in plain(self, x).items()})
    with dyprag.installed(utils=host.utils, projector=host.projector, use_slot=True):
        with pytest.raises(HookError, match=r"key 'base_model\.model\.model\.layers\.\d\.mlp\.\w+\.lora_[AB]\.weight' "
                                            r"has shape \[2, .*one \[r, in\] / \[out, r\] factor pair"):
            _one_question(host, 2)
    monkeypatch.setattr(cls, "forward", plain)
    with pytest.raises(HookError, match="only applies with use_slot"):
        dyprag.install(utils=host.utils, projector=host.projector, max_adapters=3)
    no_remove = types.ModuleType("utils")
    no_remove.delta_inject = host.utils.delta_inject
    with pytest.raises(HookError, match="has no function 'delta_remove'"):
        dyprag.install(utils=no_remove, projector=host.projector, use_slot=True)
    assert dyprag.current() is None
    with pytest.raises(HookError, match="only applies with use_slot"):
        launch_dyprag(tmp_path / "x.py", [], slot_max_adapters=3)


@pytest.mark.parametrize("use_slot", [False, True])
def test_prag_side_feature_controller_gets_ranks_and_adapter_stats(adapter_dirs, encoder16, use_slot):
    """Both PRAG paths hand a side-feature controller the passage positions as ranks and the statistics of the
    adapters PRAG loaded (from the live PEFT layers, or from the slot's store)."""
    from peft import PeftModel

    from fcprag_plugin.adapter import LoraAdapter
    from fcprag_plugin.controller import ControllerConfig
    from helpers import tiny_model

    ctrl = FusionController(ControllerConfig(embed_dim=16, score_hidden=[8], calib_hidden=8, init="random", seed=4,
                                             side_features=["retrieval_rank", "adapter_stats"])).eval()
    loaded = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    q, ps = "violin opera senate", ["violin opera", "glacier comet", "river harbor"]
    ref = ctrl.predict(q, ps, encoder16, retrieval_ranks=[1.0, 2.0, 3.0], adapter_stats=loaded)
    with prag.installed(controller=ctrl, encoder=encoder16, use_slot=use_slot) as shim:
        pm = PeftModel.from_pretrained(tiny_model(), str(adapter_dirs[0]), adapter_name="0")
        for i, d in enumerate(adapter_dirs[1:], start=1):
            pm.load_adapter(str(d), adapter_name=str(i))
        prag.set_context(q, ps)
        pm.add_weighted_adapter(["0", "1", "2"], [1, 1, 1], adapter_name="merge", combination_type="cat")
        got = shim.last_record["merge_weights"]
    assert got == pytest.approx(ref.merge_weights[0].tolist(), abs=1e-6)
    assert len(set(round(w, 6) for w in got)) > 1  # not uniform: the check can fail
