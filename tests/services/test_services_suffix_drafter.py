"""One suffix drafter service behind two gateways (real processes on loopback): a request through
gateway B whose answer gateway A already produced is drafted from A's output (acceptance >= 0.8
per drafted token), while a live request's tokens are never shared; with --suffix-share none
nothing is."""
from __future__ import annotations

import pytest

from tests.services.procs import HOST, DRAFTER_JOINS, SPECULATE_ALWAYS, TINY_ENGINE, ServiceProcess, free_port, generate, request

K = ("--num-speculative-tokens", "6")
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]
MAX_TOKENS = 40


def _stack(log_dir, target, share: str) -> dict[str, ServiceProcess]:
    """A verifier, one suffix drafter, two gateways in front of both."""
    vport, dport = free_port(), free_port()
    procs = {
        "verifier": ServiceProcess("verifier", ["verifier", "--model", str(target), "--port", str(vport), *TINY_ENGINE, *K],
                                   log_dir, vport, free_port()),
        "drafter": ServiceProcess("drafter", ["drafter", "--model", "suffix", "--port", str(dport), *TINY_ENGINE, *K,
                                              "--suffix-share", share], log_dir, dport, free_port()),
    }
    for name in ("gateway-a", "gateway-b"):
        gport = free_port()
        procs[name] = ServiceProcess(name, ["gateway", "--verifier", f"{HOST}:{vport}", "--drafter", f"{HOST}:{dport}",
                                            "--port", str(gport), "--no-async-draft", *DRAFTER_JOINS, *SPECULATE_ALWAYS, *K],
                                     log_dir, gport, free_port())
    return procs


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tiny_llama):
    out = {share: _stack(tmp_path_factory.mktemp(f"suffix-{share}"), tiny_llama, share) for share in ("finished", "none")}
    try:
        for procs in out.values():
            for p in procs.values():
                p.wait_serving(240)
        yield out
    finally:
        for procs in out.values():
            for name in ("gateway-a", "gateway-b", "drafter", "verifier"):
                procs[name].stop()


def _run(procs, gateway: str) -> dict:
    return generate(procs[gateway].address, request(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True))


def test_gateway_b_drafts_from_what_gateway_a_answered(stacks):
    procs = stacks["finished"]
    a = _run(procs, "gateway-a")
    b = _run(procs, "gateway-b")
    assert b["token_ids"] == a["token_ids"] and len(b["token_ids"]) == MAX_TOKENS
    ua, ub = a["usage"], b["usage"]
    # A drafted only from its own prompt and output (a tiny random model repeats itself: some);
    # B from A's finished answer as well
    assert ub["accepted_draft_tokens"] >= 0.8 * ub["proposed_draft_tokens"] > 0
    assert ub["accepted_draft_tokens"] > ua["accepted_draft_tokens"] + MAX_TOKENS // 4
    assert b["messages"] < a["messages"]  # fewer steps


def test_share_none_keeps_every_lookup_inside_its_request(stacks):
    procs = stacks["none"]
    a = _run(procs, "gateway-a")
    b = _run(procs, "gateway-b")
    assert b["token_ids"] == a["token_ids"]
    # the same request drafted alike both times: nothing learned from A
    assert b["usage"]["accepted_draft_tokens"] == a["usage"]["accepted_draft_tokens"]
