import pytest

from distill_recipes import perturbed_copy, sharp_teacher


@pytest.fixture
def models(tmp_path):
    """(teacher dir, student dir): a sharp tiny llama and a noisy copy of it."""
    teacher = sharp_teacher(tmp_path / "teacher")
    return teacher, perturbed_copy(teacher, tmp_path / "student")
