"""Deployment tests read files and parse command lines: they hold no engines or tensors. Below: the
hooks of the fresh-venv install that runs in the background (tests/deploy/fresh_venv.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy import fresh_venv_plugin
from tests.deploy.fresh_venv import Install
from tests.deploy.fresh_venv_plugin import FRESH_VENV_TEST, WORKERINPUT_KEY


@pytest.fixture(autouse=True)
def _collect_garbage():
    """Overrides tests/conftest.py's per-test gc.collect() (about 0.5 s each once torch is loaded)."""
    yield


# ---- the fresh-venv install runs in the background (tests/deploy/fresh_venv.py) -----------------
# Its test runs last and waits only for what is left of it (hurried to nice 0 then). Who starts it,
# at nice 19, once the session knows the test is selected:
# - one process (no xdist, `-n 0`): the collection hook below;
# - under xdist: the controller (fresh_venv_plugin), when a worker's collection holds the test; every
#   worker puts the test last and the one that runs it waits in the folder the controller named;
# - under xdist where the controller does not load fresh_venv_plugin (see its docstring): the
#   fixture, where and when the test runs, at nice 0 (its worker has nothing else to do meanwhile),
#   and the test keeps its place (last, it would leave all of the install to the end of the session).


def pytest_configure(config):
    """The install owner's hooks, in each process that loads this conftest (unless
    tests/conftest.py already named them)."""
    if not config.pluginmanager.is_registered(fresh_venv_plugin):
        config.pluginmanager.register(fresh_venv_plugin, "specsplit-fresh-venv")


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only a test that will run starts it
def pytest_collection_modifyitems(session, config, items):
    """Where the fresh-venv test is selected, it runs last (by then its install is done or nearly):
    the same order in every xdist worker, so their collections agree, and --dist loadfile hands its
    file out last (its one test keeps it last when xdist orders files by their number of tests).
    Without xdist its install starts here."""
    picked = [it for it in items if it.nodeid.endswith(FRESH_VENV_TEST)]
    workerinput = getattr(config, "workerinput", None)
    if not picked or (workerinput is not None and WORKERINPUT_KEY not in workerinput):
        return  # no install from the controller: the fixture's starts with the test, which keeps its place
    items[:] = [it for it in items if it not in picked] + picked
    if workerinput is None and not config.option.collectonly:
        fresh_venv_plugin.start_once(config, nice=fresh_venv_plugin.INSTALL_NICE)


@pytest.fixture
def fresh_venv_install(request) -> Install:
    """The background install: the controller's under xdist (this worker only waits for it), the
    one this process started at collection, or else one started here and now."""
    root = getattr(request.config, "workerinput", {}).get(WORKERINPUT_KEY)
    if root is not None:
        return Install(Path(root))
    return fresh_venv_plugin.start_once(request.config, nice=0)
