"""A gateway that starts before its drafter answers (compose starting everything at once): it
serves target-only, says so (ServerInfo.drafter_up false, a log line), and speculates once the
drafter answers, without a failed drafter call first. Real processes: the shared split stack's
verifier, a second gateway, a drafter started after it on the port it was told."""
from __future__ import annotations

import time

from tests.services.procs import HOST, SPECULATE_ALWAYS, TINY_ENGINE, ServiceProcess, free_port, generate, request, \
    server_info


def test_a_gateway_started_before_its_drafter_speculates_once_it_answers(split_stack, tiny_draft_close, tmp_path,
                                                                        expect_greedy):
    dport, gport = free_port(), free_port()
    gw = ServiceProcess("gateway-early", ["gateway", "--verifier", split_stack["verifier"].address,
                                          "--drafter", f"{HOST}:{dport}", "--port", str(gport), "--max-num-seqs", "4",
                                          "--drafter-timeout", "2", "--drafter-connect-timeout", "0.5",
                                          *SPECULATE_ALWAYS], tmp_path, gport)
    drafter = None
    try:
        gw.wait_serving()
        assert "not reachable yet" in gw.log_tail(100)
        assert not server_info(gw.address).drafter_up  # before: "up" until a call failed
        prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
        out = generate(gw.address, request(prompt, max_tokens=8, ignore_eos=True))  # target-only meanwhile
        expect_greedy(prompt, out["token_ids"], 8, ignore_eos=True)
        assert out["usage"].get("proposed_draft_tokens", 0) == 0

        drafter = ServiceProcess("drafter-late", ["drafter", "--model", str(tiny_draft_close), "--port", str(dport),
                                                  "--max-num-seqs", "4", *TINY_ENGINE], tmp_path, dport)
        drafter.wait_serving()
        proposed, end = 0, time.monotonic() + 60  # it re-probes every second: it joins within a few requests
        while proposed == 0 and time.monotonic() < end:
            out = generate(gw.address, request(prompt, max_tokens=24, ignore_eos=True))
            expect_greedy(prompt, out["token_ids"], 24, ignore_eos=True)
            proposed = out["usage"].get("proposed_draft_tokens", 0)
        assert proposed > 0, gw.log_tail(100)
        assert server_info(gw.address).drafter_up
        assert "drafter is back" in gw.log_tail(200)
    finally:
        gw.stop()
        if drafter is not None:
            drafter.stop()
