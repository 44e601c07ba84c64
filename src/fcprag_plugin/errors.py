"""Exception types. Every message names the culprit (file, key, module, line) and what was expected."""

from __future__ import annotations

from typing import Any, Sequence

BARE = ...  # the value of a keyword a message names without one (``retrieval_scores=``)


def kw(name: str, value: Any = BARE) -> str:
    """How a message spells keyword argument ``name``: ``name=repr(value)``, or ``name=`` for :data:`BARE`."""
    return f"{name}=" if value is BARE else f"{name}={value!r}"


class FcpragError(Exception):
    """Base class of every error raised by fcprag_plugin. ``params``: the keyword arguments the message names, as
    ``(name, value)`` pairs each spelled :func:`kw` ``(name, value)`` in it, so that a front end can name its own
    options instead (the ``fcprag`` command says its flags)."""

    def __init__(self, message: str = "", *, params: Sequence[tuple[str, Any]] = ()) -> None:
        super().__init__(message)
        self.params = tuple(params)


class AdapterError(FcpragError, ValueError):
    """A LoRA adapter could not be loaded or is invalid (names the file and key)."""


class UnsupportedAdapterError(AdapterError):
    """The adapter uses a LoRA variant this library does not merge (DoRA, LoRA bias, embedding LoRA)."""


class MergeError(FcpragError, ValueError):
    """Adapters or weights cannot be merged (names the module / adapter and both shapes)."""


class ControllerError(FcpragError, ValueError):
    """A controller directory or its inputs are invalid."""


class EncoderError(FcpragError, RuntimeError):
    """The text encoder could not be loaded or used."""


class FusionInputError(FcpragError, ValueError):
    """Bad arguments to fuse(): lengths, empty lists or strings."""


class LabelFileError(FcpragError, ValueError):
    """A label file record is invalid (names the file, the line and the field)."""


class HookError(FcpragError, RuntimeError):
    """An integration shim could not do its job (missing context, unloaded adapter, ...)."""
