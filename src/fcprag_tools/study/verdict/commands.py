"""The next step to paste: the host commands that run a chosen row, with every argument the study knows filled in
(its ``settings.json``: the model, the answer length; the dataset; this version's adapter recipe,
:data:`..adapters.LORA`, :data:`..adapters.LEARNING_RATE`, :data:`..adapters.EPOCHS`), and in one sentence what it
cannot know.

PRAG's flags are those of its ``src/inference.py`` (``--model_name``, ``--dataset``, ``--max_new_tokens``,
``--num_train_epochs``, ``--learning_rate``, ``--lora_rank``, ``--lora_alpha``, ``--inference_method``: ``icl``
standard RAG, ``prag`` its sum, ``combine`` both). Its passage adapters come first, from its ``src/encode.py`` with the
same recipe: ``inference.py`` looks them up under ``offline/<model_name>/rank=R_alpha=A/<dataset>/lr=LR_epoch=E_...``,
and ``encode.py``'s own default is 3 epochs, not the study's 1. PRAG joins ``--model_name`` under its own folders
(``data_aug/``, ``offline/``), so it must be a Hugging Face name or a folder relative to PRAG's checkout (an absolute
path replaces the prefix); PRAG loads it with transformers and no GGUF file. Where the study knows no such name
(a GGUF file, an absolute folder) the command carries a placeholder that names the model.

DyPRAG's flags are those of its ``src/inference_dyprag.py`` (the same model and dataset names as PRAG's; required:
``--model_name``, ``--dataset``, ``--max_new_tokens``, ``--num_train_epochs``, ``--inference_method`` ``dyprag`` or
``dyprag_combine``, and the translator's ``--projector_path``, ``--inference_epoch``, ``--projector_p``, with
``--lora_rank`` and ``--lora_alpha`` asserted present). It loads the translator from
``projector/<--projector_path>/epoch_<--inference_epoch - 1>.pt`` in its checkout, so its command first copies the
study's export there (``translator.json``: ``export``, ``dyprag_flags``); a fusion runs it under ``fcprag run dyprag
--controller DIR --mode separate`` (the shim's ``u = w~/N`` on DyPRAG's separate averages, as the study scored it).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .catalogue import RowSpec

# PRAG's short model names (its get_model_path) by the Hugging Face name the study may have run
PRAG_MODELS = {"meta-llama/Meta-Llama-3-8B-Instruct": "llama3-8b-instruct",
               "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b-instruct",
               "meta-llama/Llama-3.2-1B-Instruct": "llama3.2-1b-instruct"}
# PRAG's dataset names, by the start of a study's dataset name (its question file's name, lower case, letters and
# digits only)
PRAG_DATASETS = {"hotpotqa": "hotpotqa", "2wiki": "2wikimultihopqa", "popqa": "popqa",
                 "complexwebquestions": "complexwebquestions", "cwq": "complexwebquestions"}
# a GGUF file's quantization tag (SmolLM2-135M-Instruct.Q4_1.gguf, model-q8_0.gguf, model.f16.gguf, ...)
QUANT_TAG = re.compile(r"[.-](?:i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def prag_dataset(name: str) -> str | None:
    """PRAG's name of a study's dataset (``2wiki`` -> ``2wikimultihopqa``), or None when PRAG has no such dataset."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return next((v for k, v in PRAG_DATASETS.items() if key.startswith(k)), None)


def gguf_model(gguf_file: str) -> str:
    """The model a GGUF file quantizes, from its name: ``SmolLM2-135M-Instruct.Q4_1.gguf`` ->
    ``SmolLM2-135M-Instruct``."""
    return QUANT_TAG.sub("", Path(gguf_file).name.removesuffix(".gguf"))


def absolute(name: str) -> bool:
    """``name`` is a folder PRAG cannot join under its own (an absolute path, or one from a home folder)."""
    return os.path.isabs(name) or name.startswith("~")


def prag_model(settings: Mapping[str, Any], host: str = "PRAG") -> str:
    """The model as PRAG's (``host``'s: DyPRAG shares PRAG's short names) ``--model_name`` takes it, as a shell
    word: its short name when PRAG has one, the name as given when it is a Hugging Face name or a relative folder,
    else a placeholder that names the model (a GGUF file: the Hugging Face model it quantizes; an absolute folder:
    its name)."""
    named = str(settings.get("model_name") or settings.get("model") or "smollm2")
    if settings.get("gguf_file"):
        return shlex.quote(f"<the Hugging Face name of {gguf_model(settings['gguf_file'])}>")
    if absolute(named):
        return shlex.quote(f"<the Hugging Face name of {Path(named).name}, or its folder relative to your {host} "
                           "checkout>")
    return shlex.quote(PRAG_MODELS.get(named, named))


def prag_recipe() -> list[str]:
    """The adapter recipe's flags (this study's; PRAG's ``encode.py`` trains with them and ``inference.py`` finds
    the adapters by them)."""
    from ..adapters import EPOCHS, LEARNING_RATE, LORA

    return ["--num_train_epochs", str(EPOCHS), "--learning_rate", f"{LEARNING_RATE:g}", "--lora_rank",
            str(LORA["r"]), "--lora_alpha", str(LORA["lora_alpha"])]


def prag_args(settings: Mapping[str, Any], dataset: str) -> list[str]:
    """PRAG's ``src/inference.py`` arguments but the method, for ``dataset`` (a PRAG name or a shell word)."""
    return ["--model_name", prag_model(settings), "--dataset", dataset,
            "--max_new_tokens", str(settings.get("max_new_tokens", 16)), *prag_recipe()]


def prag_encode(settings: Mapping[str, Any], dataset: str, method: str) -> str | None:
    """PRAG's ``src/encode.py`` line that trains the passage adapters ``method`` reads (none for ``icl``)."""
    if method == "icl":
        return None
    return " ".join(["python", "src/encode.py", "--model_name", prag_model(settings), "--dataset", dataset,
                     *prag_recipe()])


def prag_unknown(settings: Mapping[str, Any], datasets: Sequence[str]) -> str:
    """What a PRAG command cannot know, in one sentence."""
    return _unknown(settings, datasets, "PRAG") + "."


def _unknown(settings: Mapping[str, Any], datasets: Sequence[str], host: str,
             where: str = "(its `src/root_dir_path.py` set to it), after its") -> str:
    """:func:`prag_unknown`'s sentence without its full stop; ``where``: what follows "your HOST checkout"."""
    odd = [d for d in datasets if prag_dataset(d) is None]
    named = str(settings.get("model_name") or settings.get("model") or "")
    gguf = settings.get("gguf_file")
    if gguf:
        model = (f"; {host} loads `--model_name` with transformers and no GGUF file, so give the Hugging Face name of "
                 f"{gguf_model(gguf)} (this study ran its quantized {Path(gguf).name}) or its folder relative to "
                 f"the checkout, never an absolute path ({host} joins the name under its own folders)")
    elif absolute(named):
        model = ("; give `--model_name` as the model's Hugging Face name or its folder relative to the checkout, "
                 f"never an absolute path ({host} joins the name under its own folders)")
    else:
        model = ""
    return (f"Run them in your {host} checkout {where} `src/augment.py` has "
            "written `data_aug/` for the same `--model_name` and dataset: this study cannot know where your checkout "
            "and data are" + model
            + (f"; {host} knows the datasets {', '.join(sorted(set(PRAG_DATASETS.values())))}, not "
               f"{', '.join(odd)}" if odd else ""))


# ----------------------------------------------------------------------------- DyPRAG's src/inference_dyprag.py
def dyprag_flag(settings: Mapping[str, Any], key: str, what: str) -> str:
    """One of the translator's flags (``translator.json``'s ``dyprag_flags``, which ``settings["translator"]``
    carries) as a shell word; a placeholder naming ``what`` where the folder records no translator."""
    v = ((settings.get("translator") or {}).get("dyprag_flags") or {}).get(key)
    return shlex.quote(f"<{what}>" if v is None else f"{v:g}" if isinstance(v, float) else str(v))


def dyprag_args(settings: Mapping[str, Any], dataset: str) -> list[str]:
    """DyPRAG's ``src/inference_dyprag.py`` arguments but the method, for ``dataset``: the model, the answer length,
    the study's recipe (``--num_train_epochs`` and ``--learning_rate`` only name DyPRAG's output folder), and the
    translator's rank, alpha, folder under ``projector/``, epochs and width."""
    from ..adapters import EPOCHS, LEARNING_RATE

    return ["--model_name", prag_model(settings, "DyPRAG"), "--dataset", dataset,
            "--max_new_tokens", str(settings.get("max_new_tokens", 16)), "--num_train_epochs", str(EPOCHS),
            "--learning_rate", f"{LEARNING_RATE:g}",
            "--lora_rank", dyprag_flag(settings, "lora_rank", "the translator's LoRA rank"),
            "--lora_alpha", dyprag_flag(settings, "lora_alpha", "the LoRA alpha"),
            "--projector_path", dyprag_flag(settings, "projector_path", "your translator's folder under projector/"),
            "--inference_epoch", dyprag_flag(settings, "inference_epoch", "its epochs"),
            "--projector_p", dyprag_flag(settings, "projector_p", "its hypernet width")]


def dyprag_setup(settings: Mapping[str, Any]) -> str:
    """The line that copies the study's exported translator into DyPRAG's ``projector/`` (``inference_dyprag.py``
    loads ``projector/<--projector_path>/epoch_<--inference_epoch - 1>.pt`` from its checkout)."""
    export = (settings.get("translator") or {}).get("export")
    folder = str(Path(str(settings.get("out", "OUT"))) / Path(export).parent) if export else \
        "<your translator folder, with its epoch_<E-1>.pt>"
    return f"mkdir -p projector && cp -r {shlex.quote(folder)} projector/"


def dyprag_unknown(settings: Mapping[str, Any], datasets: Sequence[str]) -> str:
    """What a DyPRAG command cannot know, in one sentence."""
    # DyPRAG's script joins every path under ROOT_DIR (as it ships, its authors' own path), never the current folder
    where = ("with `ROOT_DIR` in its `src/root_dir_path.py` set to that checkout's absolute path (`src/"
             "inference_dyprag.py` loads the translator from `ROOT_DIR/projector/<--projector_path>/epoch_"
             "<--inference_epoch - 1>.pt`, not from the folder it runs in, reads `ROOT_DIR/data_aug/` and writes "
             "under `ROOT_DIR/output/`; as DyPRAG ships it, `ROOT_DIR` is its authors' own path), after its")
    return (_unknown(settings, datasets, "DyPRAG", where) + "; DyPRAG's `--model_name` is a key of its own model "
            "table (" + ", ".join(f"`{v}`" for v in PRAG_MODELS.values()) + ", folders under the path set in its "
            "`src/utils.py`) or a name it loads as it is, and it picks its model class by `llama` or `qwen` in that "
            "name (a Llama-architecture model of another name needs a folder name with `llama` in it); the "
            "translator fits only the model it was made for, and its folder above is the study's as this study "
            "was given it (give it as seen from the checkout).")


@dataclass(frozen=True)
class Host:
    """A host's command: ``fcprag run NAME [--controller DIR MODE --log fusion.jsonl] -- SCRIPT ARGS METHOD``, after
    ``prepare``'s line per dataset when it gives one (what the script reads first: PRAG's passage adapters), and
    ``setup``'s once before them all (DyPRAG's translator copied where its script looks); ``prepared``: what the
    first line does, in words; ``mode``: the shim's merge mode flags after ``--controller``."""

    name: str
    script: str
    method_flag: str
    args: Callable[[Mapping[str, Any], str], list[str]]
    unknown: Callable[[Mapping[str, Any], Sequence[str]], str]
    prepare: Callable[[Mapping[str, Any], str, str], str | None] | None = None
    prepared: str = ""  # what the prepare (or setup) line does, in words
    setup: Callable[[Mapping[str, Any]], str] | None = None
    mode: str = ""


HOSTS = {"prag": Host("prag", "src/inference.py", "--inference_method", prag_args, prag_unknown, prag_encode,
                      "PRAG's `src/encode.py` first trains the passage adapters with this study's recipe (`src/"
                      "inference.py` looks them up by its epochs, learning rate, rank and alpha)"),
         "dyprag": Host("dyprag", "src/inference_dyprag.py", "--inference_method", dyprag_args, dyprag_unknown,
                        prepared="the first line copies the study's translator, exported in DyPRAG's format, into "
                                 "`projector/` of the DyPRAG checkout the lines run in, which must be `ROOT_DIR` of "
                                 "its `src/root_dir_path.py`: `src/inference_dyprag.py` loads `ROOT_DIR/projector/"
                                 "<--projector_path>/epoch_<--inference_epoch - 1>.pt`",
                        setup=dyprag_setup, mode=" --mode separate")}


def command(spec: RowSpec, settings: Mapping[str, Any], datasets: Sequence[str], controller: str | None = None,
            every: Sequence[str] = ()) -> tuple[str, str, str]:
    """``(command, what its first line does or "", what it cannot know)`` that runs row ``spec`` on ``datasets``
    (more than one: a loop), with the study's ``controller`` folder for a fusion, each run after its host's
    ``prepare`` line; what it cannot know is said for ``every`` dataset of the study (one sentence under all its
    commands)."""
    host = HOSTS[spec.host]
    via = f" --controller {shlex.quote(controller)}{host.mode} --log fusion.jsonl" if controller else ""
    names = [prag_dataset(d) or shlex.quote(d) for d in datasets]
    word = '"$d"' if len(names) > 1 else names[0]
    run = f"fcprag run {host.name}{via} -- {host.script} " + " ".join(
        [*host.args(settings, word), host.method_flag, spec.method])
    first = host.prepare(settings, word, spec.method) if host.prepare else None
    lines = [first, run] if first else [run]
    text = "\n".join(lines) if len(names) == 1 else "\n".join(
        [f"for d in {' '.join(names)}; do", *(f"  {x}" for x in lines), "done"])
    once = host.setup(settings) if host.setup else None
    return ("\n".join(filter(None, [once, text])), host.prepared if first or once else "",
            host.unknown(settings, every or datasets))
