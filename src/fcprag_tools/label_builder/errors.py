"""The label builder's error type: a record that could not be labelled."""

from __future__ import annotations

from fcprag_plugin.errors import FcpragError


class LabelBuildError(FcpragError, RuntimeError):
    """One record could not be labelled (names the record id and the culprit: adapter path, subset, ...)."""
