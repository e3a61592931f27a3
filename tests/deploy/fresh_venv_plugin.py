"""The pytest hooks of the process that owns the fresh-venv install (tests/deploy/fresh_venv.py).

Under pytest-xdist that is the controller: it collects nothing (so tests/deploy/conftest.py's
collection hook never runs there), but it hears each worker's selected tests, and it names the
install's folder to each worker before the worker starts. Without xdist it is the only process.

tests/conftest.py registers this plugin in every process (under `make test`, testpaths = tests,
the xdist controller loads that conftest but not tests/deploy's), and tests/deploy/conftest.py
does where only it is loaded.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.fresh_venv import Install

FRESH_VENV_TEST = "test_install_fresh_venv.py::test_wheel_installs_beside_newest_transformers_and_kernels"
FRESH_VENV = pytest.StashKey[Install]()  # the install this process owns (started, or only reserved)
WORKERINPUT_KEY = "specsplit_fresh_venv"  # the controller's install folder, in each worker's workerinput
REPO = Path(__file__).resolve().parents[2]
# Nice 19: the install runs on the CPU the tests leave idle (a worker waiting on a service, a sleep,
# a timeout) and slows none of them; where that was not enough, the test hurries what is left to
# nice 0 when it starts waiting (fresh_venv.Install.hurry), with its own worker's core then free.
INSTALL_NICE = 19


def selected(nodeids) -> bool:
    return any(nodeid.endswith(FRESH_VENV_TEST) for nodeid in nodeids)


def owned(config: pytest.Config) -> Install:
    """This process's install: reserved (a folder, nothing started) on first use."""
    if FRESH_VENV not in config.stash:
        config.stash[FRESH_VENV] = Install.reserve()
    return config.stash[FRESH_VENV]


def start_once(config: pytest.Config, nice: int) -> Install:
    install = owned(config)
    if install.proc is None:
        install.start(REPO, nice=nice)
    return install


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller, before a worker starts: the folder the install will use, so the worker that
    runs the test knows where to wait (a worker restarted after a crash gets the same one)."""
    node.workerinput[WORKERINPUT_KEY] = str(owned(node.config).root)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: a worker's tests after -k / -m deselection. The first collection that holds
    the fresh-venv test starts the install (all workers collect the same tests, before any runs)."""
    if selected(ids):
        start_once(node.config, nice=INSTALL_NICE)


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py looks for processes that outlived the suite
def pytest_sessionfinish(session, exitstatus):
    install = session.config.stash.get(FRESH_VENV, None)
    if install is not None:
        install.close()
