"""What a Python user meets with a trained controller: its own embedding model by default (whatever else is cached),
another model refused naming both, a missing side input said with a warning, and no verdict said as unproven."""

import warnings

import pytest

from fcprag_plugin import FusionController, fuse
from fcprag_plugin.controller import ControllerConfig
from fcprag_plugin.errors import ControllerError
from fcprag_plugin.hosts.base import WeightProvider
from helpers import hash_embed

Q = "who wrote the novel"
PS = ["the novel was written by a poet", "a river in france", "a band from ohio"]


def side_controller(*names, **overrides):
    return FusionController(ControllerConfig(embed_dim=16, score_hidden=[8], calib_hidden=8, init="random", seed=4,
                                             side_features=list(names), embedding_model="hash-16",
                                             **overrides)).eval()


def other_encoder(dim=16, name="other-16"):
    from fcprag_plugin.encoding import TextEncoder

    return TextEncoder.from_function(lambda texts: hash_embed(texts, dim), dim, name=name)


# ----------------------------------------------------------------------------- the embedding model
def test_an_encoder_of_another_model_is_an_error_naming_both(adapter_dirs, encoder16):
    ctrl = side_controller()
    fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16)  # the recorded model: fine
    for enc in (other_encoder(), other_encoder(8, "small-8")):  # same size and another size
        with pytest.raises(ControllerError, match=rf"'{enc.name}'.*'hash-16'|'hash-16'.*'{enc.name}'"):
            fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=enc)
        with pytest.raises(ControllerError, match=enc.name):
            WeightProvider(ctrl, enc).weights(Q, PS)


@pytest.fixture
def papers_name_cached(tmp_path_factory, monkeypatch):
    """A 768-d model in the hub cache under the paper's name, BAAI/bge-base-en-v1.5: what TextEncoder() picks."""
    from huggingface_hub import constants

    from fcprag_plugin import clear_caches
    from helpers import fake_cached_model

    cache = tmp_path_factory.mktemp("hub")
    fake_cached_model(cache, "BAAI/bge-base-en-v1.5", 768)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    clear_caches()
    yield cache
    clear_caches()


@pytest.mark.integration
def test_a_768d_model_under_the_papers_name_does_not_replace_a_controllers_encoder(papers_name_cached,
                                                                                   adapter_dirs):
    from fcprag_plugin.encoding import DEFAULT_MODEL, FALLBACK_NAME, TextEncoder

    default = TextEncoder()
    assert (default.name, default.dim) == (DEFAULT_MODEL, 768)  # the trap is set: the default is 768-d now
    ctrl = FusionController.fixed(g=0.5, tau=0.05, embed_dim=384, scorer="cosine", embedding_model=FALLBACK_NAME)
    ref = ctrl.predict(Q, PS, TextEncoder(FALLBACK_NAME)).merge_weights[0].tolist()
    assert fuse(adapter_dirs, Q, PS, controller=ctrl).merge_weights == pytest.approx(ref, abs=1e-6)
    assert list(WeightProvider(ctrl).weights(Q, PS).merge_weights) == pytest.approx(ref, abs=1e-6)
    assert max(ref) - min(ref) > 1e-3  # not uniform: the weights came from the embeddings
    with pytest.raises(ControllerError, match=rf"'{DEFAULT_MODEL}'.*384-d.*'{FALLBACK_NAME}'"):
        fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=default)


# ----------------------------------------------------------------------------- side inputs
def test_fuse_without_the_ranks_a_controller_uses_warns_once(adapter_dirs, encoder16):
    ctrl = side_controller("retrieval_rank")
    with pytest.warns(UserWarning, match=r"side feature 'retrieval_rank' but this call has none.*pass "
                                         r"retrieval_ranks="):
        missing = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16)
    equal = fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16, retrieval_ranks=[2.0, 2.0, 2.0])
    assert missing.merge_weights == equal.merge_weights  # what "taken as equal" means
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuse(adapter_dirs, Q, PS, controller=ctrl, encoder=encoder16)  # once per controller


def test_the_shims_say_a_missing_side_input_the_same_way(encoder16):
    ctrl = side_controller("retrieval_score")  # the hosts keep no retrieval scores
    with pytest.warns(UserWarning, match=r"side feature 'retrieval_score' but this call has none"):
        WeightProvider(ctrl, encoder16).weights(Q, PS)


# ----------------------------------------------------------------------------- no verdict, not a controller
def test_a_controller_trained_without_cross_validation_is_unproven(labelled, adapter_dirs):
    from fcprag_plugin.training import train_controller

    tmp, cache = labelled  # the cache holds every text under 'syn8': no model loads
    res = train_controller(tmp / "train.jsonl", tmp / "nocv", encoder="syn8", cache_dir=cache, epochs=1,
                           cv_folds=0, progress=False, threads=1, controller={"score_hidden": [8], "calib_hidden": 8})
    saved = FusionController.from_pretrained(tmp / "nocv")
    assert saved.config.cv["verdict"] == "unproven" and saved.config.cv["gain"] is None
    assert res.controller.config.cv == saved.config.cv
    with pytest.warns(UserWarning, match="never compared with PRAG's sum.*--cv-folds 0"):
        assert saved.warn_if_unproven()


def test_the_cli_says_a_missing_rank_once(adapter_dirs, encoder16, tmp_path, monkeypatch, caplog):
    from fcprag_tools import cli

    d = side_controller("retrieval_rank").save_pretrained(tmp_path / "run")
    monkeypatch.setattr(FusionController, "encoder", property(lambda self: encoder16))
    base = ["fuse", *sum((["--adapter", str(a)] for a in adapter_dirs), []), *sum((["--passage", p] for p in PS), []),
            "--query", Q]
    with warnings.catch_warnings(record=True) as seen, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        assert cli.main(base + ["--controller", str(d), "--out", str(tmp_path / "o")]) == 0
    said = [r.getMessage() for r in caplog.records if "side feature 'retrieval_rank'" in r.getMessage()]
    assert len(said) == 1 and "but this call has none" in said[0]  # the CLI's log line (stderr) ...
    assert "pass --retrieval-rank (one value per passage)" in said[0]  # naming the flag, not the keyword
    assert not [w for w in seen if "fcprag:" in str(w.message)]  # ... and not a second time as a warning
