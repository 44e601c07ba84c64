"""``fcprag labels build --scales``: the full set measured at several total merge scales (every ``w~_i = s``).

Checked against an independent dense computation (``s * sum_i s_i B_i A_i`` added to a copy's weights, read
straight from the adapter files), batched against sequential, and through resume and the part merge.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fcprag_plugin.errors import FcpragError, LabelFileError
from fcprag_plugin.training import load_labels
from fcprag_tools.cli import main
from fcprag_tools.label_builder.builder import BuildOptions, LabelBuilder, build_labels, format_scales
from fcprag_tools.label_builder.cli import scale_list
from fcprag_tools.label_builder.manifest import read_manifest
from fcprag_tools.lm.metrics import score_generation
from fcprag_tools.lm.prompts import PromptTemplate, answer_ids, render_prompt
from fcprag_tools.label_builder.parts import merge_parts
from fcprag_tools.train_report import train_table
from helpers import files_reference, make_adapter_dir, read_jsonl, save_tiny_lm

MAX_NEW = 4
SCALES = "0.5,1,2,4"
QUESTIONS = ["What is the capital of France?", "Who wrote the book?", "Which river is in Paris?",
             "When was the tower born?", "Where is the king?"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny LM, 3 adapters, 5 records with N = 3, 1, 2, 3, 2 and one or two gold aliases."""
    root = tmp_path_factory.mktemp("scales")
    model_dir = save_tiny_lm(root / "lm", seed=0)
    ads = [make_adapter_dir(root / f"p{i}", seed=20 + i) for i in range(3)]
    ns = [3, 1, 2, 3, 2]
    answers = [["paris", "paris city"], "the king", "seine", ["one year", "1"], "king"]
    recs = [{"id": f"s{i}", "question": q, "answer": answers[i], "passages": [f"passage {j}" for j in range(ns[i])],
             "adapters": [str(ads[(i + j) % 3]) for j in range(ns[i])]} for i, q in enumerate(QUESTIONS)]
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return {"model": model_dir, "manifest": manifest, "adapters": ads}


def _argv(world, out, *extra: str) -> list[str]:
    return ["labels", "build", str(world["manifest"]), "--model", str(world["model"]), "--out", str(out),
            "--max-new-tokens", str(MAX_NEW), "--empty-generation", "zero", "--no-progress", *extra]


def _build(world, out, *extra: str) -> int:
    return main(_argv(world, out, *extra))


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


def _assert_one_line(rc: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ----------------------------------------------------------------------------- the option
def test_scale_list_parses_comma_separated_positive_numbers():
    assert scale_list("0.5,1,1.5,2,3,4,6,8") == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
    assert scale_list("2") == [2.0] and scale_list(" 1e-1 , 3") == [0.1, 3.0]
    assert format_scales(scale_list("0.5,1,2,0.125")) == "0.5,1,2,0.125"


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1,1", "1,1.0", "1,", "", "0.5;2"])
def test_bad_scales_are_one_line_naming_the_option(world, tmp_path, capsys, value):
    out = tmp_path / "o.jsonl"
    rc, err = _run(_argv(world, out, "--scales", value), capsys)
    _assert_one_line(rc, err, "--scales")
    assert not out.exists()


def test_build_options_check_scales():
    for bad in ([0.0], [-2.0], [math.nan], [math.inf], [1.0, 1], ["2"], [True]):
        with pytest.raises(FcpragError, match="--scales"):
            BuildOptions(scales=bad).validate()
    o = BuildOptions(scales=[2, 0.5, 1])
    o.validate()
    assert o.scales == (2.0, 0.5, 1.0) and o.extra_scales == (2.0, 0.5)


# ----------------------------------------------------------------------------- against a dense reference
def _dense_reference(world, rec, scale: float) -> tuple[float, str]:
    """Best alias's mean answer log-prob (minus HF's masked cross-entropy) and the greedy text of a deep copy of
    the model whose target weights got ``scale * sum_i s_i B_i A_i`` (from the adapter files) added densely."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(world["model"]))
    model = AutoModelForCausalLM.from_pretrained(str(world["model"])).eval()
    with torch.no_grad():
        for name, delta in files_reference(rec.adapters, [scale] * rec.n).items():
            model.get_submodule(name).weight += delta.to(torch.float32)
    prompt = render_prompt(tok, PromptTemplate(), rec.question, None, "param")
    lps = []
    for ans in rec.answers:
        a = answer_ids(tok, prompt, ans)
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([prompt.ids + a]),
                         labels=torch.tensor([[-100] * len(prompt.ids) + a])).loss
        lps.append(-float(loss))
    with torch.no_grad():
        gen = model.generate(input_ids=torch.tensor([prompt.ids]), attention_mask=torch.ones(1, len(prompt.ids),
                             dtype=torch.long), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return max(lps), tok.decode(gen[0, len(prompt.ids):], skip_special_tokens=True)


@pytest.mark.parametrize("batch_size", ["1", "16"])
def test_metric_at_scales_equals_a_dense_reference(world, tmp_path, batch_size):
    out = tmp_path / "labels.jsonl"
    assert _build(world, out, "--scales", SCALES, "--batch-size", batch_size) == 0
    got = {r["id"]: r for r in read_jsonl(out)}
    records = read_manifest(world["manifest"])
    for rec in records[:2]:  # N = 3 and N = 1
        lab = got[rec.id]
        assert lab["scales"] == [0.5, 1.0, 2.0, 4.0]
        for s, m, g, f1 in zip(lab["scales"], lab["metric_at_scales"], lab["generation_at_scales"],
                               lab["f1_at_scales"]):
            ref_lp, ref_gen = _dense_reference(world, rec, s)
            assert m == pytest.approx(ref_lp, abs=1e-4), (rec.id, s)
            assert g == ref_gen, (rec.id, s)
            # answer-level scale labels: the F1 of the dense model's own greedy answer at that scale
            assert f1 == score_generation(ref_gen, rec.answers)[1], (rec.id, s)
        assert lab["metric_at_scales"][1] == lab["metric_all"]  # scale 1 is the full set's own measurement
        # the scale moves the label (otherwise a mix-up of scales would not show)
        assert max(lab["metric_at_scales"]) - min(lab["metric_at_scales"]) > 1e-3


# ----------------------------------------------------------------------------- batched vs sequential, fields
def _assert_same_labels(seq: list[dict], bat: list[dict]) -> None:
    """The tolerance of test_batched.py: log-probs within 1e-5, everything else identical."""
    assert [r["id"] for r in seq] == [r["id"] for r in bat]
    for x, y in zip(seq, bat):
        assert list(x) == list(y)
        for k in x:
            if k.startswith("answer_logprob") or k.startswith("metric_") and x["metric"] == "answer_logprob":
                assert y[k] == pytest.approx(x[k], abs=1e-5), (x["id"], k)
            else:
                assert y[k] == x[k], (x["id"], k)


@pytest.mark.parametrize("metric", ["answer_logprob", "f1"])
def test_batched_sequential_and_slot_agree(world, tmp_path, metric):
    runs = {"seq": ["--batch-size", "1"], "slot": ["--batch-size", "1", "--use-slot"], "b16": [],
            "b5": ["--batch-size", "5"]}
    outs = {}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.jsonl"
        assert _build(world, out, "--scales", "2,1,0.5", "--metric", metric, *extra) == 0
        outs[name] = read_jsonl(out)
    for name in ("slot", "b16", "b5"):
        _assert_same_labels(outs["seq"], outs[name])
    for r in outs["seq"]:
        assert r["scales"] == [2.0, 1.0, 0.5]
        for x in ("metric", "answer_logprob", "f1", "em", "prediction", "generation"):
            assert len(r[f"{x}_at_scales"]) == 3, x
            assert r[f"{x}_at_scales"][1] == r[f"{x}_all"], x  # scale 1 reused, exactly
        assert r["metric_at_scales"] == r[f"{metric}_at_scales"]


def test_without_scales_nothing_changes(world, tmp_path):
    """No --scales: no scale field, and every other byte as with --scales 1 (which adds no evaluation, so the
    batches are the same) once its scale fields are dropped."""
    plain, one = tmp_path / "plain.jsonl", tmp_path / "one.jsonl"
    assert _build(world, plain) == 0
    assert _build(world, one, "--scales", "1") == 0
    assert not any("scale" in k for r in read_jsonl(plain) for k in r)
    stripped = "".join(json.dumps({k: v for k, v in r.items() if not k.endswith("scales")}) + "\n"
                       for r in read_jsonl(one))
    assert plain.read_text(encoding="utf-8") == stripped
    assert all(r["scales"] == [1.0] and r["metric_at_scales"] == [r["metric_all"]] for r in read_jsonl(one))


def test_groups_count_the_scale_rows(world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(world["model"]))
    tok = AutoTokenizer.from_pretrained(str(world["model"]))
    records = read_manifest(world["manifest"])  # N + 1 = 4, 2, 3, 4, 3; + 2 extra scales = 6, 4, 5, 6, 5
    builder = LabelBuilder(model, tok, BuildOptions(generate=False, batch_size=10, scales=(0.5, 1.0, 3.0)))
    assert [[r.id for r in g] for g in builder.group(records)] == [["s0", "s1"], ["s2"], ["s3"], ["s4"]]
    assert builder.evaluations(2) == [([0, 1], 1.0), ([1], 1.0), ([0], 1.0), ([0, 1], 0.5), ([0, 1], 3.0)]


def test_trainer_reads_labels_with_scales(world, tmp_path):
    out = tmp_path / "labels.jsonl"
    assert _build(world, out, "--scales", SCALES, "--no-generation") == 0
    ls = load_labels(out)
    for rec, raw in zip(ls.records, read_jsonl(out)):
        assert rec.metric_at_scales == raw["metric_at_scales"] and rec.scales == raw["scales"]
        assert rec.scale_gains[1.0] == 0.0  # scale 1 is the full set itself: metric_all, measured once


# ----------------------------------------------------------------------------- resume and merge
def test_resume_with_the_same_scales_completes_the_file(world, tmp_path):
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    assert _build(world, full, "--scales", SCALES) == 0
    lines = full.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[2][:40], encoding="utf-8")  # a crash while writing the 3rd
    assert _build(world, out, "--scales", SCALES) == 0
    assert out.read_text(encoding="utf-8") == full.read_text(encoding="utf-8")


@pytest.mark.parametrize("first,then", [([SCALES], ["--scales", "0.5,2"]), ([SCALES], []), ([], ["--scales", "2"]),
                                        ([SCALES], ["--scales", "4,2,1,0.5"])])
def test_resume_with_other_scales_is_refused(world, tmp_path, capsys, first, then):
    out = tmp_path / "out.jsonl"
    assert _build(world, out, *(["--scales", *first] if first else [])) == 0
    lines = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:30], encoding="utf-8")  # with a partial last line, which must stay
    before = out.read_bytes()
    capsys.readouterr()
    rc, err = _run(_argv(world, out, *then), capsys)
    _assert_one_line(rc, err, "--scales", f"{out}:1", "does not mix scale grids")
    assert out.read_bytes() == before


def test_other_scales_are_refused_before_the_model_loads(world, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert _build(world, out, "--scales", "2", "--no-generation") == 0
    capsys.readouterr()
    argv = _argv(world, out, "--scales", "3")
    argv[argv.index("--model") + 1] = "no-such-org/no-such-model"  # a hub name: loading it would fail offline
    rc, err = _run(argv, capsys)
    _assert_one_line(rc, err, "--scales 3:", "was built with --scales 2")


def test_merge_keeps_scale_fields_and_refuses_mixed_grids(world, tmp_path):
    records = read_manifest(world["manifest"])
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(world["model"]))
    tok = AutoTokenizer.from_pretrained(str(world["model"]))
    opts = dict(generate=False, batch_size=1)
    build_labels(records[:3], LabelBuilder(model, tok, BuildOptions(scales=(0.5, 2.0), **opts)), a, progress=False)
    build_labels(records[3:], LabelBuilder(model, tok, BuildOptions(scales=(0.5, 2.0), **opts)), b, progress=False)
    out = tmp_path / "merged.jsonl"
    assert merge_parts([b, a], records, out).written == 5
    assert out.read_text() == a.read_text() + b.read_text()  # verbatim, manifest order

    c = tmp_path / "c.jsonl"
    build_labels(records[3:], LabelBuilder(model, tok, BuildOptions(scales=(2.0,), **opts)), c, progress=False)
    with pytest.raises(LabelFileError, match=r"c\.jsonl:1: field 'scales': \[2\.0\] but .*a\.jsonl:1 has "
                                             r"\[0\.5, 2\.0\]; a label file does not mix scale grids"):
        merge_parts([a, c], records, out)
    d = tmp_path / "d.jsonl"
    build_labels(records[3:], LabelBuilder(model, tok, BuildOptions(**opts)), d, progress=False)
    with pytest.raises(LabelFileError, match=r"d\.jsonl:1: field 'scales': \[\] but"):
        merge_parts([a, d], records, out)
    bad = tmp_path / "bad.jsonl"
    recs = read_jsonl(b)
    recs[0]["metric_at_scales"] = recs[0]["metric_at_scales"][:1]
    bad.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(LabelFileError, match=r"bad\.jsonl:1: field 'metric_at_scales': expected a list of 2"):
        merge_parts([a, bad], records, out)
    # files built without --scales still merge (the grid is "none" everywhere)
    e = tmp_path / "e.jsonl"
    build_labels(records[:3], LabelBuilder(model, tok, BuildOptions(**opts)), e, progress=False)
    assert merge_parts([e, d], records, out).written == 5


def test_python_api_refuses_another_grid(world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(world["model"]))
    tok = AutoTokenizer.from_pretrained(str(world["model"]))
    records = read_manifest(world["manifest"])[:2]
    out = tmp_path / "o.jsonl"
    build_labels(records[:1], LabelBuilder(model, tok, BuildOptions(generate=False, scales=(2.0,))), out,
                 progress=False)
    with pytest.raises(FcpragError, match=r"--scales 3: .*o\.jsonl:1 was built with --scales 2;"):
        build_labels(records, LabelBuilder(model, tok, BuildOptions(generate=False, scales=(3.0,))), out,
                     progress=False)
    assert [r["id"] for r in read_jsonl(out)] == ["s0"]


def test_empty_generations_at_scales_are_counted_or_name_the_scale(tmp_path):
    """An empty greedy answer at a scale follows --empty-generation like the subsets: counted under "zero", and
    the error names the scale."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fcprag_tools.label_builder.builder import describe_subset

    model_dir = save_tiny_lm(tmp_path / "lm0", seed=0, zero_lm_head=True)  # greedy always emits [PAD]
    ad = make_adapter_dir(tmp_path / "a0", seed=0)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "e1", "question": "Who?", "answer": "king", "passages": ["x"],
                                    "adapters": [str(ad)]}) + "\n")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    (rec,) = read_manifest(manifest)
    for bs in (1, 8):
        lab = LabelBuilder(model, tok, BuildOptions(max_new_tokens=2, scales=(3.0, 1.0, 0.5), batch_size=bs,
                                                    empty_generation="zero")).label(rec)
        # all, the one left out (base model), then scales 3 and 0.5 (scale 1 is "all", not counted twice)
        assert lab["empty_generations"] == 4 and lab["f1_at_scales"] == [0.0, 0.0, 0.0]
    assert describe_subset([0, 1], 2, 3.0) == "all 2 adapters at scale 3"
    assert describe_subset([0, 1], 2, 1.0) == "all 2 adapters"


def test_f1_scale_labels_end_to_end_show_the_scale_part_in_f1(world, tmp_path):
    """Build F1 scale labels on the tiny model, read them, and train (kappa chosen on the label metric): the grid's
    mean gains are those of the file, written out here, and the verdict shows the scale part in F1 too."""
    from fcprag_plugin.training import load_labels, train_controller
    from fcprag_tools.synthetic import table_encoder

    out = tmp_path / "labels.jsonl"
    assert _build(world, out, "--scales", SCALES) == 0
    raw = read_jsonl(out)
    ls = load_labels(out)
    for rec, r in zip(ls.records, raw):
        assert rec.f1_at_scales == r["f1_at_scales"] and rec.f1_all == r["f1_all"]
        assert rec.f1_scale_gains == {s: f - r["f1_all"] for s, f in zip(r["scales"], r["f1_at_scales"])}
    gen = torch.Generator().manual_seed(0)
    table = {t: torch.randn(8, generator=gen) for r in raw for t in [r["query"], *r["passages"]]}
    res = train_controller(out, tmp_path / "ctrl", encoder=table_encoder(table, "tiny8"), cache_dir="",
                           cv_folds=2, epochs=1, progress=False, threads=1,
                           controller={"score_hidden": [8], "calib_hidden": 8}, scale_max_loss_share=1.0)
    cv = res.metrics["cv"]
    grid = cv["scale"]["grid"]
    assert cv["scale"]["metric"] == "label" and grid["grid"] == [0.5, 1.0, 2.0, 4.0]
    for j, s in enumerate(grid["grid"]):  # one record per question: the question mean is the record's gain
        want = sum(r["metric_at_scales"][r["scales"].index(s)] - r["metric_all"] for r in raw) / len(raw)
        assert grid["mean_gain"][j] == pytest.approx(want, abs=1e-12), s
    assert set(cv["scale"]["by_metric"]) == {"label", "f1"}
    assert "the same scale in F1" in train_table(res.metrics)
