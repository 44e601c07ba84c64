import types

import pytest
import torch

from dyprag_double import harness as H
from fcprag_plugin.hosts import dyprag
from fcprag_plugin.hosts.context import clear_context


@pytest.fixture
def double(tmp_path):
    """The DyPRAG double's ``src/`` copied under ``tmp_path`` and a data file with one question per
    ``harness.COUNTS``: ``(script, data file, questions)``."""
    script = H.copy_double(tmp_path)
    questions = H.make_questions(H.COUNTS)
    data = H.write_data(tmp_path / "data.jsonl", questions)
    return script, data, questions


@pytest.fixture
def host(tmp_path):
    """The DyPRAG double's ``utils`` / ``projector`` imported fresh, its tiny model wrapped by peft (LoRA on the MLP,
    as DyPRAG's inference does), its tokenizer, a translator, and the double's ``src`` directory."""
    from peft import LoraConfig, get_peft_model

    H.copy_double(tmp_path)
    with H.host_modules(tmp_path / "src") as (utils, projector):
        model, tokenizer = utils.get_model(0)
        model = get_peft_model(model, LoraConfig(target_modules=["down_proj", "gate_proj", "up_proj"], r=2,
                                                 lora_alpha=32, lora_dropout=0.0))
        torch.manual_seed(1)
        translator = projector.ParameterTranslator(["down_proj", "up_proj", "gate_proj"], [0, 1], 16, 24, 2).eval()
        yield types.SimpleNamespace(utils=utils, projector=projector, model=model, tokenizer=tokenizer,
                                    translator=translator, src=tmp_path / "src")
    dyprag.uninstall()
    clear_context()
