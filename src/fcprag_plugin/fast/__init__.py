"""Deprecated: now :mod:`fcprag_plugin.slot` (mixed batches: :mod:`fcprag_tools.mixed`)."""

from .._deprecated import alias
from ..slot import *  # noqa: F401,F403

alias(__name__, "fcprag_plugin.slot")


def __getattr__(name: str):
    if name in ("fused_mixed", "activate_mixed", "union_weights"):
        from fcprag_tools import mixed

        return getattr(mixed, name)
    raise AttributeError(name)
