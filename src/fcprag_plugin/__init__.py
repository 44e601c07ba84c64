"""fcprag-plugin: weighted fusion of per-passage LoRA adapters for Parametric RAG. Data path: texts -> ``encoding``
-> ``features`` -> ``controller`` -> weights (:func:`weigh`) -> ``merge`` -> adapter -> generate (:func:`fuse`), or ->
``slot`` on a live model (:func:`fuse_into`)."""

from __future__ import annotations

import logging

from .adapter import LoraAdapter, LoraModule
from .controller import ControllerConfig, ControllerOutput, FusionController
from .encoding import TextEncoder  # sentence-transformers itself is imported when an encoder is built
from .errors import (AdapterError, ControllerError, EncoderError, FcpragError, FusionInputError, HookError,
                     LabelFileError, MergeError, UnsupportedAdapterError)
from .fusion import FusionResult, LiveFusion, fuse, fuse_into
from .loading import cache_info, clear_caches
from .slot import activate
from .merge import MergeResult, WeightedAdapterMerger
from .weights import FusionWeights, weigh


__version__ = "0.1.0"
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["fuse", "FusionResult", "fuse_into", "LiveFusion", "weigh", "FusionWeights", "clear_caches", "cache_info",
           "FusionController", "ControllerConfig", "ControllerOutput", "WeightedAdapterMerger", "MergeResult",
           "LoraAdapter", "LoraModule", "TextEncoder", "activate", "FcpragError", "AdapterError",
           "UnsupportedAdapterError", "MergeError", "ControllerError", "EncoderError", "FusionInputError",
           "LabelFileError", "HookError"]
