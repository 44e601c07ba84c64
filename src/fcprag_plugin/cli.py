"""Deprecated: the ``fcprag`` command is now :mod:`fcprag_tools.cli` (``python -m fcprag_tools.cli``)."""

import sys

from fcprag_tools.cli import main  # noqa: F401

if __name__ == "__main__":
    from ._deprecated import alias

    alias("fcprag_plugin.cli", "fcprag_tools.cli")
    sys.exit(main())
