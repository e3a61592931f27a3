"""Deployment tests read files and parse command lines: they hold no engines or tensors."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _collect_garbage():
    """Overrides tests/conftest.py's per-test gc.collect() (about 0.5 s each once torch is loaded)."""
    yield
