"""Deprecated: now :mod:`fcprag_plugin.hosts` (the PRAG and DyPRAG shims)."""

from .._deprecated import alias
from ..hosts import *  # noqa: F401,F403
from ..hosts import base, dyprag, prag  # noqa: F401

alias(__name__, "fcprag_plugin.hosts", ("base", "prag", "dyprag"))
