"""Deployment tests read files and parse command lines: they hold no engines or tensors."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _collect_garbage():
    """Overrides tests/conftest.py's per-test gc.collect() (about 0.5 s each once torch is loaded)."""
    yield


# ---- the fresh-venv install runs in the background (tests/deploy/fresh_venv.py) -----------------
FRESH_VENV_TEST = "test_install_fresh_venv.py::test_wheel_installs_beside_newest_transformers_and_kernels"
FRESH_VENV = pytest.StashKey()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only a test that will run starts it
def pytest_collection_modifyitems(session, config, items):
    """Where the fresh-venv test is selected: start its install now, in the background at the
    lowest priority, and run the test last (by then the install is done or nearly)."""
    picked = [it for it in items if it.nodeid.endswith(FRESH_VENV_TEST)]
    if not picked or config.option.collectonly or hasattr(config, "workerinput"):
        return  # under pytest-xdist every worker collects every test: the fixture starts it where it runs
    from tests.deploy import fresh_venv

    items[:] = [it for it in items if it not in picked] + picked
    config.stash[FRESH_VENV] = fresh_venv.start(Path(__file__).resolve().parents[2])


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py looks for processes that outlived the suite
def pytest_sessionfinish(session, exitstatus):
    install = session.config.stash.get(FRESH_VENV, None)
    if install is not None:
        install.close()


@pytest.fixture
def fresh_venv_install(request):
    """The background install (started here, not niced, where the collection hook did not start one)."""
    from tests.deploy import fresh_venv

    install = request.config.stash.get(FRESH_VENV, None)
    if install is None:
        install = fresh_venv.start(Path(__file__).resolve().parents[2], nice=False)
        request.config.stash[FRESH_VENV] = install
    return install
