"""DyPRAG's parameter translator for the study: train it on the study's training passages, load and export it in
DyPRAG's own checkpoint format, and turn its generated LoRAs into rows the study scores with its fused slot.

- :mod:`.network`: the translator (DyPRAG's state-dict layout), :class:`TranslatorShape`;
- :mod:`.checkpoint`: DyPRAG-format I/O, the shapes read from a file and checked against a model's config;
- :mod:`.embed`: passage embeddings as DyPRAG reads them; each passage's generated update and its seconds;
- :mod:`.compose`: a DyPRAG row's composite adapter (kappa acts squared there), the pairwise cosine of the
  passages' updates, the translator's cost beside PRAG's.
"""

from .checkpoint import check_fits, load_translator, read_state_dict, save_translator, shape_of
from .compose import cost_summary, dyprag_adapter, mean_pairwise_cosine, prag_adapter_seconds, update_inner
from .embed import generate_adapters, passage_embeddings
from .network import Translator, TranslatorError, TranslatorShape, generated_adapters

__all__ = ["Translator", "TranslatorError", "TranslatorShape", "check_fits", "cost_summary", "dyprag_adapter",
           "generate_adapters", "generated_adapters", "load_translator", "mean_pairwise_cosine", "passage_embeddings",
           "prag_adapter_seconds", "read_state_dict", "save_translator", "shape_of", "update_inner"]
