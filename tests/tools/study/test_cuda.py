"""``fcprag study`` end to end on CUDA in bf16 (only where torch sees a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from fcprag_tools.cli import main
from fcprag_tools.study import check_summary
from helpers import save_tiny_sentence_encoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_study_runs_end_to_end_on_cuda_in_bf16(tiny_study):
    from fcprag_plugin import LoraAdapter

    out = tiny_study["root"] / "cuda"
    encoder = save_tiny_sentence_encoder(tiny_study["root"] / "encoder")  # the GPU machine has no offline MiniLM
    retrieval = tiny_study["root"] / "retrieval.jsonl"  # passages in file order: the GPU check needs no bm25s
    qs = [json.loads(x) for x in open(tiny_study["questions"], encoding="utf-8").read().splitlines()]
    retrieval.write_text("".join(json.dumps({"id": q["id"], "passages": q["passages"]}) + "\n" for q in qs))
    assert main(["study", tiny_study["questions"], "--model", tiny_study["model"], "--out", str(out), "--top-k", "2",
                 "--retrieval", str(retrieval),
                 "--scales", "2,4", "--max-new-tokens", "3", "--test-fraction", "0.5", "--epochs", "2",
                 "--no-progress", "--device", "cuda", "--dtype", "bfloat16", "--encoder", str(encoder)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert check_summary(s) == [] and s["settings"]["device"].startswith("cuda")
    assert s["settings"]["dtype"] == "bfloat16"
    pid = json.loads((out / "adapters.jsonl").read_text().splitlines()[0])["id"]
    assert LoraAdapter.from_pretrained(out / "adapters" / pid).dtype == torch.float32  # float32 factors, saved so
    # DyPRAG's stage on the GPU: a translator trained there, its rows scored through the bf16 model
    assert json.loads((out / "translator" / "translator.json").read_text())["source"] == "trained"
    assert {"dyprag", "dyprag_combine", "dyprag_recommended"} <= set(s["methods"])
    generated = [json.loads(x) for x in (out / "dyprag_generated.jsonl").read_text().splitlines()]
    assert generated and all(g["device"].startswith("cuda") for g in generated)
