"""SmolLM2-135M + the n-gram drafter: split (`specsplit up`, 3 processes) == colocated (`specsplit
serve`) == the target alone, greedy, one stream at a time and 3 concurrent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.services.procs import REPO, ServiceProcess, free_port, generate, health, request

pytestmark = [pytest.mark.smollm, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of the planets in the solar system: Mercury, Venus,",
]
NEW = 32
ENGINE = ["--max-model-len", "256", "--max-prefill-tokens", "128", "--max-num-seqs", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("smollm-logs")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    up_log = open(logs / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "up", "--target", "smollm2-135m", "--draft", "ngram",
                           "--port", str(port), *ENGINE], stdout=up_log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    cport = free_port()
    colocated = ServiceProcess("colocated", ["serve", "--target", "smollm2-135m", "--draft", "ngram", "--port", str(cport),
                                             *ENGINE], logs, cport)
    split_addr = f"127.0.0.1:{port}"
    try:
        colocated.wait_serving(300)
        end = time.monotonic() + 300
        while health(split_addr) != "SERVING":
            assert up.poll() is None, open(up_log.name).read()[-3000:]
            assert time.monotonic() < end
            time.sleep(0.5)
        yield split_addr, colocated.address
    finally:
        colocated.stop()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(10)
        up_log.close()


@pytest.fixture(scope="module")
def target_only():
    from specsplit.config import EngineConfig, SpecConfig
    from specsplit.factory import build_colocated
    from specsplit.generation import GenerationRequest, Generator

    colo = build_colocated(EngineConfig(model="smollm2-135m", max_model_len=256, max_prefill_tokens=128, max_num_seqs=1),
                           None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    out = {}
    for p in PROMPTS:
        ids = tuple(colo.tokenizer(p).input_ids)
        (state,) = Generator(colo.decoder, colo.eos_token_ids, 1).run([GenerationRequest("r", ids, NEW, ignore_eos=True)])
        out[p] = (state.output, colo.tokenizer.decode(state.output))
    colo.close()
    return out


@pytest.mark.parametrize("concurrency", [1, 3])
def test_smollm_split_equals_colocated_equals_target(servers, target_only, concurrency):
    split_addr, colo_addr = servers
    reqs = [request(prompt=p, max_tokens=NEW, ignore_eos=True) for p in PROMPTS]
    with ThreadPoolExecutor(concurrency) as pool:
        split = list(pool.map(lambda r: generate(split_addr, r, timeout=120), reqs))
        colo = list(pool.map(lambda r: generate(colo_addr, r, timeout=120), reqs))
    for p, s, c in zip(PROMPTS, split, colo):
        ids, text = target_only[p]
        assert s["token_ids"] == ids, p
        assert c["token_ids"] == ids, p
        assert s["text"] == c["text"] == text
    assert sum(s["usage"]["proposed_draft_tokens"] for s in split) > 0
