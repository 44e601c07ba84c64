"""Integration shims for host codebases. They sit on top of the core; the core never imports them.

- :mod:`fcprag_plugin.hooks.prag`: replaces PRAG's uniform ``add_weighted_adapter`` merge.
- :mod:`fcprag_plugin.hooks.dyprag`: replaces DyPRAG's averaging of translator-generated LoRA factors.
- :mod:`fcprag_plugin.hooks.base`: the shared ``merge_hook`` mechanism (reversible patches, query context,
  weight computation, per-question log, script launcher).
"""

from .base import MergeHook, PatchSet, clear_context, get_context, run_script, set_context

__all__ = ["MergeHook", "PatchSet", "set_context", "clear_context", "get_context", "run_script"]
