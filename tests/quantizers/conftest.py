import pytest


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """These tests are many small ops (see tests/conftest.py::one_thread)."""
