"""The translator in DyPRAG's layout: our checkpoints load into a double of DyPRAG's ParameterTranslator strictly and
give the same factors, the double's load into ours; the shapes are read from the file and checked against the model
in one line naming the file, the key and both shapes."""

from __future__ import annotations

import pytest
import torch

from fcprag_tools.translator import (Translator, TranslatorError, TranslatorShape, load_translator, read_state_dict,
                                     save_translator, shape_of)
from helpers import tiny_config, tiny_model

from .double import double_for


def _random_double(model, rank=2, width=8, seed=0):
    d = double_for(model, rank, width)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return d


def _same_factors(ours, double, h):
    factors = ours(h)
    for j in range(h.shape[0]):
        ref = double(h[j:j + 1])
        assert len(ref) == 2 * len(factors)
        for path, (A, B) in factors.items():
            ka = f"base_model.model.{path}.lora_A.weight"
            torch.testing.assert_close(A[j], ref[ka], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(B[j], ref[ka.replace("lora_A", "lora_B")], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_our_checkpoint_loads_strictly_into_dyprags_translator_with_the_same_factors(tmp_path, kind):
    model = tiny_model(kind)
    ours = Translator(TranslatorShape.from_config(model.config, rank=2, width=8), seed=3, init_std=0.1)
    path = save_translator(ours, tmp_path / "t.pt")
    obj = torch.load(path, weights_only=True)  # DyPRAG's loader (torch >= 2.6 loads weights only by default)
    assert list(obj) == ["model_state_dict"]
    double = double_for(model, 2, 8)
    assert list(obj["model_state_dict"]) == list(double.state_dict())  # the same keys, in DyPRAG's order
    double.load_state_dict(obj["model_state_dict"], strict=True)
    _same_factors(ours, double, torch.randn(3, model.config.hidden_size))
    # each layer is stored once although DyPRAG names it twice
    sd = obj["model_state_dict"]
    k = "projector.gate_proj_1.projector."
    assert sd[k + "pre_A_linear.weight"].data_ptr() == sd[k + "A_hypernet.linear1.weight"].data_ptr()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_dyprag_checkpoint_loads_into_ours_with_its_shape_read_from_the_file(tmp_path, kind):
    model = tiny_model(kind)
    double = _random_double(model, rank=3, width=5)
    torch.save({"model_state_dict": double.state_dict()}, tmp_path / "dyprag.pt")
    assert shape_of(read_state_dict(tmp_path / "dyprag.pt"), "x") == TranslatorShape(2, 32, 48, 3, 5)
    ours = load_translator(tmp_path / "dyprag.pt", model.config)
    assert ours.shape.rank == 3 and ours.shape.width == 5
    _same_factors(ours, double, torch.randn(4, model.config.hidden_size))
    outs = ours.dyprag_outputs(torch.ones(2, 32))  # DyPRAG's output dicts, one per passage
    assert set(outs[0]) == set(double(torch.ones(1, 32))) and outs[1]["base_model.model.model.layers.0.mlp.down_proj" \
                                                                        ".lora_A.weight"].shape == (3, 48)


@pytest.mark.parametrize("change, key, have, need", [
    ({"hidden_size": 40}, "projector.down_proj_0.projector.pre_A_linear.weight", [8, 33], [8, 41]),
    ({"intermediate_size": 64}, "projector.down_proj_0.projector.post_A_linear.weight", [96, 8], [128, 8]),
])
def test_a_checkpoint_of_other_shapes_is_one_line_naming_file_key_and_both_shapes(tmp_path, change, key, have, need):
    torch.save({"model_state_dict": double_for(tiny_model("llama")).state_dict()}, tmp_path / "t.pt")
    with pytest.raises(TranslatorError) as e:
        load_translator(tmp_path / "t.pt", tiny_config("llama", **change), model="--model big")
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "t.pt") in msg and f"'{key}'" in msg
    assert f"shape {have} but --model big needs {need}" in msg


def test_a_checkpoint_for_more_or_fewer_layers_names_the_key(tmp_path):
    torch.save({"model_state_dict": double_for(tiny_model("llama", num_hidden_layers=3)).state_dict()},
               tmp_path / "t3.pt")
    with pytest.raises(TranslatorError, match=r"t3\.pt: key 'projector\.down_proj_2\.projector\.pre_A_linear\.weight' "
                                              r"\(shape \[8, 33\]\) has no place in the model, whose layers are "
                                              r"0\.\.1"):
        load_translator(tmp_path / "t3.pt", tiny_config("llama"))
    torch.save({"model_state_dict": double_for(tiny_model("llama", num_hidden_layers=1)).state_dict()},
               tmp_path / "t1.pt")
    with pytest.raises(TranslatorError, match=r"t1\.pt: key 'projector\.down_proj_1\.projector\.pre_A_linear\.weight' "
                                              r"is missing; the model needs it with shape \[8, 33\]"):
        load_translator(tmp_path / "t1.pt", tiny_config("llama"))


@pytest.mark.parametrize("content, expect", [
    (None, "translator checkpoint not found"),
    (b"not a pickle", "cannot be read as a translator checkpoint with torch.load(weights_only=True)"),
    ({"state_dict": {}}, "expected DyPRAG's checkpoint, a dict with a non-empty 'model_state_dict'; got keys "
                         "['state_dict']"),
    ({"model_state_dict": {"projector.o_proj_0.projector.pre_A_linear.weight": torch.zeros(2, 2)}},
     "key 'projector.o_proj_0.projector.pre_A_linear.weight' is not a key of DyPRAG's ParameterTranslator"),
    ({"model_state_dict": {"projector.up_proj_0.projector.pre_A_linear.weight": torch.zeros(2)}},
     "key 'projector.up_proj_0.projector.pre_A_linear.weight' holds shape [2] torch.float32; expected a 2-D"),
])
def test_a_file_that_is_no_translator_checkpoint_is_one_line(tmp_path, content, expect):
    path = tmp_path / "x.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(TranslatorError) as e:
        load_translator(path, tiny_config("llama"))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ") and expect in str(e.value)


def test_a_pickled_object_is_refused_by_the_safe_loader(tmp_path):
    torch.save({"model_state_dict": {"x": object()}}, tmp_path / "evil.pt")  # needs the full unpickler
    with pytest.raises(TranslatorError, match="weights_only=True"):
        read_state_dict(tmp_path / "evil.pt")
