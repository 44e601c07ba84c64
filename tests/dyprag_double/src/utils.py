"""Test double of DyPRAG's ``src/utils.py`` (written from the issue's description, not from DyPRAG's code).

What the shim relies on: ``delta_inject(model, adapter_weights)`` sets ``delta = lora_B @ lora_A`` (float32, no
alpha/r scaling) on the module named by each key's prefix, ``delta_remove`` deletes it, and the model's MLP adds
``x @ delta.T`` to each projection. ``RECORD`` (double-only instrumentation) keeps, for every ``predict`` call,
the ``delta`` tensors the model actually used and the logits it produced.
"""

import json
import types

import torch

RECORD = []  # one entry per predict(): {"question", "deltas": {module: delta}, "logits"}


def get_attributes(model, dotted):
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _proj(layer, x):
    y = layer(x)
    delta = getattr(layer, "delta", None)
    if delta is not None:
        y = y + x @ delta.to(x.dtype).T
    return y


def _mlp_forward(self, x):
    return _proj(self.down_proj, self.act_fn(_proj(self.gate_proj, x)) * _proj(self.up_proj, x))


class TinyTokenizer:
    """Bytes -> ids modulo the vocabulary; enough for a random tiny model."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text):
        return [1 + b % (self.vocab_size - 1) for b in text.encode("utf-8")][:64] or [1]

    def __call__(self, text, return_tensors="pt", **_):
        return types.SimpleNamespace(input_ids=torch.tensor([self.encode(text)]))

    def decode(self, ids):
        return " ".join(f"t{int(i)}" for i in ids)


def get_model(seed=0):
    """A tiny random Llama whose MLPs use the per-module ``delta`` (DyPRAG ships such modeling code)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)  # this instance only
    return model, TinyTokenizer(config.vocab_size)


def load_data(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@torch.no_grad()
def predict(model, tokenizer, question, max_new_tokens=3):
    ids = tokenizer(question).input_ids
    deltas = {name: m.delta.detach().clone() for name, m in model.named_modules() if "delta" in vars(m)}
    out = []
    logits0 = None
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids).logits[:, -1, :]
        if logits0 is None:
            logits0 = logits[0].clone()
        nxt = logits.argmax(-1, keepdim=True)
        out.append(int(nxt))
        ids = torch.cat([ids, nxt], dim=1)
    RECORD.append({"question": question, "deltas": deltas, "logits": logits0})
    return tokenizer.decode(out)


def delta_inject(model, adapter_weights):
    for module in sorted({k.rsplit(".", 2)[0] for k in adapter_weights}):
        m = get_attributes(model, module)
        a = adapter_weights[module + ".lora_A.weight"]
        b = adapter_weights[module + ".lora_B.weight"]
        m.delta = (b @ a).to(torch.float32)


def delta_remove(model, adapter_weights):
    for module in sorted({k.rsplit(".", 2)[0] for k in adapter_weights}):
        m = get_attributes(model, module)
        if "delta" in vars(m):
            del m.delta
