"""These tests build no engines: collect garbage once per module, not after every test.

(tests/conftest.py's per-test gc.collect() costs ~0.4 s each with torch, triton and transformers
imported, which would more than double this directory's runtime.)
"""
import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_garbage():  # overrides the per-test fixture of tests/conftest.py
    yield


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_per_module():
    yield
    gc.collect()
