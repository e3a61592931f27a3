"""`specsplit up` end to end on the tiny target + the n-gram drafter: three real processes come up
SERVING, `specsplit generate --server` streams the same JSON as the local mode, SIGTERM stops all."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.services.procs import REPO, TINY_ENGINE, free_port, health, server_info

PROMPT_IDS = "5,9,13,5,9,13,5,9"


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_llama):
    port, dport, vport = free_port(), free_port(), free_port()
    log = open(tmp_path_factory.mktemp("up-logs") / "up.log", "wb")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specsplit.cli", "up", "--target", str(tiny_llama), "--draft", "ngram", "--port", str(port),
         "--drafter-port", str(dport), "--verifier-port", str(vport), "--max-num-seqs", "4", *TINY_ENGINE],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env,
    )
    addresses = {n: f"127.0.0.1:{p}" for n, p in (("gateway", port), ("drafter", dport), ("verifier", vport))}
    try:
        end = time.monotonic() + 240
        while not all(health(a) == "SERVING" for a in addresses.values()):
            assert proc.poll() is None, open(log.name).read()[-3000:]
            assert time.monotonic() < end, "specsplit up did not come up"
            time.sleep(0.5)
        yield proc, addresses, log.name
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def _cli_json(capsys, argv) -> dict:
    from specsplit.cli import main

    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_up_generate_server_json_equals_local(up, capsys, tiny_llama):
    proc, addresses, _ = up
    info = server_info(addresses["gateway"])
    assert info.mode == "split" and info.draft_model == "ngram" and info.num_speculative_tokens == 4
    common = ["--prompt-token-ids", PROMPT_IDS, "--max-tokens", "24", "--ignore-eos", "--json"]
    remote = _cli_json(capsys, ["generate", "--server", addresses["gateway"], *common])
    local = _cli_json(capsys, ["generate", "--target", str(tiny_llama), "--draft", "ngram", *common, *TINY_ENGINE])
    assert remote == local
    assert remote["usage"]["proposed_draft_tokens"] > 0  # the repeating prompt gives n-gram drafts
    text_remote = _cli_json(capsys, ["generate", "--server", addresses["gateway"], "w5 w9 w13", "--max-tokens", "8", "--json"])
    text_local = _cli_json(capsys, ["generate", "--target", str(tiny_llama), "w5 w9 w13", "--max-tokens", "8", "--json",
                                    *TINY_ENGINE])
    assert text_remote["token_ids"] == text_local["token_ids"] and text_remote["text"] == text_local["text"]
    # Seeded sampling: the server takes the shortest decimal of the API's float32 values, as local does.
    sampled = [*common, "--temperature", "0.7", "--top-p", "0.9", "--seed", "5"]
    assert _cli_json(capsys, ["generate", "--server", addresses["gateway"], *sampled]) == \
        _cli_json(capsys, ["generate", "--target", str(tiny_llama), "--draft", "ngram", *sampled, *TINY_ENGINE])


def test_generate_server_streams_text(up, capsys):
    from specsplit.cli import main

    _, addresses, _ = up
    capsys.readouterr()
    assert main(["generate", "--server", addresses["gateway"], "w5 w9 w13", "--max-tokens", "6", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert len(out.out.split()) == 6 and "tok/s" in out.err
    # An invalid request is reported with its status, exit 1.
    assert main(["generate", "--server", addresses["gateway"], "--prompt-token-ids", "5,999", "--max-tokens", "2"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_health_cli(up):
    _, addresses, _ = up
    from specsplit.cli import main

    assert main(["health", addresses["gateway"]]) == 0
    assert main(["health", f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1


def test_sigterm_stops_all_three(up):
    """Last: stops the stack."""
    proc, addresses, log = up
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, open(log).read()[-3000:]
    for a in addresses.values():
        assert health(a, timeout=0.5).startswith("UNREACHABLE")
