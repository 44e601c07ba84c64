"""Deprecated: the label builder is now :mod:`fcprag_tools.labels` (tooling beside the library)."""

from fcprag_tools.labels import *  # noqa: F401,F403

from .._deprecated import alias

alias(__name__, "fcprag_tools.labels", ("builder", "manifest", "metrics", "prompts", "store", "shard", "batched"))
