"""`specsplit up` end to end on the tiny target + the n-gram drafter: three real processes come up
SERVING, `specsplit generate --server` streams the same JSON as the local mode, SIGTERM stops all."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.services.procs import REPO, TINY_ENGINE, free_port, health, server_info

# A fixed K: these compare usage (drafts proposed/accepted) across processes, and the K policy's
# per-step choice rests on each process's own timings (tests/unit/test_k_policy.py tests it).
FIXED_K = [*TINY_ENGINE, "--k-policy", "fixed"]

PROMPT_IDS = "5,9,13,5,9,13,5,9"


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_llama):
    from specsplit.gateway.launch import specsplit_up

    log = tmp_path_factory.mktemp("up-logs") / "up.log"
    env = dict(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with specsplit_up(str(tiny_llama), "ngram", max_num_seqs=4, extra=FIXED_K, log=log, env=env, cwd=REPO,
                      log_level="INFO", startup_timeout=240) as stack:
        yield stack.proc, stack.addresses, str(log)


def _cli_json(capsys, argv) -> dict:
    from specsplit.cli import main

    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# What the gateway logs when a drafter call misses its deadline (gateway/peer_clients.py): that
# stretch decodes target-only, so its drafts are fewer than a local run's (the tokens are the same).
MISSED_DEADLINE = "no answer within"


def _remote_json(capsys, log: str, argv) -> tuple[dict, bool]:
    """A `generate --server` run's JSON, and whether the drafter has missed a deadline since the
    stack started (a loaded CI machine can keep the drafter process off a core past the 50 ms
    floor). After a miss the gateway decodes target-only until a probe finds the drafter back, a
    second or more later: a later request can run without drafts, so any miss so far counts."""
    out = _cli_json(capsys, argv)
    return out, MISSED_DEADLINE in open(log).read()


def _equals_local(remote: dict, missed: bool, local: dict) -> None:
    """The same JSON; after a missed deadline, the same tokens and text with no more drafts."""
    if not missed:
        assert remote == local
        return
    assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]
    assert remote["usage"]["proposed_draft_tokens"] <= local["usage"]["proposed_draft_tokens"]


def test_up_generate_server_json_equals_local(up, capsys, tiny_llama):
    proc, addresses, log = up
    info = server_info(addresses["gateway"])
    assert info.mode == "split" and info.draft_model == "ngram" and info.num_speculative_tokens == 4
    common = ["--prompt-token-ids", PROMPT_IDS, "--max-tokens", "24", "--ignore-eos", "--json"]
    # The split gateway pre-drafts by default; so does the local run here, so the drafts (usage)
    # match too (the tokens match either way).
    remote, missed = _remote_json(capsys, log, ["generate", "--server", addresses["gateway"], *common])
    local = _cli_json(capsys, ["generate", "--target", str(tiny_llama), "--draft", "ngram", *common, *FIXED_K,
                               "--async-draft"])
    _equals_local(remote, missed, local)
    assert local["usage"]["proposed_draft_tokens"] > 0  # the repeating prompt gives n-gram drafts
    text_remote = _cli_json(capsys, ["generate", "--server", addresses["gateway"], "w5 w9 w13", "--max-tokens", "8", "--json"])
    text_local = _cli_json(capsys, ["generate", "--target", str(tiny_llama), "w5 w9 w13", "--max-tokens", "8", "--json",
                                    *FIXED_K])
    assert text_remote["token_ids"] == text_local["token_ids"] and text_remote["text"] == text_local["text"]
    # Seeded sampling: the server takes the shortest decimal of the API's float32 values, as local does.
    sampled = [*common, "--temperature", "0.7", "--top-p", "0.9", "--seed", "5"]
    remote_sampled, missed = _remote_json(capsys, log, ["generate", "--server", addresses["gateway"], *sampled])
    _equals_local(remote_sampled, missed,
                  _cli_json(capsys, ["generate", "--target", str(tiny_llama), "--draft", "ngram", *sampled, *FIXED_K,
                                     "--async-draft"]))
    lockstep = _cli_json(capsys, ["generate", "--target", str(tiny_llama), "--draft", "ngram", *common, *FIXED_K])
    assert lockstep["token_ids"] == remote["token_ids"]


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


def _log_pids(log: str, name: str) -> list[int]:
    """The pids `up` printed for `name` ("started drafter (pid N)", "restarted drafter (pid N)")."""
    return [int(m) for m in re.findall(rf"started {name} \(pid (\d+)\)", open(log).read())]


def test_a_drafter_that_dies_is_started_again(up, capsys, tiny_llama):
    """SIGKILL the drafter: the gateway decodes on (the same tokens, target-only), `up` starts a
    new drafter on the same port within seconds, the gateway finds it and drafts again; the
    verifier and the gateway stay up. (Until the twenty-fifth session a dead drafter stopped all
    three.)"""
    proc, addresses, log = up
    old = _log_pids(log, "drafter")[-1]
    common = ["--prompt-token-ids", PROMPT_IDS, "--max-tokens", "24", "--ignore-eos", "--json"]
    local = _cli_json(capsys, ["generate", "--target", str(tiny_llama), "--draft", "ngram", *common, *FIXED_K])
    os.kill(old, signal.SIGKILL)
    down = _cli_json(capsys, ["generate", "--server", addresses["gateway"], *common])
    assert down["token_ids"] == local["token_ids"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (len(_log_pids(log, "drafter")) > 1
                                               and health(addresses["drafter"], timeout=0.5) == "SERVING"):
        assert proc.poll() is None, open(log).read()[-3000:]
        time.sleep(0.5)
    assert _log_pids(log, "drafter")[-1] != old and "drafter exited with code -9" in open(log).read()
    assert health(addresses["drafter"], timeout=2) == "SERVING"  # on the port it had: the gateway's address
    proposed = 0
    while time.monotonic() < deadline and not proposed:  # the gateway's probe finds it (every second)
        back = _cli_json(capsys, ["generate", "--server", addresses["gateway"], *common])
        assert back["token_ids"] == local["token_ids"]
        proposed = back["usage"]["proposed_draft_tokens"]
        time.sleep(0.5)
    assert proposed > 0, open(log).read()[-3000:]
    assert proc.poll() is None and health(addresses["verifier"]) == "SERVING"


def test_sigterm_stops_all_three(up):
    """Last: stops the stack."""
    proc, addresses, log = up
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, open(log).read()[-3000:]
    for a in addresses.values():
        assert health(a, timeout=0.5).startswith("UNREACHABLE")


def test_up_draft_none_runs_verifier_and_gateway(tmp_path, capsys, tiny_llama):
    """`up --draft none`: two processes, a split target-only stack (K 0, no drafts), the tokens of a
    local target-only run; SIGTERM stops both."""
    from specsplit.gateway.launch import specsplit_up

    log = tmp_path / "up.log"
    env = dict(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with specsplit_up(str(tiny_llama), "none", max_num_seqs=4, extra=TINY_ENGINE, log=log, env=env, cwd=REPO,
                      log_level="INFO", startup_timeout=240) as stack:
        assert stack.drafter is None and set(stack.addresses) == {"gateway", "verifier"}
        info = server_info(stack.address)
        assert info.mode == "split" and info.num_speculative_tokens == 0
        common = ["--prompt-token-ids", PROMPT_IDS, "--max-tokens", "16", "--ignore-eos", "--json"]
        remote = _cli_json(capsys, ["generate", "--server", stack.address, *common])
        local = _cli_json(capsys, ["generate", "--target", str(tiny_llama), "--draft", "none", *common, *TINY_ENGINE])
        assert remote["token_ids"] == local["token_ids"] and remote["usage"]["proposed_draft_tokens"] == 0
        assert len(_log_pids(str(log), "verifier")) == 1 and not _log_pids(str(log), "drafter")
        proc = stack.proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, stack.log_tail()
    assert "started drafter" not in log.read_text()
