"""DyPRAG's parameter translator for the study: train it on the study's training passages, load and export it in
DyPRAG's own checkpoint format, and turn its generated LoRAs into rows the study scores with its fused slot.

- :mod:`.network`: the translator (DyPRAG's state-dict layout), :class:`TranslatorShape`;
- :mod:`.checkpoint`: DyPRAG-format I/O, the shapes read from a file and checked against a model's config;
- :mod:`.embed`: passage embeddings as DyPRAG reads them; each passage's generated update and its seconds;
- :mod:`.train`: :func:`train_translator`, DyPRAG's recipe, resumable;
- :mod:`.compose`: a DyPRAG row's composite adapter (kappa acts squared there), the pairwise cosine of the
  passages' updates, the translator's cost beside PRAG's.

A stage's calls, in order: before any work, a given checkpoint's ``check_fits(read_state_dict(FILE), FILE,
model_config, model="--model NAME")``; ``train_translator(model, tok, {pid: aug row}, adapter_of, opts, folder,
progress)`` (or ``load_translator(FILE, model.config)``); per held-out question ``generate_adapters(model, tok,
translator, {pid: text}, cache=...)``; ``dyprag_adapter(generated, w~)`` into ``scoring.Row(..., update=composite)``
(``prompt="combine"``: DyPRAG-Combine); ``mean_pairwise_cosine`` of the generated and of the PRAG adapters;
``cost_summary(train seconds, generation seconds, prag_adapter_seconds(adapters.jsonl rows))``.
"""

from .checkpoint import check_fits, load_translator, read_state_dict, save_translator, shape_of
from .compose import cost_summary, dyprag_adapter, mean_pairwise_cosine, prag_adapter_seconds, update_inner
from .embed import generate_adapters, passage_embeddings
from .network import Translator, TranslatorError, TranslatorShape, generated_adapters
from .train import TranslatorOptions, train_translator

__all__ = ["Translator", "TranslatorError", "TranslatorOptions", "TranslatorShape", "check_fits", "cost_summary",
           "dyprag_adapter", "generate_adapters", "generated_adapters", "load_translator", "mean_pairwise_cosine",
           "passage_embeddings", "prag_adapter_seconds", "read_state_dict", "save_translator", "shape_of",
           "train_translator", "update_inner"]
