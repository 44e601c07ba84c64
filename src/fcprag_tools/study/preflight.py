"""``fcprag study``'s checks before any work: every input is read or probed once, here, before the study folder is
created, so that a mistake ends in one line naming the option (exit 2) with nothing written.

What is checked, in order (:func:`check`, which returns the options resolved: a new value, the one the stages
read): each option on its own (:meth:`.options.StudyOptions.validate`), the model's name (``smollm2`` or none: the
packaged offline SmolLM2, :func:`fcprag_tools.lm.model_io.resolve_model`), ``--device`` / ``--dtype``, ``--out``
(:func:`check_out`: new, empty, or a study folder whose recorded settings match; never a folder of other files,
never a file), the question files (readable UTF-8, parsed by :func:`.data.read_question_files`), the questions the
study takes (:func:`select_questions`: a controller's training ids left out, ``--limit``, passages or
``--retrieval``, ``--train-ids``), ``--controller`` (a saved controller), the embedding model (``--encoder``, the
controller's, or the library's default: available offline), the model (config and tokenizer, or a GGUF file's
header, without the weights; it has the Linear layers PRAG's LoRA recipe targets), and DyPRAG's translator
(:func:`check_translator_file`: ``--dyprag-translator``'s shapes read from the file against the model's config;
:func:`check_translator_folder`: a translator the study trained before, recorded with other ``--translator-*``
options, is refused).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fcprag_plugin.errors import FcpragError
from fcprag_plugin.fileio import read_json_if_present, read_json_object
from ..lm.shard import ShardInfo
from ..options import ModelPart, Runtime
from . import data
from .options import Plan, Split, StudyOptions, TranslatorPart

logger = logging.getLogger(__name__)

# what decides the cached results: a resumed run must use the same values (checked against OUT/settings.json)
FIXED = ("questions_sha256", "model", "gguf_file", "dtype", "top_k", "retrieval", "test_fraction", "seed",
         "train_ids", "controller", "generate", "max_new_tokens", "limit", "max_tokens")
# fixed only while the labels are being made (their scale grid); once each setting's controller is trained (or with
# --controller, which builds no labels) another value only adds rows: see missing_rows
LABEL_FIXED = ("scales",)
SETTINGS = "settings.json"


@dataclass(frozen=True)
class Selection:
    """The questions a study takes (in file order), the user's retrieval file (None: BM25) and the held-out ids."""

    questions: list[dict[str, Any]]
    given: dict[str, dict[str, Any]] | None
    test: set[str]


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolved_dtype(m: ModelPart, local_rank: int = 0) -> str:
    """The dtype the model is loaded in (``--dtype auto``: :func:`fcprag_tools.lm.model_io.auto_dtype` on the
    device this process uses), as ``settings.json`` records it."""
    from ..lm.model_io import dtype_name, resolve_device, resolve_dtype

    return dtype_name(resolve_dtype(m.dtype, resolve_device(m.device, local_rank)))


def settings_of(o: StudyOptions, local_rank: int = 0) -> dict[str, Any]:
    """What ``OUT/settings.json`` records for options ``o`` on the process of ``local_rank`` (its dtype resolved:
    the same numbers whether ``auto`` or the dtype it means was given)."""
    import hashlib

    plan, m, split, gen = o.plan, o.model, o.split, o.generation
    shas = [_sha256(Path(q)) for q in plan.questions]  # one file: its own sha256 (what `sha256sum FILE` prints)
    return {"questions": [str(Path(q).resolve()) for q in plan.questions] if len(plan.questions) > 1
            else str(Path(plan.questions[0]).resolve()),
            "questions_sha256": shas[0] if len(shas) == 1 else hashlib.sha256(" ".join(shas).encode()).hexdigest(),
            "model": m.model, "model_name": m.name or m.model, "gguf_file": m.gguf_file,
            "dtype": resolved_dtype(m, local_rank),
            "top_k": plan.top_k,
            "retrieval": None if plan.retrieval is None else _sha256(Path(plan.retrieval)),
            "train_ids": None if split.train_ids is None else _sha256(Path(split.train_ids)),
            "test_fraction": split.test_fraction, "seed": split.seed, "scales": [float(s) for s in plan.scales],
            "controller": None if plan.controller is None else str(Path(plan.controller).resolve()),
            "generate": gen.generate, "max_new_tokens": gen.max_new_tokens, "limit": split.limit,
            "max_tokens": o.batching.max_tokens}


def recorded_settings(out: Path) -> dict[str, Any] | None:
    """``OUT/settings.json`` when it is a study's (a JSON object with the study's keys), else None."""
    try:
        old = read_json_if_present(out / SETTINGS, ValueError)
    except (OSError, ValueError):
        return None
    return old if old is not None and "questions_sha256" in old and "model" in old else None


def labels_made(out: Path, controller: str | None) -> bool:
    """The study in ``out`` needs no more labels: each setting's controller is trained (or it is given)."""
    from .summary import SETTINGS, suffix

    return controller is not None or all((out / "train" / f"done{suffix(s)}.json").is_file() for s in SETTINGS)


def compare_settings(out: Path, old: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse a resume whose value of a :data:`FIXED` setting differs from the one recorded (one line); of a
    :data:`LABEL_FIXED` one too while the study still makes labels."""
    fixed = FIXED if labels_made(out, now["controller"]) else FIXED + LABEL_FIXED
    for k in fixed:
        if old.get(k) != now[k]:
            flag = {"questions_sha256": "QUESTIONS (its content)", "retrieval": "--retrieval (its content)",
                    "train_ids": "--train-ids (its content)"}.get(k, f"--{k.replace('_', '-')}")
            raise FcpragError(f"--out {out}: it holds a study run with {k}={old.get(k)!r}, not {now[k]!r}; resume "
                              f"with the same {flag}, or choose another --out")


def _inside(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def check_out(o: StudyOptions, *, contents: bool = True, local_rank: int = 0) -> bool:
    """``--out`` is the study's own folder: new (its parent writable), empty, or an earlier study's whose recorded
    settings match (returns True: a resume). A file, a folder of other files, or an input inside it is refused.
    ``contents=False`` (ranks other than 0 under a launcher, while rank 0 may be creating it): only the inputs."""
    out = Path(o.out)
    if contents and out.exists() and not out.is_dir():
        raise FcpragError(f"--out {out}: it is a file; the study needs a folder of its own: a new or empty one (or "
                          "an earlier study's, to resume it)")
    names = sorted(os.listdir(out)) if contents and out.is_dir() else []
    if names and recorded_settings(out) is None:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise FcpragError(f"--out {out}: it holds files that are not a study's ({shown}); choose a new or empty "
                          "folder (a study writes its caches, report and controller there)")
    plan = o.plan
    inputs = [*(("QUESTIONS", q) for q in plan.questions), ("--retrieval", plan.retrieval),
              ("--train-ids", o.split.train_ids), ("--controller", plan.controller)]
    for what, path in inputs:
        if path is not None and _inside(Path(path), out):
            raise FcpragError(f"{what} {path}: it is inside --out {out}, the study's own folder, where the study "
                              "writes its caches; keep the inputs outside it, or choose another --out")
    if not contents:
        return False
    if not out.exists():
        parent = next(p for p in out.absolute().parents if p.exists())
        if not parent.is_dir():
            raise FcpragError(f"--out {out}: {parent} is a file, not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise FcpragError(f"--out {out}: cannot create it: {parent} is not writable")
        return False
    if not os.access(out, os.W_OK | os.X_OK):
        raise FcpragError(f"--out {out}: the folder is not writable")
    if not names:
        return False
    compare_settings(out, recorded_settings(out), settings_of(o, local_rank))
    return True


def select_questions(plan: Plan, split: Split) -> Selection:
    """The questions the study takes: every file's (:func:`.data.read_question_files`), less those a given
    controller was trained on (its ``train_question_ids.json``), the first ``--limit``; with their passages (or
    ``--retrieval``'s) and the held-out ids (all with ``--controller``, ``--train-ids``' complement, or the seeded
    split). Every mistake is one line."""
    qs = data.read_question_files(plan.questions)
    listed = Path(plan.controller or "") / "train_question_ids.json"
    if plan.controller and listed.is_file():
        trained = set(data.read_ids(listed, f"--controller {plan.controller}: {listed.name}"))
        left = sum(q["id"] in trained for q in qs)
        if left:
            logger.warning("leaving out %d question(s) that %s was trained on (its train_question_ids.json)", left,
                           plan.controller)
        qs = [q for q in qs if q["id"] not in trained]
    if split.limit is not None:
        qs = qs[:split.limit]
    if len(qs) < 2:
        raise FcpragError(f"{' '.join(plan.questions)}: {len(qs)} question(s); a study needs at least 2")
    given = None
    if plan.retrieval:
        given = data.read_retrieval(plan.retrieval)
    bare = [q for q in qs if q["passages"] is None and (given is None or q["id"] not in given)]
    if bare and given is None:
        raise FcpragError(f"QUESTIONS: {len(bare)} question(s) have no passages (first: '{bare[0]['id']}', a "
                          "PopQA or ComplexWebQuestions file?); give their passages with --retrieval FILE")
    if given is not None:
        missing = [q["id"] for q in qs if q["id"] not in given]
        if missing:
            raise FcpragError(f"--retrieval {plan.retrieval}: no passages for question id '{missing[0]}' "
                              f"({len(missing)} missing)")
    ids = [q["id"] for q in qs]
    if plan.controller:
        test = set(ids)
    elif split.train_ids:
        test = data.split_by_ids(ids, data.read_ids(split.train_ids), f"--train-ids {split.train_ids}")
    else:
        test = data.stratified_split(qs, split.test_fraction, split.seed)
    return Selection(qs, given, test)


def check_device(device: str, dtype: str, local_rank: int = 0) -> None:
    """``--device`` names a device this machine has, ``--dtype`` a known dtype."""
    from ..lm.model_io import resolve_device, resolve_dtype

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FcpragError(f"--device {device}: CUDA is not available on this machine; use --device cpu (or auto)")
    dev = resolve_device(device, local_rank)
    resolve_dtype(dtype, dev)
    if dev.type == "cuda":  # available: "cuda..." was checked above, and auto picks CUDA only when it is there
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise FcpragError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    elif dev.type != "cpu":
        backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise FcpragError(f"--device {device}: no {dev.type} device on this machine; expected auto, cpu, cuda or "
                              "cuda:N")


def _encoder_available(name: str | None, what: str) -> None:
    """The embedding model ``name`` (None: the library's default) can be loaded here without a download."""
    from fcprag_plugin.encoding import downloads_allowed, not_local_message, resolve_model

    try:
        resolved, load_from = resolve_model(name)
    except FcpragError as e:
        raise FcpragError(f"{what}: {e}") from None
    if not os.path.exists(load_from) and not downloads_allowed():
        raise FcpragError(f"{what}: {not_local_message(resolved)}")


def check_controller_and_encoder(plan: Plan) -> None:
    """``--controller`` is a saved controller; the embedding model the study will use is available offline."""
    ctrl = None
    if plan.controller:
        from fcprag_plugin import FusionController

        try:
            ctrl = FusionController.from_pretrained(plan.controller)
        except (FcpragError, OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            raise FcpragError(f"--controller {plan.controller}: not a saved controller ({' '.join(str(e).split())}); "
                              "expected a folder written by fcprag train or fcprag study (its controller/)") from None
    if isinstance(plan.encoder, (str, Path)):
        _encoder_available(str(plan.encoder), f"--encoder {plan.encoder}")
    elif plan.encoder is None and ctrl is not None:
        name = ctrl.config.embedding_model
        if name is not None:
            _encoder_available(name, f"--controller {plan.controller}: its embedding model '{name}'")
    elif plan.encoder is None:
        _encoder_available(None, "the default embedding model (--encoder)")


def check_model(m: ModelPart) -> None:
    """The model loads here (config and tokenizer, or the GGUF header) and has PRAG's LoRA target layers."""
    from ..lm.model_io import check_model_offline
    from .adapters import LORA

    linears = check_model_offline(m.model, m.gguf_file)
    targets = LORA["target_modules"]
    if not set(targets) & linears:
        raise FcpragError(f"--model {m.model}: no Linear layer named {'/'.join(targets)}, the modules PRAG's LoRA "
                          "recipe targets; choose a model with a gated MLP (Llama, Qwen2, Mistral, ...)")


def model_config(m: ModelPart) -> Any:
    """The sizes of the model a translator must fit (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``),
    without its weights: a folder's config, or a GGUF file's header (what :func:`check_model` read; transformers'
    own GGUF config reader parses far more of the file)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from ..lm.model_io import gguf_header, quiet_loading

    try:
        if m.gguf_file:
            meta, _ = gguf_header(os.path.join(m.model, m.gguf_file))
            arch = meta["general.architecture"]
            return SimpleNamespace(num_hidden_layers=int(meta[f"{arch}.block_count"]),
                                   hidden_size=int(meta[f"{arch}.embedding_length"]),
                                   intermediate_size=int(meta[f"{arch}.feed_forward_length"]))
        with quiet_loading():
            return AutoConfig.from_pretrained(m.model)
    except (OSError, ValueError, KeyError) as e:
        what = f"--model {m.model}" + (f" --gguf-file {m.gguf_file}" if m.gguf_file else "")
        raise FcpragError(f"{what}: its sizes could not be read ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
                          ) from None


def check_translator_folder(o: StudyOptions) -> None:
    """A translator recorded in ``--out`` as trained there with other ``--translator-*`` options is refused (the
    translator folder keeps one translator); read before anything else of the study folder's rows."""
    from . import dyprag as dy

    part = o.dyprag
    if not part.dyprag or part.dyprag_translator is not None or o.plan.controller is not None:
        return
    try:
        rec = dy.recorded(Path(o.out))
    except FcpragError:
        rec = None
    have, want = (rec or {}).get("options"), dy.training_options(part.training())
    if rec is not None and rec.get("source") == "trained" and have != want:
        diff = next(k for k in want if have is None or have.get(k) != want[k])
        flag = {"learning_rate": "--translator-lr"}.get(diff, f"--translator-{diff}")
        raise FcpragError(f"{flag} {want[diff]}: --out {o.out} holds a translator trained with {diff}="
                          f"{(have or {}).get(diff)!r} ({dy.TRANSLATOR_DIR}/{dy.RECORD}); resume with the same "
                          f"{flag}, or delete {Path(o.out) / dy.TRANSLATOR_DIR} to train another")


def check_translator_file(o: StudyOptions) -> None:
    """``--dyprag-translator``: a checkpoint in DyPRAG's format whose every key has the shape the model needs (one
    line naming the file, the key and both shapes), read against the model's config (:func:`model_config`)."""
    from ..translator import TranslatorError, check_fits, read_state_dict

    path = o.dyprag.dyprag_translator
    if not o.dyprag.dyprag or path is None:
        return
    try:
        check_fits(read_state_dict(path), path, model_config(o.model), model=f"--model {o.model.name or o.model.model}")
    except TranslatorError as e:
        raise FcpragError(f"--dyprag-translator {e}") from None


def resolve(m: ModelPart) -> ModelPart:
    """``--model`` (``smollm2`` or none: the packaged offline SmolLM2, said in one line) and ``--gguf-file`` as what
    is loaded, with the name the user gave (a report's title)."""
    from ..lm.model_io import SMOLLM2, resolve_model

    model, gguf_file, note = resolve_model(m.model, m.gguf_file)
    if note:
        logger.info("%s", note)
    return replace(m, model=model, gguf_file=gguf_file, name=m.name or m.model or SMOLLM2)


def missing_rows(out: Path, plan: Plan, dyprag: TranslatorPart | None = None) -> dict[str, list[str]]:
    """The rows that ``plan`` and ``dyprag`` ask for and the study in ``out`` lacks: ``{qid: [row names]}``
    (empty: nothing to add). Options that only add rows: ``--scales`` (a ``scale:S`` row each), the Arrow row
    (unless ``--no-arrow``) and DyPRAG's rows (unless ``--no-dyprag``; None: not asked): held out and on the
    training questions (its candidates), each scored with the translator the options name
    (:func:`.dyprag.expected_identity`); rows the study holds beyond them are kept. Reads ``questions.jsonl`` and
    ``eval.jsonl`` (and the translator's record) only, no model; a partial last line is left for the run that owns
    it."""
    from . import dyprag as dy

    from ..lm.store import read_label_lines

    def rows(name: str) -> dict[str, dict[str, Any]]:
        path = out / name
        return {sl.record["id"]: sl.record for sl in read_label_lines(path, partial="ignore")} if path.is_file() \
            else {}

    scored = rows("eval.jsonl")
    names = [f"scale:{float(s):g}" for s in plan.scales] + (["arrow"] if plan.arrow else [])
    qs = rows("questions.jsonl")
    sha = None if dyprag is None else dy.expected_identity(out, dyprag, plan.controller is not None)

    def lacks(q: str) -> list[str]:
        own = [n for n in names if f"{q}|{n}" not in scored] if qs[q].get("split") == "test" else []
        dy_rows = [] if sha is None else dy.wanted_rows(qs[q], ("param", "combine"))
        return own + [n for n in dy_rows if scored.get(f"{q}|{n}", {}).get("translator", "") != sha or not sha]

    return {q: lack for q in qs if (lack := lacks(q))}


def finished(out: Path, plan: Plan, dyprag: TranslatorPart | None = None) -> dict[str, Any] | None:
    """A finished study's ``summary.json`` when nothing it was built from changed since (a complete summary newer
    than every stage cache and the recorded settings, no unmerged part file, a given controller's files older too)
    and it has every row ``plan`` asks for (:func:`missing_rows`), else None. ``--encoder`` is not compared: deleting
    ``OUT/summary.json`` rebuilds the summary with it."""
    from .summary import check_summary

    try:
        made = (out / "summary.json").stat().st_mtime
        s = read_json_object(out / "summary.json", ValueError, "not found")
    except (OSError, ValueError):
        return None
    if check_summary(s) or any(out.glob("*.part*-of*.jsonl")):
        return None
    inputs = [p for p in out.glob("*.jsonl") if p.name != "timings.jsonl"]
    inputs += [out / SETTINGS, *out.glob("train/done*.json")]  # each setting's trained-controller marker
    inputs += [p for p in Path(plan.controller).rglob("*") if p.is_file()] if plan.controller else []
    if any(p.is_file() and p.stat().st_mtime > made for p in inputs):
        return None
    lack = missing_rows(out, plan, dyprag)
    if lack:
        names = sorted({n for ns in lack.values() for n in ns})
        logger.info("%s: the study is finished but lacks %d row(s) (%s) of %d question(s): computing only those, "
                    "then the report", out, sum(map(len, lack.values())), ", ".join(names), len(lack))
        return None
    return s


@dataclass(frozen=True)
class Checked:
    """What :func:`check` found: the options resolved (what the stages read); ``--out`` holds a study to resume; its
    summary when that study is finished (nothing else was checked then); the questions."""

    options: StudyOptions
    resume: bool
    summary: dict[str, Any] | None
    selection: Selection | None


def check(o: StudyOptions, *, rank: int = 0, local_rank: int = 0, distributed: bool = False) -> Checked:
    """Every check before the study folder is created (see the module), at the first mistake a one-line
    :class:`FcpragError`. A finished study (:func:`finished`) is not checked further: nothing will run."""
    o.validate()
    o = replace(o, model=resolve(o.model))
    check_device(o.model.device, o.model.dtype, local_rank)  # before --out: a resume compares the dtype it resolves
    resume = check_out(o, contents=rank == 0 or not distributed, local_rank=local_rank)
    check_translator_folder(o)
    done = finished(Path(o.out), o.plan, o.dyprag)
    if done is not None:
        return Checked(o, True, done, None)
    sel = select_questions(o.plan, o.split)
    check_controller_and_encoder(o.plan)
    check_model(o.model)
    check_translator_file(o)
    return Checked(o, resume, None, sel)


def set_threads(runtime: Runtime, device: str, shard: ShardInfo) -> int:
    """Set torch's CPU threads (:func:`fcprag_tools.lm.model_io.set_threads`: ``--threads``, else
    ``$OMP_NUM_THREADS``, else the free cores); on a CPU, one line says how many and why."""
    from ..lm import model_io

    n, why = model_io.set_threads(runtime.threads)
    if model_io.resolve_device(device, shard.local_rank).type == "cpu" and shard.rank == 0:
        logger.info("torch threads: %d (%s)", n, why)
    return n
