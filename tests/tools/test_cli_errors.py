"""Every user error on the command line: one line on stderr naming the culprit, exit code 2, no traceback, and
nothing the user had is overwritten. The first tests walk the whole argparse tree, so a new sub-command or
option is covered (and must have help text) without editing this file."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fcprag_plugin import FusionController
from fcprag_tools.cli import main
from fcprag_tools.train_cli import check_line_lengths
from fcprag_tools.synthetic import synthetic_records, write_labels
from helpers import SMALL_TRAIN_ARGS as SMALL, cli_leaves, make_adapter_dir, options

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ----------------------------------------------------------------------------- the argparse tree
LEAVES = cli_leaves()
COMMANDS = [" ".join(p) for p, _ in LEAVES]


def test_tree_is_complete():
    assert {"fuse", "inspect", "train", "eval", "run", "labels build", "labels from-prag", "labels merge"} <= set(
        COMMANDS)


@pytest.mark.parametrize("words,parser", LEAVES, ids=COMMANDS)
def test_every_option_has_help(words, parser):
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in options(parser) if not a.help]
    assert not missing, f"fcprag {' '.join(words)}: options without help text: {missing}"


def test_descriptions_and_usage():
    p = dict(zip(COMMANDS, [q for _, q in LEAVES]))
    for cmd in ("fuse", "inspect", "train", "eval", "run", "labels build", "labels from-prag", "labels merge"):
        assert p[cmd].description, cmd
    assert "-- SCRIPT" in p["run"].format_usage()
    assert "largest input rank" in " ".join(p["fuse"].format_help().split())  # svd's default rank is stated


# ----------------------------------------------------------------------------- a world of valid inputs
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_errors")
    ads = [make_adapter_dir(root / f"passage_{i}", seed=i) for i in range(2)]
    ctrl = FusionController.fixed(g=0.5, tau=0.1, embed_dim=384).save_pretrained(root / "ctrl")
    recs, _ = synthetic_records(20, 2, 8, seed=1)
    labels = write_labels(recs, root / "labels.jsonl")
    manifest = root / "manifest.jsonl"
    manifest.write_text(json.dumps({"id": "q0", "question": "q?", "answer": "a", "passages": ["p0", "p1"],
                                    "adapters": [str(a) for a in ads]}) + "\n", encoding="utf-8")
    script = root / "host.py"
    script.write_text("print('host ran')\n", encoding="utf-8")
    return {"root": root, "ads": ads, "ctrl": ctrl, "labels": labels, "manifest": manifest, "script": script}


def valid_args(cmd: str, w: dict, out: Path) -> list[str]:
    """A command line that gets past parsing (the bad value under test is appended or substituted)."""
    a0, a1 = (str(a) for a in w["ads"])
    return {
        "fuse": ["fuse", "--adapter", a0, "--passage", "p0", "--adapter", a1, "--passage", "p1", "--query", "q",
                 "--out", str(out)],
        "inspect": ["inspect", a0],
        "train": ["train", str(w["labels"]), "--out", str(out), "--encoder", str(out / "no-encoder"),
                  "--no-progress"],
        "eval": ["eval", str(w["ctrl"]), str(w["labels"]), "--no-progress"],
        "run": ["run", "prag", "--", str(w["script"])],
        "labels build": ["labels", "build", str(w["manifest"]), "--out", str(out / "l.jsonl"), "--model",
                         str(out / "no-model"), "--no-progress"],
        "labels from-prag": ["labels", "from-prag", "--data-aug", str(out / "no-data.json"), "--adapters-root",
                             str(w["root"]), "--out", str(out / "m.jsonl")],
        "labels merge": ["labels", "merge", str(out / "no.part0-of-2.jsonl"), "--manifest", str(w["manifest"]),
                         "--out", str(out / "merged.jsonl")],
        "study": ["study", str(out / "no-questions.jsonl"), "--model", str(out / "no-model"), "--out",
                  str(out / "study"), "--no-progress"],
        "report": ["report", str(out / "no-study")],
    }[cmd]


def bad_values(action: argparse.Action) -> list[str]:
    """Values of the wrong type / outside the allowed set for one option."""
    if action.nargs == 0:
        return []
    if action.choices:
        return ["bogus-choice"]
    name = getattr(action.type, "__name__", "")
    minimum = getattr(action.type, "minimum", None)  # options.int_at_least(minimum, maximum)
    maximum = getattr(action.type, "maximum", None)
    if name == "int" or minimum is not None:
        return ["abc", "1.5"] + ([str(minimum - 1), "-3"] if minimum is not None else []) + (
            [str(maximum + 1), "1000000000"] if maximum is not None else [])
    if name in ("float", "finite_float"):
        return ["abc", "nan", "inf"]
    if name == "kappa_value":
        return ["big", "0", "-1", "nan"]
    if name == "hidden_sizes":
        return ["0", "abc", "64,", "64,100000000"]
    return []


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    except BaseException as e:  # noqa: BLE001 - any escaping exception is a traceback for the user
        pytest.fail(f"fcprag {' '.join(argv)}: raised {type(e).__name__}: {e}")
    return rc, capsys.readouterr().err


def assert_one_line(rc: int, err: str, argv: list[str], culprit: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, f"{argv}: exit {rc}, stderr {err!r}"
    assert len(lines) == 1, f"{argv}: expected one line on stderr, got {lines}"
    assert "Traceback" not in err
    assert culprit in lines[0], f"{argv}: the message does not name {culprit!r}: {lines[0]}"


CASES = [(cmd, a.option_strings[0] if a.option_strings else a.dest, v)
         for (words, p), cmd in zip(LEAVES, COMMANDS) for a in options(p) for v in bad_values(a)]


@pytest.mark.parametrize("cmd,option,value", CASES, ids=[f"{c}:{o}={v}" for c, o, v in CASES])
def test_bad_option_values(cmd, option, value, world, tmp_path, capsys):
    argv = valid_args(cmd, world, tmp_path / "out")
    if option.startswith("-"):
        argv = argv[:len(cmd.split())] + [option, value] + argv[len(cmd.split()):]
        culprit = option
    else:  # a positional with choices (run's host)
        argv = [value if x == "prag" else x for x in argv]
        culprit = value
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, culprit)
    assert not (tmp_path / "out").exists(), "a refused command left an output behind"


@pytest.mark.parametrize("cmd", COMMANDS)
def test_missing_required_and_unknown(cmd, world, tmp_path, capsys):
    rc, err = run_main([*cmd.split(), "--no-such-option"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("cmd", ["fuse", "inspect", "train", "eval", "labels build", "labels from-prag",
                                 "labels merge"])
def test_missing_input_paths(cmd, world, tmp_path, capsys):
    """The valid_args of these commands each name one input that does not exist: the message names it."""
    argv = valid_args(cmd, world, tmp_path / "out")
    missing = {"fuse": str(tmp_path / "gone"), "inspect": str(tmp_path / "gone"),
               "train": str(tmp_path / "gone.jsonl"), "eval": str(tmp_path / "gone.jsonl")}.get(cmd)
    if cmd == "fuse":
        argv[2] = missing
    elif cmd == "inspect":
        argv[1] = missing
    elif cmd in ("train", "eval"):
        argv[1 if cmd == "train" else 2] = missing
    else:
        missing = {"labels build": str(tmp_path / "out" / "no-model"),
                   "labels from-prag": str(tmp_path / "out" / "no-data.json"),
                   "labels merge": str(tmp_path / "out" / "no.part0-of-2.jsonl")}[cmd]
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, Path(missing).name)


def test_run_without_script_or_missing_script(world, tmp_path, capsys):
    rc, err = run_main(["run", "prag", "--"], capsys)
    assert_one_line(rc, err, ["run"], "after '--'")
    rc, err = run_main(["run", "dyprag", "--", str(tmp_path / "nope.py")], capsys)
    assert_one_line(rc, err, ["run"], "nope.py")


# ----------------------------------------------------------------------------- fuse --out
def _fuse_argv(world, out, *extra):
    a0, a1 = (str(a) for a in world["ads"])
    return ["fuse", "--adapter", a0, "--passage", "p0", "--adapter", a1, "--passage", "p1", "--query", "q",
            "--out", str(out), *extra]


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("overwrite", [False, True])
def test_fuse_out_into_an_input_adapter_is_refused(world, capsys, overwrite):
    target = world["ads"][1]
    before = _tree_digest(target)
    rc, err = run_main(_fuse_argv(world, target, *(["--overwrite"] if overwrite else [])), capsys)
    assert_one_line(rc, err, ["fuse"], f"--adapter input {target}")
    assert _tree_digest(target) == before, "the input adapter's bytes changed"
    # a directory that contains an input is refused too (--overwrite would delete it)
    rc, err = run_main(_fuse_argv(world, world["root"], "--overwrite"), capsys)
    assert_one_line(rc, err, ["fuse"], "contains the --adapter input")
    assert _tree_digest(target) == before


def test_fuse_out_into_the_controller_is_refused(world, capsys):
    before = _tree_digest(world["ctrl"])
    for extra in ([], ["--overwrite"]):
        rc, err = run_main(_fuse_argv(world, world["ctrl"], "--controller", str(world["ctrl"]), *extra), capsys)
        assert_one_line(rc, err, ["fuse"], "--controller input")
    assert _tree_digest(world["ctrl"]) == before


def test_fuse_out_existing_file_and_nonempty_dir(world, tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("mine")
    for extra in ([], ["--overwrite"]):
        rc, err = run_main(_fuse_argv(world, f, *extra), capsys)
        assert_one_line(rc, err, ["fuse"], f"--out {f} is an existing file")
    assert f.read_text() == "mine"
    d = tmp_path / "full"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    rc, err = run_main(_fuse_argv(world, d), capsys)
    assert_one_line(rc, err, ["fuse"], "existing non-empty directory")
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    # with --overwrite the directory is replaced by the fused adapter (and nothing is left next to it)
    assert main(_fuse_argv(world, d, "--overwrite")) == 0
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "fusion.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "full"]
    # an empty directory is fine without --overwrite
    (tmp_path / "empty").mkdir()
    assert main(_fuse_argv(world, tmp_path / "empty")) == 0


def test_fuse_interrupted_write_leaves_nothing(world, tmp_path, monkeypatch):
    from fcprag_tools import cli

    def boom(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "write_json", lambda path, obj: boom(path))
    out = tmp_path / "o"
    assert main(_fuse_argv(world, out)) == 130
    assert list(tmp_path.iterdir()) == [], "a half-written output (or temp dir) was left behind"


def test_fuse_passage_file_errors(world, tmp_path, capsys):
    argv = _fuse_argv(world, tmp_path / "o")
    i = argv.index("p1")
    argv[i] = f"@{tmp_path / 'absent.txt'}"
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, "absent.txt")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    argv[i] = f"@{bad}"
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, "latin1.txt is not valid UTF-8")
    assert not (tmp_path / "o").exists()


def test_fuse_svd_rank(world, tmp_path, capsys):
    rc, err = run_main(_fuse_argv(world, tmp_path / "a", "--rank", "2"), capsys)
    assert_one_line(rc, err, ["fuse"], "--rank 2 is only used by --mode svd")
    rc, err = run_main(_fuse_argv(world, tmp_path / "b", "--mode", "svd", "--rank", "100000"), capsys)
    assert_one_line(rc, err, ["fuse"], "--rank 100000 exceeds the rank of the exact merge (4")
    assert main(_fuse_argv(world, tmp_path / "c", "--mode", "svd", "--rank", "3")) == 0
    info = json.loads((tmp_path / "c" / "fusion.json").read_text())
    cfg = json.loads((tmp_path / "c" / "adapter_config.json").read_text())
    assert info["rank"] == cfg["r"] == 3
    assert main(_fuse_argv(world, tmp_path / "d", "--mode", "svd")) == 0  # default: the largest input rank (2)
    assert json.loads((tmp_path / "d" / "fusion.json").read_text())["rank"] == 2


def test_fuse_json_is_strict(world, tmp_path):
    """Uniform has no temperature (NaN inside): fusion.json must still be standard JSON (null)."""
    assert main(_fuse_argv(world, tmp_path / "u")) == 0
    text = (tmp_path / "u" / "fusion.json").read_text()
    info = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert info["tau"] is None and info["controller_mode"] == "uniform"


# ----------------------------------------------------------------------------- processes: pipes, Ctrl-C
def test_inspect_into_a_closed_pipe(world):
    """`fcprag inspect --per-module ... | head -1`: no BrokenPipeError traceback."""
    code = f"import sys; sys.path.insert(0, {SRC!r}); from fcprag_tools.cli import main; sys.exit(main())"
    proc = subprocess.run(f"{sys.executable} -c \"{code}\" inspect --per-module {' '.join(map(str, world['ads'] * 20))}"
                          " | head -1", shell=True, capture_output=True, text=True, executable="/bin/bash")
    assert proc.stdout.count("\n") == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- train
def test_train_refuses_deltas_outside_float32(world, tmp_path, capsys):
    """[1e308, -1e308, 0] is finite in float64 but overflows float32: refused before any work, naming the field."""
    rec = json.loads(Path(world["labels"]).read_text().splitlines()[0])
    rec["deltas"] = [1e308, -1e308] + [0.0] * (len(rec["deltas"]) - 2)
    bad = tmp_path / "huge.jsonl"
    bad.write_text(json.dumps(rec) + "\n")
    argv = ["train", str(bad), "--out", str(tmp_path / "run"), "--no-progress"]
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, f"{bad}:1: field 'deltas[0]'")
    assert not (tmp_path / "run").exists()


def test_label_line_length_bound(tmp_path):
    """A huge line is refused by its length, read in blocks (the line spans several 1 MiB blocks here)."""
    f = tmp_path / "big.jsonl"
    f.write_bytes(b'{"id": "a"}\n' + b"x" * (3 * 2**20) + b"\n")
    check_line_lengths(str(f), limit=4 * 2**20)  # under the bound: fine
    with pytest.raises(Exception, match=rf"{f.name}:2: line is longer than 2 MiB"):
        check_line_lengths(str(f), limit=2 * 2**20)


def test_train_skip_list_printed_once(labelled, capsys):
    tmp, cache = labelled
    bad = tmp / "bad.jsonl"
    bad.write_text((tmp / "train.jsonl").read_text().replace('"deltas": [', '"deltas": [7, ', 1))
    out = tmp / "run"
    base = ["train", str(bad), "--out", str(out), "--encoder", "syn8", "--cache-dir", str(cache), "--on-error",
            "skip", "--recipe", "paper", *SMALL]
    assert main(base + ["--epochs", "1"]) == 0
    cap = capsys.readouterr()
    assert (cap.out + cap.err).count(f"{bad}:1: field 'deltas'") == 1


def test_train_ctrl_c_before_training_says_run_it_again(labelled, capsys, monkeypatch):
    """Interrupted before the trainer wrote anything: nothing kept, the same command (tests/tools/
    test_train_interrupt.py interrupts real runs)."""
    from fcprag_plugin.training import trainer

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train_controller", interrupted)
    tmp, cache = labelled
    rc = main(["train", str(tmp / "train.jsonl"), "--out", str(tmp / "run"), "--encoder", "syn8", *SMALL])
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err and "--resume" not in err
    assert ("interrupted (training restarts from the start); nothing was kept: run the same command again: "
            "fcprag train ") in err
    assert not (tmp / "run").exists()


# ----------------------------------------------------------------------------- outputs that are inputs
def _file_digest(path: Path) -> str:
    return _tree_digest(path) if Path(path).is_dir() else hashlib.sha256(Path(path).read_bytes()).hexdigest()


OUT_IS_INPUT = {
    # command line (w: the world) -> (the input that must stay byte-identical, the words the message must hold)
    "eval --json LABELS": (lambda w: ["eval", str(w["ctrl"]), str(w["labels"]), "--json", str(w["labels"])],
                           "labels", "--json {p} is the labels input"),
    "eval --json CTRL/x.json": (lambda w: ["eval", str(w["ctrl"]), str(w["labels"]), "--json",
                                           str(w["ctrl"] / "config.json")], "ctrl", "is inside the controller input"),
    "eval --plots LABELS": (lambda w: ["eval", str(w["ctrl"]), str(w["labels"]), "--plots", str(w["labels"])],
                            "labels", "--plots {p} is the labels input"),
    "train --out LABELS": (lambda w: ["train", str(w["labels"]), "--out", str(w["labels"]), "--overwrite"],
                           "labels", "--out {p} is the labels input"),
    "train --out CTRL": (lambda w: ["train", str(w["labels"]), "--out", str(w["ctrl"])], "ctrl",
                         "non-empty directory and it holds no training run"),
    "labels build --out MANIFEST": (lambda w: ["labels", "build", str(w["manifest"]), "--out", str(w["manifest"]),
                                               "--model", "m"], "manifest", "--out {p} is the manifest input"),
    "labels merge --out MANIFEST": (lambda w: ["labels", "merge", str(w["labels"]), "--manifest", str(w["manifest"]),
                                               "--out", str(w["manifest"])], "manifest", "is the --manifest input"),
    "labels merge --out PART": (lambda w: ["labels", "merge", str(w["labels"]), "--manifest", str(w["manifest"]),
                                           "--out", str(w["labels"])], "labels", "--out {p} is the part input"),
    "labels from-prag --out DATA": (lambda w: ["labels", "from-prag", "--data-aug", str(w["manifest"]),
                                               "--adapters-root", str(w["root"]), "--out", str(w["manifest"])],
                                    "manifest", "is the --data-aug input"),
}


@pytest.mark.parametrize("case", list(OUT_IS_INPUT))
def test_an_output_never_overwrites_an_input(case, world, capsys):
    make_argv, key, words = OUT_IS_INPUT[case]
    before = _file_digest(world[key])
    argv = make_argv(world)
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, words.format(p=world[key]))
    assert _file_digest(world[key]) == before, "the input's bytes changed"


def test_eval_json_into_a_directory_leaves_no_temp_file(world, tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    argv = ["eval", str(world["ctrl"]), str(world["labels"]), "--json", str(d), "--no-progress"]
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, f"--json {d} is an existing directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and list(d.iterdir()) == []


def test_train_out_existing_file(world, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    argv = ["train", str(world["labels"]), "--out", str(f), "--overwrite"]
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, f"--out {f} is an existing file")
    assert f.read_text() == "mine"


def test_a_multi_line_library_message_is_one_line(world, capsys, monkeypatch):
    from fcprag_plugin import adapter
    from fcprag_plugin.errors import FcpragError

    def two_lines(*a, **k):
        raise FcpragError("cannot load it:\nCheck your connection.")

    monkeypatch.setattr(adapter.LoraAdapter, "from_pretrained", two_lines)
    rc, err = run_main(["inspect", str(world["ads"][0])], capsys)
    assert_one_line(rc, err, ["inspect"], "cannot load it: Check your connection.")


def test_labels_build_ctrl_c_says_the_command_resumes(world, tmp_path, capsys, monkeypatch):
    from fcprag_tools.label_builder import builder
    from helpers import save_tiny_lm

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "build_labels", interrupted)
    out = tmp_path / "labels.jsonl"
    rc = main(["labels", "build", str(world["manifest"]), "--model", str(save_tiny_lm(tmp_path / "lm", seed=0)),
               "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err
    assert f"interrupted; {out} keeps every record written so far; the same command resumes" in err


def test_eval_plots_without_matplotlib_fails_before_evaluating(world, tmp_path, capsys, monkeypatch):
    from fcprag_tools import evaluate

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(evaluate, "evaluate_controller", lambda *a, **k: pytest.fail("evaluated before the check"))
    argv = ["eval", str(world["ctrl"]), str(world["labels"]), "--plots", str(tmp_path / "p"), "--no-progress"]
    rc, err = run_main(argv, capsys)
    assert_one_line(rc, err, argv, "plots need matplotlib")


def test_fuse_warns_about_a_repeated_adapter(world, tmp_path, caplog):
    a0 = world["ads"][0]
    argv = ["fuse", "--adapter", str(a0), "--passage", "p0", "--adapter", f"{a0}/", "--passage", "p1", "--query",
            "q", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "more than once" in r.getMessage()]
    assert warned == [f"the same adapter directory is given more than once ({os.path.realpath(a0)} as --adapter {a0}, "
                      f"--adapter {a0}/): each copy counts as its own passage update, so its update is added once "
                      "per copy"]
    caplog.clear()
    assert main(_fuse_argv(world, tmp_path / "o2")) == 0
    assert not [r for r in caplog.records if "more than once" in r.getMessage()]
