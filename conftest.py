"""Settings for every test directory under the repository (``tests/``, the ``testpaths`` in pyproject.toml):
nothing is downloaded from a model hub, and the library's INFO logs are captured.
Fixtures for the library's tests are in tests/conftest.py, shared helpers in tests/helpers.py."""

import logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.INFO, logger="fcprag_plugin")
    yield
