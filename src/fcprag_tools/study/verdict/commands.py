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


def prag_model(settings: Mapping[str, Any]) -> str:
    """The model as PRAG's ``--model_name`` takes it, as a shell word: its short name when PRAG has one, the name as
    given when it is a Hugging Face name or a relative folder, else a placeholder that names the model (a GGUF
    file: the Hugging Face model it quantizes; an absolute folder: its name)."""
    named = str(settings.get("model_name") or settings.get("model") or "smollm2")
    if settings.get("gguf_file"):
        return shlex.quote(f"<the Hugging Face name of {gguf_model(settings['gguf_file'])}>")
    if absolute(named):
        return shlex.quote(f"<the Hugging Face name of {Path(named).name}, or its folder relative to your PRAG "
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
    odd = [d for d in datasets if prag_dataset(d) is None]
    named = str(settings.get("model_name") or settings.get("model") or "")
    gguf = settings.get("gguf_file")
    if gguf:
        model = (f"; PRAG loads `--model_name` with transformers and no GGUF file, so give the Hugging Face name of "
                 f"{gguf_model(gguf)} (this study ran its quantized {Path(gguf).name}) or its folder relative to "
                 "the checkout, never an absolute path (PRAG joins the name under its own folders)")
    elif absolute(named):
        model = ("; give `--model_name` as the model's Hugging Face name or its folder relative to the checkout, "
                 "never an absolute path (PRAG joins the name under its own folders)")
    else:
        model = ""
    return ("Run them in your PRAG checkout (its `src/root_dir_path.py` set to it), after its `src/augment.py` has "
            "written `data_aug/` for the same `--model_name` and dataset: this study cannot know where your checkout "
            "and data are" + model
            + (f"; PRAG knows the datasets {', '.join(sorted(set(PRAG_DATASETS.values())))}, not "
               f"{', '.join(odd)}" if odd else "") + ".")


@dataclass(frozen=True)
class Host:
    """A host's command: ``fcprag run NAME [--controller DIR --log fusion.jsonl] -- SCRIPT ARGS METHOD``, after
    ``prepare``'s line when it gives one (what the script reads first: PRAG's passage adapters)."""

    name: str
    script: str
    method_flag: str
    args: Callable[[Mapping[str, Any], str], list[str]]
    unknown: Callable[[Mapping[str, Any], Sequence[str]], str]
    prepare: Callable[[Mapping[str, Any], str, str], str | None] | None = None
    prepared: str = ""  # what the prepare line does, in words


HOSTS = {"prag": Host("prag", "src/inference.py", "--inference_method", prag_args, prag_unknown, prag_encode,
                      "PRAG's `src/encode.py` first trains the passage adapters with this study's recipe (`src/"
                      "inference.py` looks them up by its epochs, learning rate, rank and alpha)")}
# DyPRAG's rows bring Host("dyprag", "src/inference_dyprag.py", ...): its arguments and an exported translator


def command(spec: RowSpec, settings: Mapping[str, Any], datasets: Sequence[str], controller: str | None = None,
            every: Sequence[str] = ()) -> tuple[str, str, str]:
    """``(command, what its first line does or "", what it cannot know)`` that runs row ``spec`` on ``datasets``
    (more than one: a loop), with the study's ``controller`` folder for a fusion, each run after its host's
    ``prepare`` line; what it cannot know is said for ``every`` dataset of the study (one sentence under all its
    commands)."""
    host = HOSTS[spec.host]
    via = f" --controller {shlex.quote(controller)} --log fusion.jsonl" if controller else ""
    names = [prag_dataset(d) or shlex.quote(d) for d in datasets]
    word = '"$d"' if len(names) > 1 else names[0]
    run = f"fcprag run {host.name}{via} -- {host.script} " + " ".join(
        [*host.args(settings, word), host.method_flag, spec.method])
    first = host.prepare(settings, word, spec.method) if host.prepare else None
    lines = [first, run] if first else [run]
    text = "\n".join(lines) if len(names) == 1 else "\n".join(
        [f"for d in {' '.join(names)}; do", *(f"  {x}" for x in lines), "done"])
    return text, host.prepared if first else "", host.unknown(settings, every or datasets)
