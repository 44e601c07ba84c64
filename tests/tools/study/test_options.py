"""``fcprag study``'s options as small frozen parts: every flag made from its field (name, default), the flags'
names routed to the parts that hold them, the checks before any work returning a new resolved value, and what the
trainer is given (``train/done.json``'s ``args``) as before the parts."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest

import fcprag_tools
import fcprag_tools.study
from fcprag_plugin.training import TrainArgs
from fcprag_tools.cli import build_parser
from fcprag_tools.label_builder.builder import BuildOptions
from fcprag_tools.options import FLAG, ModelPart, Runtime
from fcprag_tools.study import StudyOptions, preflight
from fcprag_tools.study.cli import options_of
from fcprag_tools.study.options import PARTS, TRAINING_FLAGS, Generation, Plan
from fcprag_tools.study.stages.controllers import for_labels, trainer_kwargs
from helpers import cli_leaves, hash_encoder, options


def _actions(*words: str) -> dict[str, object]:
    """``{dest: argparse action}`` of ``fcprag WORDS``."""
    return {a.dest: a for a in options(dict(cli_leaves())[words])}


def test_every_flag_of_the_study_is_its_fields_with_the_fields_default():
    actions = _actions("study")
    for part in [*PARTS.values(), StudyOptions]:
        for f in dataclasses.fields(part):
            if FLAG in f.metadata:
                default = f.default if f.default is not dataclasses.MISSING else None
                assert f.name in actions and actions[f.name].default == default, (part.__name__, f.name)
    for name in TRAINING_FLAGS:  # the trainer's, with the trainer's defaults
        assert actions[name].default == getattr(TrainArgs(), name)
    flags = {s for a in actions.values() for s in a.option_strings}
    assert {"--no-generate", "--no-arrow", "--no-progress", "--max-new-tokens", "--top-k", "--scales", "--seed",
            "--test-fraction", "--train-ids", "--cv-folds", "--epochs", "--threads", "--encoder", "--gguf-file"} <= flags


def test_a_bare_command_line_gives_the_fields_defaults(tmp_path):
    args = build_parser().parse_args(["study", "q.jsonl", "--out", str(tmp_path)])
    assert options_of(args) == StudyOptions.of(questions="q.jsonl", out=str(tmp_path))
    assert options_of(args) == StudyOptions(out=str(tmp_path), plan=Plan(questions=("q.jsonl",)))
    given = build_parser().parse_args(["study", "q.jsonl", "--out", "o", "--max-new-tokens", "5", "--no-arrow",
                                       "--seed", "7", "--epochs", "3", "--threads", "2", "--scales", "2,4"])
    o = options_of(given)
    assert (o.generation.max_new_tokens, o.plan.arrow, o.split.seed, o.train.seed, o.train.epochs) == (5, False, 7, 7, 3)
    assert (o.runtime.threads, o.plan.scales) == (2, (2.0, 4.0))


def test_of_routes_each_name_to_the_part_that_holds_it():
    o = StudyOptions.of(questions=["a", "b"], out="o", top_k=2, max_new_tokens=3, batch_size=4, device="cpu",
                        limit=9, seed=5, epochs=2, cv_folds=0, progress=False)
    assert (o.plan.questions, o.plan.top_k, o.generation.max_new_tokens, o.batching.batch_size) == (("a", "b"), 2, 3, 4)
    assert (o.model.device, o.split.limit, o.split.seed, o.runtime.progress) == ("cpu", 9, 5, False)
    assert (o.train.epochs, o.train.cv_folds, o.train.seed) == (2, 0, 5)
    assert o.train.batch_size == TrainArgs().batch_size  # --batch-size is the scoring's, never the trainer's
    assert (o.train.kappa, o.train.objective, o.train.keep_network) == ("auto", "risk", True)
    with pytest.raises(TypeError, match="max_new_token"):
        StudyOptions.of(questions="a", out="o", max_new_token=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.generation.max_new_tokens = 8  # type: ignore[misc]


def test_no_dataclass_of_the_study_has_more_than_12_fields():
    seen = {}
    for info in pkgutil.walk_packages(fcprag_tools.study.__path__, "fcprag_tools.study."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj.__module__ == info.name:
                seen[obj.__qualname__] = len(dataclasses.fields(obj))
    assert "StudyOptions" in seen and "Plan" in seen and len(seen) >= 8
    assert max(seen.values()) <= 12, seen


def test_the_checks_return_new_resolved_options_and_change_none(tiny_study):
    o = StudyOptions.of(questions=tiny_study["questions"], model=tiny_study["model"],
                        out=str(tiny_study["root"] / "s"), encoder=hash_encoder(), device="cpu")
    checked = preflight.check(o)
    assert o.model.name is None  # the user's value is as it was
    assert checked.options.model == ModelPart(tiny_study["model"], device="cpu", name=tiny_study["model"])
    assert dataclasses.replace(checked.options, model=o.model) == o  # only the model part was resolved


def test_the_trainer_is_given_what_done_json_recorded_before_the_parts():
    """``train/done.json``'s ``args`` (written since the first study): the study's five, then the user's others."""
    args = for_labels(StudyOptions.of(questions="a", out="o", epochs=2, seed=3).train, 6)
    assert trainer_kwargs(args) == {"kappa": "auto", "objective": "risk", "keep_network": True, "seed": 3,
                                    "cv_folds": 5, "epochs": 2}
    assert list(trainer_kwargs(args)) == ["kappa", "objective", "keep_network", "seed", "cv_folds", "epochs"]
    assert trainer_kwargs(for_labels(StudyOptions.of(questions="a", out="o").train, 3)) == {
        "kappa": "auto", "objective": "risk", "keep_network": True, "seed": 0, "cv_folds": 0}  # < 4: no CV


def test_max_new_tokens_defaults_are_each_written_once():
    assert _actions("study")["max_new_tokens"].default == Generation().max_new_tokens
    assert _actions("labels", "build")["max_new_tokens"].default == BuildOptions().max_new_tokens
    assert "longer than fcprag study's" in _actions("labels", "build")["max_new_tokens"].help


def test_threads_are_set_in_one_place_of_the_tooling():
    src = Path(fcprag_tools.__file__).parent
    setters = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if "set_num_threads(" in p.read_text())
    assert setters == ["lm/model_io.py"]
    for words in (("study",), ("labels", "build"), ("train",)):
        assert _actions(*words)["threads"].help == dataclasses.fields(Runtime)[1].metadata[FLAG]["help"], words
