"""The next step to paste: the host command that runs a chosen row, with every argument the study knows filled in
(its ``settings.json``: the model, the answer length; the dataset; this version's adapter recipe,
:data:`..adapters.LORA`, :data:`..adapters.LEARNING_RATE`, :data:`..adapters.EPOCHS`), and in one sentence what it
cannot know. PRAG's flags are those of its ``src/inference.py`` (``--model_name``, ``--dataset``,
``--max_new_tokens``, ``--num_train_epochs``, ``--learning_rate``, ``--lora_rank``, ``--lora_alpha``,
``--inference_method``: ``icl`` standard RAG, ``prag`` its sum, ``combine`` both)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
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


def prag_dataset(name: str) -> str | None:
    """PRAG's name of a study's dataset (``2wiki`` -> ``2wikimultihopqa``), or None when PRAG has no such dataset."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return next((v for k, v in PRAG_DATASETS.items() if key.startswith(k)), None)


def prag_model(settings: Mapping[str, Any]) -> str:
    """The model as PRAG's ``--model_name`` takes it: its short name when it has one, else the model as named."""
    named = str(settings.get("model_name") or settings.get("model") or "smollm2")
    return PRAG_MODELS.get(named, named)


def prag_args(settings: Mapping[str, Any], dataset: str) -> list[str]:
    """PRAG's ``src/inference.py`` arguments but the method, for ``dataset`` (a PRAG name or a shell word)."""
    from ..adapters import EPOCHS, LEARNING_RATE, LORA

    return ["--model_name", shlex.quote(prag_model(settings)), "--dataset", dataset,
            "--max_new_tokens", str(settings.get("max_new_tokens", 16)), "--num_train_epochs", str(EPOCHS),
            "--learning_rate", f"{LEARNING_RATE:g}", "--lora_rank", str(LORA["r"]),
            "--lora_alpha", str(LORA["lora_alpha"])]


def prag_unknown(settings: Mapping[str, Any], datasets: Sequence[str]) -> str:
    """What a PRAG command cannot know, in one sentence."""
    odd = [d for d in datasets if prag_dataset(d) is None]
    gguf = settings.get("gguf_file")
    return ("Run it in your PRAG checkout (its `src/root_dir_path.py` set to it), after PRAG's augmentation has "
            "written `data_aug/` and its `src/encode.py` with the same model, dataset and LoRA arguments has trained "
            "the passage adapters: this study cannot know where your checkout and data are"
            + (f"; PRAG loads `--model_name` with transformers and no GGUF file, so give it the Hugging Face name or "
               f"folder of the weights this study ran as {gguf}" if gguf else "")
            + (f"; PRAG knows the datasets {', '.join(sorted(set(PRAG_DATASETS.values())))}, not "
               f"{', '.join(odd)}" if odd else "") + ".")


@dataclass(frozen=True)
class Host:
    """A host's command: ``fcprag run NAME [--controller DIR --log fusion.jsonl] -- SCRIPT ARGS METHOD``."""

    name: str
    script: str
    method_flag: str
    args: Callable[[Mapping[str, Any], str], list[str]]
    unknown: Callable[[Mapping[str, Any], Sequence[str]], str]


HOSTS = {"prag": Host("prag", "src/inference.py", "--inference_method", prag_args, prag_unknown)}
# DyPRAG's rows bring Host("dyprag", "src/inference_dyprag.py", ...): its arguments and an exported translator


def command(spec: RowSpec, settings: Mapping[str, Any], datasets: Sequence[str], controller: str | None = None,
            every: Sequence[str] = ()) -> tuple[str, str]:
    """``(command, what it cannot know)`` that runs row ``spec`` on ``datasets`` (more than one: a loop), with the
    study's ``controller`` folder for a fusion; what it cannot know is said for ``every`` dataset of the study (one
    sentence under all its commands)."""
    host = HOSTS[spec.host]
    via = f" --controller {shlex.quote(controller)} --log fusion.jsonl" if controller else ""
    names = [prag_dataset(d) or shlex.quote(d) for d in datasets]
    one = f"fcprag run {host.name}{via} -- {host.script} " + " ".join(
        [*host.args(settings, '"$d"' if len(names) > 1 else names[0]), host.method_flag, spec.method])
    line = one if len(names) == 1 else f"for d in {' '.join(names)}; do {one}; done"
    return line, host.unknown(settings, every or datasets)
