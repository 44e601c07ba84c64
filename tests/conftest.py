import pytest

from helpers import hash_encoder, make_adapter_dir


@pytest.fixture
def adapter_dirs(tmp_path):
    """Three real PEFT adapters (r=2, alpha=32, gate/up/down_proj) for the tiny Llama."""
    return [make_adapter_dir(tmp_path / f"passage_{i}", seed=i) for i in range(3)]


@pytest.fixture
def encoder16():
    return hash_encoder(16)
