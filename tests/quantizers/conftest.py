import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests are many small ops: one thread is faster on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


