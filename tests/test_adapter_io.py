"""LoraAdapter loading, validation, repair and saving."""

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from fcprag_plugin import AdapterError, LoraAdapter, UnsupportedAdapterError
from fcprag_plugin.adapter import adapter_from_state_dict
from helpers import make_adapter_dir, tiny_model

GATE = "model.layers.0.mlp.gate_proj"


def _raw(dirpath):
    cfg = json.loads((dirpath / "adapter_config.json").read_text())
    sd = load_file(str(dirpath / "adapter_model.safetensors"))
    return cfg, sd


def test_load_peft_dir_shapes_and_scaling(tmp_path):
    d = make_adapter_dir(tmp_path / "a", r=2, alpha=32)
    ad = LoraAdapter.from_pretrained(d)
    cfg, sd = _raw(d)
    assert len(ad) == 2 * 3  # 2 layers x gate/up/down
    m = ad[GATE]
    assert m.A.shape == (2, 32) and m.B.shape == (48, 2)
    assert m.scaling == pytest.approx(32 / 2)
    assert torch.equal(m.A, sd[f"base_model.model.{GATE}.lora_A.weight"])
    assert torch.equal(m.B, sd[f"base_model.model.{GATE}.lora_B.weight"])
    assert ad["model.layers.1.mlp.down_proj"].A.shape == (2, 48)


def test_rslora_scaling(tmp_path):
    d = make_adapter_dir(tmp_path / "a", r=4, alpha=8, use_rslora=True)
    ad = LoraAdapter.from_pretrained(d)
    assert ad[GATE].scaling == pytest.approx(8 / math.sqrt(4))


def test_rank_and_alpha_pattern(tmp_path):
    d = make_adapter_dir(tmp_path / "a", r=2, alpha=32, rank_pattern={"down_proj": 4}, alpha_pattern={"down_proj": 4})
    ad = LoraAdapter.from_pretrained(d)
    assert ad["model.layers.0.mlp.down_proj"].rank == 4
    assert ad["model.layers.0.mlp.down_proj"].scaling == pytest.approx(1.0)
    assert ad[GATE].scaling == pytest.approx(16.0)


def test_matches_live_peft_model_and_state_dict(tmp_path):
    from peft import PeftModel

    d = make_adapter_dir(tmp_path / "a", seed=3)
    from_dir = LoraAdapter.from_pretrained(d)
    pm = PeftModel.from_pretrained(tiny_model(), str(d), adapter_name="x")
    live = LoraAdapter.from_peft_model(pm, "x")
    cfg, sd = _raw(d)
    from_sd = adapter_from_state_dict(sd, cfg)
    for other in (live, from_sd):
        assert set(other.modules) == set(from_dir.modules)
        for k in from_dir.modules:
            assert torch.equal(other[k].A, from_dir[k].A) and torch.equal(other[k].B, from_dir[k].B)
            assert other[k].scaling == pytest.approx(from_dir[k].scaling)


def test_live_model_unknown_adapter_names_available(tmp_path):
    from peft import PeftModel

    d = make_adapter_dir(tmp_path / "a")
    pm = PeftModel.from_pretrained(tiny_model(), str(d), adapter_name="x")
    with pytest.raises(AdapterError, match=r"'nope'.*\['x'\]"):
        LoraAdapter.from_peft_model(pm, "nope")


def test_legacy_bin_weights_only(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    cfg, sd = _raw(d)
    (d / "adapter_model.safetensors").unlink()
    torch.save(sd, d / "adapter_model.bin")
    ad = LoraAdapter.from_pretrained(d)
    assert torch.equal(ad[GATE].A, sd[f"base_model.model.{GATE}.lora_A.weight"])


def test_legacy_bin_refuses_pickled_code(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    (d / "adapter_model.safetensors").unlink()

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, d / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin.*weights_only=True"):
        LoraAdapter.from_pretrained(d)


def test_prag_doubled_prefix_repaired_with_warning(tmp_path, caplog):
    d = make_adapter_dir(tmp_path / "a")
    cfg, sd = _raw(d)
    doubled = {"base_model.model." + k: v for k, v in sd.items()}
    save_file(doubled, str(d / "adapter_model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="fcprag_plugin"):
        ad = LoraAdapter.from_pretrained(d)
    assert GATE in ad.modules
    assert any("doubled" in r.getMessage() for r in caplog.records)


def test_zero_b_warns(tmp_path, caplog):
    d = make_adapter_dir(tmp_path / "a", zero_b=True)
    with caplog.at_level(logging.WARNING, logger="fcprag_plugin"):
        ad = LoraAdapter.from_pretrained(d)
    assert ad.is_zero()
    assert any("does nothing" in r.getMessage() and str(d) in r.getMessage() for r in caplog.records)


def test_save_roundtrip_loads_in_peft_and_reproduces_delta(tmp_path):
    from peft import PeftModel

    d = make_adapter_dir(tmp_path / "a", seed=5, rank_pattern={"down_proj": 3})
    ad = LoraAdapter.from_pretrained(d)
    out = ad.save_pretrained(tmp_path / "copy")
    again = LoraAdapter.from_pretrained(out)
    pm = PeftModel.from_pretrained(tiny_model(), str(out), adapter_name="c")
    live = LoraAdapter.from_peft_model(pm, "c")
    for k in ad.modules:
        ref = ad[k].delta()
        torch.testing.assert_close(again[k].delta(), ref)
        torch.testing.assert_close(live[k].delta(), ref)


# ----------------------------------------------------------------------------- error paths
def test_missing_dir(tmp_path):
    with pytest.raises(AdapterError, match=r"nowhere.*not found"):
        LoraAdapter.from_pretrained(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    (d / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"adapter_config\.json.*not found"):
        LoraAdapter.from_pretrained(d)


def test_missing_weights(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"no adapter weights found.*adapter_model\.safetensors"):
        LoraAdapter.from_pretrained(d)


def test_corrupt_safetensors(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    p = d / "adapter_model.safetensors"
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: corrupt"):
        LoraAdapter.from_pretrained(d)


def test_bad_json_config(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    (d / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match=r"adapter_config\.json:1: not valid JSON"):
        LoraAdapter.from_pretrained(d)


def test_non_finite_values_named(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    cfg, sd = _raw(d)
    key = f"base_model.model.{GATE}.lora_B.weight"
    sd[key][0, 0] = float("nan")
    save_file(sd, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=rf"{GATE}\.lora_B\.weight.*non-finite"):
        LoraAdapter.from_pretrained(d)


def test_shape_mismatch_named(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    cfg, sd = _raw(d)
    sd[f"base_model.model.{GATE}.lora_B.weight"] = torch.randn(48, 3)
    save_file(sd, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=rf"{GATE}\.lora_A\.weight.*\[2, 32\].*lora_B\.weight.*\[48, 3\]"):
        LoraAdapter.from_pretrained(d)


def test_rank_vs_config_mismatch(tmp_path):
    d = make_adapter_dir(tmp_path / "a", r=2)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["r"] = 8
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"rank 2 in its weights but the config says r=8"):
        LoraAdapter.from_pretrained(d)


def test_unpaired_key(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    cfg, sd = _raw(d)
    del sd[f"base_model.model.{GATE}.lora_B.weight"]
    save_file(sd, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=rf"'{GATE}' has no 'lora_B\.weight'"):
        LoraAdapter.from_pretrained(d)


def test_unknown_key_layout(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    cfg, sd = _raw(d)
    sd["base_model.model.lm_head.weight"] = torch.zeros(2, 2)
    save_file(sd, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"unknown key layout 'base_model\.model\.lm_head\.weight'"):
        LoraAdapter.from_pretrained(d)


@pytest.mark.parametrize("key,value,what", [
    ("use_dora", True, "DoRA"),
    ("alora_invocation_tokens", [7, 8], "variant"),
    ("arrow_config", {"top_k": 2}, "variant"),
    ("target_parameters", ["experts.gate_up_proj"], "variant"),
    ("init_lora_weights", "mica", "MiCA"),
    ("lora_bias", True, "bias"),
    ("peft_type", "IA3", "IA3"),
])
def test_unsupported_variants_by_config(tmp_path, key, value, what):
    d = make_adapter_dir(tmp_path / "a")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg[key] = value
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedAdapterError, match=rf"adapter_config\.json.*{key}.*{what}|{what}.*not supported"):
        LoraAdapter.from_pretrained(d)


@pytest.mark.parametrize("suffix,what", [
    ("lora_magnitude_vector", "DoRA"),
    ("lora_B.bias", "bias"),
    ("lora_embedding_A", "embedding"),
])
def test_unsupported_variants_by_key(tmp_path, suffix, what):
    d = make_adapter_dir(tmp_path / "a")
    cfg, sd = _raw(d)
    bad = f"base_model.model.{GATE}.{suffix}"
    sd[bad] = torch.zeros(4)
    save_file(sd, str(d / "adapter_model.safetensors"))
    with pytest.raises(UnsupportedAdapterError, match=rf"{bad.replace('.', '[.]')}.*{what}"):
        LoraAdapter.from_pretrained(d)


def test_real_dora_adapter_rejected(tmp_path):
    d = make_adapter_dir(tmp_path / "a", use_dora=True)
    with pytest.raises(UnsupportedAdapterError, match="DoRA"):
        LoraAdapter.from_pretrained(d)


@pytest.mark.parametrize("variant", [{"use_dora": True}, {"alora_invocation_tokens": [5, 6]}])
def test_live_lora_variants_are_refused(variant):
    """A live layer whose adapter is a LoRA variant (its forward is not scaling * B @ A: DoRA, activated LoRA) is
    refused by name, on peft versions with a per-adapter lora_variant and on those with only use_dora."""
    from peft import LoraConfig, get_peft_model

    if not all(hasattr(LoraConfig(), k) for k in variant):
        pytest.skip(f"this peft has no {list(variant)}")
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["gate_proj"], task_type="CAUSAL_LM", **variant)
    pm = get_peft_model(tiny_model(), cfg, adapter_name="v")
    with pytest.raises(UnsupportedAdapterError, match=r"live model adapter 'v': module '.*gate_proj' uses the LoRA "
                                                      r"variant \w+, which is not supported"):
        LoraAdapter.from_peft_model(pm, "v")


def test_bad_config_values(tmp_path):
    d = make_adapter_dir(tmp_path / "a")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["lora_alpha"] = "big"
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"'lora_alpha' must be a positive number, got 'big'"):
        LoraAdapter.from_pretrained(d)


def test_bf16_adapter_loads_and_keeps_dtype(tmp_path):
    d = make_adapter_dir(tmp_path / "a", dtype=torch.bfloat16)
    ad = LoraAdapter.from_pretrained(d)
    assert ad.dtype == torch.bfloat16
