"""Test double of DyPRAG's ``src/projector.py``: a tiny random translator from a passage embedding ``[1, hidden]``
to PEFT-style LoRA factors per layer and MLP projection (written from the issue's description).

Keys: ``base_model.model.model.layers.{i}.mlp.{proj}.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``. ``RECORD`` (double-only instrumentation) keeps a copy of every output, in call order.
"""

import torch
from torch import nn

RECORD = []


class ParameterTranslator(nn.Module):
    def __init__(self, module_list, layer_idx, input_dim, output_dim, lora_rank, hidden_dim=8):
        super().__init__()
        self.module_list, self.layer_idx, self.rank = list(module_list), list(layer_idx), lora_rank
        self.shapes = {}
        heads = {}
        for i in self.layer_idx:
            for name in self.module_list:
                d_in, d_out = (output_dim, input_dim) if name == "down_proj" else (input_dim, output_dim)
                self.shapes[(i, name)] = (d_in, d_out)
                heads[f"{i}_{name}"] = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.Tanh(),
                                                     nn.Linear(hidden_dim, lora_rank * (d_in + d_out)))
        self.heads = nn.ModuleDict(heads)

    def forward(self, x):
        out = {}
        r = self.rank
        for i in self.layer_idx:
            for name in self.module_list:
                d_in, d_out = self.shapes[(i, name)]
                flat = self.heads[f"{i}_{name}"](x)[0]
                prefix = f"base_model.model.model.layers.{i}.mlp.{name}"
                out[prefix + ".lora_A.weight"] = flat[: r * d_in].view(r, d_in)
                out[prefix + ".lora_B.weight"] = flat[r * d_in:].view(d_out, r)
        RECORD.append({k: v.detach().clone() for k, v in out.items()})
        return out
