"""The label builder's own error type (kept here so the core ``errors`` module stays untouched)."""

from __future__ import annotations

from fcprag_plugin.errors import FcpragError


class LabelBuildError(FcpragError, RuntimeError):
    """One record could not be labelled (names the record id and the culprit: adapter path, subset, ...)."""
