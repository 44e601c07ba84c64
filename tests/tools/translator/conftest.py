import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine two threads spin-wait each other
    (a translator training step took 30x longer with 2 than with 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
