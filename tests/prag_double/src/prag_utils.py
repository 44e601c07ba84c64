"""Helpers of the PRAG-shaped test double: model, data, prediction, capture (see ../README.md)."""

import json
import os

import torch


def get_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def load_data(data_file):
    """``(group, records)``: the data file's stem names the adapter folder, like PRAG's ``{type}.json``."""
    with open(data_file, encoding="utf-8") as f:
        records = json.load(f)
    return os.path.splitext(os.path.basename(data_file))[0], records


def token_ids(text, vocab_size, max_len=12):
    return [1 + b % (vocab_size - 1) for b in text.encode("utf-8")][:max_len]


@torch.no_grad()
def predict(model, text):
    """Last-position logits ``[vocab]`` for a deterministic tokenization of ``text``."""
    vocab = model.config.vocab_size
    ids = torch.tensor([token_ids(text, vocab)])
    return model(input_ids=ids).logits[0, -1].float().clone()


@torch.no_grad()
def generate(model, text, max_new_tokens):
    """Greedy ``model.generate`` (PRAG answers with generate): the new token ids ``[max_new_tokens]``."""
    ids = torch.tensor([token_ids(text, model.config.vocab_size)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].clone()


def lora_layers(model, adapter_name):
    """``{module name (no peft prefix): layer}`` of the live LoRA layers holding ``adapter_name``."""
    out = {}
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if hasattr(lora_a, "keys") and adapter_name in lora_a:
            while name.startswith("base_model.model."):
                name = name[len("base_model.model."):]
            out[name] = module
    return out


def save_capture(model, adapter_name, adapter_names, logits, path, generated=None):
    """Merged factors per module, the logits (and generated ids), and how many layers each passage adapter had."""
    from safetensors.torch import save_file

    tensors = {"logits": logits.contiguous()}
    if generated is not None:
        tensors["generated"] = generated.contiguous()
    for name, layer in lora_layers(model, adapter_name).items():
        tensors[f"{name}::A"] = layer.lora_A[adapter_name].weight.detach().float().contiguous().clone()
        tensors[f"{name}::B"] = layer.lora_B[adapter_name].weight.detach().float().contiguous().clone()
        tensors[f"{name}::scaling"] = torch.tensor(float(layer.scaling[adapter_name]))
    save_file(tensors, path + ".safetensors")
    layers = {n: len(lora_layers(model, n)) for n in adapter_names}
    with open(path + ".json", "w", encoding="utf-8") as f:
        json.dump({"layers_per_adapter": layers}, f)
