"""A test double of DyPRAG's ``ParameterTranslator`` and of its inference, written from the description in issue 51
(not from DyPRAG's code): one passage at a time, DyPRAG's constructor arguments and state-dict layout.

Per projection ``m`` and layer ``i`` a container ``projector["{m}_{i}"]`` holds ``.projector`` with the layers
``pre_A_linear [width, H + 1]``, ``post_A_linear [r * in, width]``, ``pre_B_linear``, ``post_B_linear [out * r,
width]`` (no bias) and the hypernets ``A_hypernet`` / ``B_hypernet`` that reuse them as ``linear1`` / ``linear2``.
A passage embedding ``[1, H]`` with the layer index appended goes through ``linear1``, ReLU, ``linear2`` and is
reshaped to ``A [r, in]`` and ``B [out, r]``; output keys ``base_model.model.model.layers.{i}.mlp.{m}.lora_A.weight``
/ ``lora_B.weight``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class Hypernet(nn.Module):
    def __init__(self, linear1, linear2, rows, cols):
        super().__init__()
        self.linear1, self.linear2, self.rows, self.cols = linear1, linear2, rows, cols

    def forward(self, features):
        return self.linear2(torch.relu(self.linear1(features))).reshape(self.rows, self.cols)


class Layers(nn.Module):
    def __init__(self, hidden, d_in, d_out, rank, width):
        super().__init__()
        self.pre_A_linear = nn.Linear(hidden + 1, width, bias=False)
        self.post_A_linear = nn.Linear(width, rank * d_in, bias=False)
        self.A_hypernet = Hypernet(self.pre_A_linear, self.post_A_linear, rank, d_in)
        self.pre_B_linear = nn.Linear(hidden + 1, width, bias=False)
        self.post_B_linear = nn.Linear(width, d_out * rank, bias=False)
        self.B_hypernet = Hypernet(self.pre_B_linear, self.post_B_linear, d_out, rank)


class Entry(nn.Module):
    def __init__(self, layer, hidden, d_in, d_out, rank, width):
        super().__init__()
        self.layer = layer
        self.projector = Layers(hidden, d_in, d_out, rank, width)

    def forward(self, x):
        z = torch.cat([x, torch.full((1, 1), float(self.layer), dtype=torch.float32)], dim=1)
        return self.projector.A_hypernet(z), self.projector.B_hypernet(z)


class ParameterTranslator(nn.Module):
    """``ParameterTranslator(module_list, layer_idx, input_dim=hidden size, output_dim=intermediate size,
    lora_rank, hidden_dim)``; ``forward(x [1, H])`` -> DyPRAG's dict of factors for that one passage."""

    def __init__(self, module_list, layer_idx, input_dim, output_dim, lora_rank, hidden_dim=32):
        super().__init__()
        self.module_list, self.layer_idx = list(module_list), list(layer_idx)
        self.projector = nn.ModuleDict()
        for name in self.module_list:
            d_in, d_out = (output_dim, input_dim) if name == "down_proj" else (input_dim, output_dim)
            for i in self.layer_idx:
                self.projector[f"{name}_{i}"] = Entry(i, input_dim, d_in, d_out, lora_rank, hidden_dim)

    def forward(self, x):
        out = {}
        for name in self.module_list:
            for i in self.layer_idx:
                a, b = self.projector[f"{name}_{i}"](x)
                prefix = f"base_model.model.model.layers.{i}.mlp.{name}"
                out[prefix + ".lora_A.weight"], out[prefix + ".lora_B.weight"] = a, b
        return out


def double_for(model, rank=2, width=8):
    c = model.config
    return ParameterTranslator(["down_proj", "up_proj", "gate_proj"], range(c.num_hidden_layers), c.hidden_size,
                               c.intermediate_size, rank, width)


@torch.no_grad()
def dyprag_embedding(model, tok, text):
    """DyPRAG's read: the passage alone through the model, ``hidden_states[-1][:, -1, :]``."""
    ids = torch.tensor([tok(text, truncation=True, max_length=3000)["input_ids"]])
    return model(ids, output_hidden_states=True).hidden_states[-1][:, -1, :].float()


def dyprag_deltas(outputs):
    """DyPRAG's merge of per-passage outputs: mean of every key over the passages, then ``delta = B @ A`` per module
    (float64 here), keyed by the module's path in the model."""
    deltas = {}
    for ka in [k for k in outputs[0] if k.endswith(".lora_A.weight")]:
        kb = ka.replace(".lora_A.", ".lora_B.")
        a = torch.stack([o[ka].double() for o in outputs]).mean(0)
        b = torch.stack([o[kb].double() for o in outputs]).mean(0)
        deltas[ka[len("base_model.model."):-len(".lora_A.weight")]] = b @ a
    return deltas


@contextlib.contextmanager
def dense_hooks(model, deltas):
    """DyPRAG's modified MLP as forward hooks: each named projection's output gets ``x @ delta.T``."""
    def hook(delta):
        return lambda mod, inputs, out: out + (inputs[0].double() @ delta.T).to(out.dtype)

    handles = [model.get_submodule(name).register_forward_hook(hook(d)) for name, d in deltas.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def dyprag_answer(model, tok, deltas, question, answers, passages, prompt, max_new):
    """DyPRAG's inference with ``deltas`` (:func:`dyprag_deltas`) through :func:`dense_hooks`, by plain forwards: the
    gold answers' best mean token log-likelihood after the study's prompt (``combine``: ``passages`` in it,
    DyPRAG-Combine) and the greedy generation of ``max_new`` tokens at most (to a stop token)."""
    from fcprag_tools.study import scoring

    p_ids, gold = scoring.encode(tok, question, answers, passages, prompt)
    stops = {tok.eos_token_id, model.generation_config.eos_token_id}
    with dense_hooks(model, deltas):
        lps = []
        for g in gold:
            logp = torch.log_softmax(model(torch.tensor([p_ids + g])).logits[0].double(), -1)
            lps.append(float(torch.stack([logp[len(p_ids) - 1 + j, t] for j, t in enumerate(g)]).mean()))
        ids, new = list(p_ids), []
        while len(new) < max_new:
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            new.append(nxt)
            ids.append(nxt)
            if nxt in stops:
                break
    return max(lps), tok.decode(new, skip_special_tokens=True)
