"""Fixtures the storage tests share."""

import pytest

from tpu_ckpt.settings import configure
from tpu_ckpt.storage import _retries


@pytest.fixture
def small_budget(monkeypatch) -> float:
    """A 5 s object-store retry budget, set the way a job outside the library sets it (the
    environment variable); afterwards no bucket is left counted as dead (``_retries``), so
    the next test's bucket of the same name is alive. Yields the budget in seconds."""
    budget_s = 5.0
    monkeypatch.setenv("TPU_CKPT_OBJECT_RETRY_SECONDS", str(budget_s))
    previous = configure(None)
    yield budget_s
    configure(previous)
    _retries._dead_until.clear()
