"""Shared fixtures: tiny random checkpoints (session-scoped, written once) and engine cleanup."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from tests.helpers.tiny_models import write_tiny_model

# Keep each test process to the cores CI has; many tests start several processes.
torch.set_num_threads(int(os.environ.get("SPECSPLIT_TEST_THREADS", "1")))
# The CPU kernel choice by row count without timing (specsplit/models/cpu_linear.py): the same in
# every test process and every service it starts, so no comparison depends on load-time timings.
# tests/unit/models/test_cpu_linear.py tests the timed policy itself.
os.environ.setdefault("SPECSPLIT_LINEAR_KERNEL", "static")


def pytest_configure(config):
    """The fresh-venv install's owner hooks (tests/deploy/fresh_venv_plugin.py) in every process:
    under `make test` the xdist controller loads this conftest and not tests/deploy's."""
    from tests.deploy import fresh_venv_plugin

    if not config.pluginmanager.is_registered(fresh_venv_plugin):
        config.pluginmanager.register(fresh_venv_plugin, "specsplit-fresh-venv")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def hf_target(tiny_llama):
    """tiny_llama as a transformers model (fp32, eval): the reference for logprobs and greedy ties."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_logits(hf_target):
    """tiny_llama's next-token logits after a context (transformers, fp32): what certifies a greedy
    difference as a near-tie (tests/helpers/greedy.py)."""
    from tests.helpers.greedy import hf_next_logits

    return hf_next_logits(hf_target)


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory, tiny_llama):
    """An EAGLE-3 head for tiny_llama in the public checkpoint format, over a draft vocabulary
    subset (tokens 3..199 of 256); its config names tiny_llama as `specsplit_base_model`, so a
    drafter service (not colocated) reads the target's embedding, tokenizer and config there."""
    from tests.helpers.eagle3 import write_tiny_head

    return write_tiny_head(tmp_path_factory.mktemp("tiny-eagle3"), torch.arange(3, 200),
                           extra_json={"specsplit_base_model": str(tiny_llama)})


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=1, sliding_window=None)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_draft_close(tmp_path_factory, tiny_llama):
    """A draft that agrees with tiny_llama often: a slightly perturbed copy."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft-close"), perturb_from=tiny_llama, perturb_scale=0.05)


@pytest.fixture(scope="session")
def tiny_draft_far(tmp_path_factory):
    """A draft that rarely agrees with tiny_llama: an unrelated random model, same vocab."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft-far"), "llama", seed=7, num_hidden_layers=1)


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage():
    """Free engines (and their KV caches) a module left behind; per test it costs ~0.4 s."""
    yield
    gc.collect()


# ---- no process outlives the suite ---------------------------------------------------------------
# Processes the interpreter itself keeps for its life (multiprocessing's resource tracker), not a test's.
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.semaphore_tracker",
                        "multiprocessing.forkserver")


def _descendants() -> list:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or any(h in " ".join(p.cmdline()) for h in _INTERPRETER_HELPERS):
                continue
            out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


_LEAKED = pytest.StashKey[list]()  # under pytest-xdist, the controller: what each worker found


def _stop_leftovers() -> list[str]:
    """Processes this one started that still run (a moment's grace for those told to stop),
    killed; one line each."""
    import time

    import psutil

    end = time.monotonic() + 10.0
    left = _descendants()
    while left and time.monotonic() < end:  # a process told to stop may take a moment
        time.sleep(0.2)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    lines = []
    for p in left:
        try:
            lines.append(f"  pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return lines


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist (make test runs workers): a worker's leftovers reach the controller here."""
    leaked = getattr(node, "workeroutput", {}).get("leaked_processes")
    if leaked:
        node.config.stash.setdefault(_LEAKED, []).extend(leaked)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process a test started (a service, a worker, a CLI) is still running
    after every fixture has been torn down; kill it so it cannot hold ports or memory. An xdist
    worker hands what it found to the controller, which fails the run."""
    lines = _stop_leftovers()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["leaked_processes"] = lines
        return
    lines += session.config.stash.get(_LEAKED, [])
    if not lines:
        return
    session.config.get_terminal_writer().line(
        "\nprocesses started by tests outlived the suite (killed now):\n" + "\n".join(lines), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
