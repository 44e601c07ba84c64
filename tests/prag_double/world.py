"""Builds the on-disk world the PRAG-shaped double runs in, and reads back what it captured.

Everything here is independent of fcprag_plugin: adapters are read straight from their safetensors and
``adapter_config.json``, and the reference update is the dense ``sum_i w_i * (alpha_i/r_i) * B_i @ A_i``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

DOUBLE_SCRIPT = Path(__file__).parent / "src" / "inference.py"
PEFT_PREFIX = "base_model.model."

# Passage counts of the default questions: 3, then 4 after 3, then 2, then 3 (PRAG's reproduction shape).
DEFAULT_NS = (3, 4, 2, 3)
WORDS = ["river", "castle", "election", "violin", "glacier", "novel", "harbor", "comet", "tariff", "orchid",
         "bridge", "senate", "opera", "desert", "reactor", "falcon"]


@dataclass
class World:
    root: Path
    model_dir: Path
    data_file: Path
    adapter_root: Path
    records: list[dict]
    group: str = "dev"
    extra: dict = field(default_factory=dict)

    def adapter_path(self, test_id: int, pid: int) -> Path:
        return self.adapter_root / self.group / f"data_{test_id}" / f"passage_{pid}"

    def args(self, capture_dir: Path | None = None, context: str = "locals", sample: int = -1, generate: int = 0
             ) -> list[str]:
        out = ["--model_name", str(self.model_dir), "--data_file", str(self.data_file),
               "--adapter_root", str(self.adapter_root), "--context", context, "--sample", str(sample)]
        if generate:
            out += ["--generate", str(generate)]
        if capture_dir is not None:
            out += ["--capture_dir", str(capture_dir)]
        return out


def _texts(test_id: int, n: int) -> tuple[str, list[str]]:
    q = f"which {WORDS[test_id % 16]} is near the {WORDS[(3 * test_id + 5) % 16]}"
    ps = [" ".join(WORDS[(test_id * 5 + p * 3 + k) % 16] for k in range(4 + p)) for p in range(n)]
    return q, ps


def build_world(root: Path, ns: Sequence[int] = DEFAULT_NS, zero_b: Sequence[tuple[int, int]] = (),
                kind: str = "llama", ranks: Sequence[tuple[int, float]] = ((2, 32), (4, 16))) -> World:
    """Tiny Llama (or ``kind="qwen2"``) saved to disk, ``dev.json`` records, and one real PEFT adapter per
    (question, passage).

    Ranks and alphas cycle through ``ranks`` (default r=2, alpha=32 / r=4, alpha=16, so the scalings differ
    between passages).
    """
    from helpers import make_adapter_dir, tiny_model

    root = Path(root)
    model_dir = root / "model"
    tiny_model(kind, seed=1234).save_pretrained(str(model_dir))
    records = []
    for t, n in enumerate(ns):
        q, ps = _texts(t, n)
        records.append({"question": q, "passages": ps, "answer": "x"})
    data_file = root / "dev.json"
    data_file.write_text(json.dumps(records), encoding="utf-8")
    w = World(root, model_dir, data_file, root / "adapters", records)
    for t, n in enumerate(ns):
        for p in range(n):
            r, alpha = ranks[p % len(ranks)]
            make_adapter_dir(w.adapter_path(t, p), kind, seed=100 * t + p, r=r, alpha=alpha,
                             zero_b=(t, p) in set(zero_b))
    return w


# ----------------------------------------------------------------------------- independent readers
def read_adapter(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module: (A [r, in], B [out, r], alpha/r)}`` straight from the adapter directory."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    sd = load_file(str(Path(path) / "adapter_model.safetensors"))
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            while module.startswith(PEFT_PREFIX):
                module = module[len(PEFT_PREFIX):]
            A = sd[key].double()
            B = sd[key.replace(".lora_A.", ".lora_B.")].double()
            out[module] = (A, B, cfg["lora_alpha"] / cfg["r"])
    return out


def dense_reference(world: World, test_id: int, weights: dict[int, float]) -> dict[str, torch.Tensor]:
    """``{module: sum_pid w_pid * s_pid * B_pid @ A_pid}`` in float64 over the passages in ``weights``."""
    ref: dict[str, torch.Tensor] = {}
    for pid, w in weights.items():
        for module, (A, B, s) in read_adapter(world.adapter_path(test_id, pid)).items():
            ref[module] = ref.get(module, 0) + w * s * (B @ A)
    return ref


def read_capture(capture_dir: Path, test_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
    """``({module: captured dW = scaling * B @ A}, logits, {"layers_per_adapter": ...})`` of one question."""
    from safetensors.torch import load_file

    t = load_file(str(Path(capture_dir) / f"q{test_id}.safetensors"))
    info = json.loads((Path(capture_dir) / f"q{test_id}.json").read_text())
    dws = {}
    if "generated" in t:
        info["generated"] = t["generated"].tolist()
    for key in t:
        if key.endswith("::A"):
            module = key[:-3]
            dws[module] = float(t[module + "::scaling"]) * (t[module + "::B"].double() @ t[module + "::A"].double())
    return dws, t["logits"], info


def reference_logits(world: World, dw: dict[str, torch.Tensor], text: str) -> torch.Tensor:
    """Last-position logits of the base model with ``W + dW`` written into a fresh copy (independent path)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(DOUBLE_SCRIPT.parent))
    from prag_utils import token_ids

    model = AutoModelForCausalLM.from_pretrained(str(world.model_dir)).eval()
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, d in dw.items():
            mods[name].weight += d.to(mods[name].weight.dtype)
        ids = torch.tensor([token_ids(text, model.config.vocab_size)])
        return model(input_ids=ids).logits[0, -1].float()
