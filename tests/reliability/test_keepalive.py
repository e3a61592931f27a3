"""Keepalive on an idle connection: the gateways ping their peers every second
(--keepalive-time 1) for ~15 s with no call in flight, and no side sends or receives a GOAWAY
`too_many_pings` (the servers accept a ping every MIN_PING_INTERVAL_S without data); the
Session streams opened before the pause are still the ones in use after it."""
from __future__ import annotations

import time

from specsplit.rpc.security import ClientSecurity, channel
from specsplit.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2_grpc, verifier_pb2_grpc
from tests.services.procs import request

IDLE_S = 15.0
BAD = ("too_many_pings", "GOAWAY", "ENHANCE_YOUR_CALM")


def _sessions(stack, sec) -> dict[str, int]:
    out = {}
    for name, stub_cls in (("verifier", verifier_pb2_grpc.VerifierStub), ("drafter", drafter_pb2_grpc.DrafterStub)):
        with channel(stack[name].address, sec) as ch:
            out[name] = stub_cls(ch).GetInfo(common_pb2.InfoRequest(), timeout=5).num_sessions
    return out


def _generate_ok(stack, sec, ids) -> bool:
    with channel(stack.gateway, sec) as ch:
        last = list(gateway_pb2_grpc.GatewayStub(ch).Generate(request(ids, max_tokens=4, ignore_eos=True), timeout=30))[-1]
    return last.finish_reason == "length"


def test_idle_connections_see_no_goaway(plain_stack, secure_stack, pki, prompts):
    pki, token = pki
    stacks = {"plain": (plain_stack, ClientSecurity()),
              "secure": (secure_stack, ClientSecurity(str(pki.ca), str(pki.client_cert), str(pki.client_key), str(token)))}
    for stack, sec in stacks.values():
        assert _generate_ok(stack, sec, prompts[2])  # the Session streams are open
    before = {k: _sessions(s, sec) for k, (s, sec) in stacks.items()}
    offsets = {(k, n): p.log_path.stat().st_size for k, (s, _) in stacks.items() for n, p in s.procs.items()}
    time.sleep(IDLE_S)
    found = []
    for (k, n), off in offsets.items():
        with open(stacks[k][0].procs[n].log_path, "rb") as f:
            f.seek(off)
            new = f.read().decode(errors="replace")
        found += [f"{k}/{n}: {line}" for line in new.splitlines() if any(b in line for b in BAD)]
        found += [f"{k}/{n}: {line}" for line in new.splitlines() if "session" in line and "closed" in line]
    for stack, sec in stacks.values():
        assert _generate_ok(stack, sec, prompts[3])
    after = {k: _sessions(s, sec) for k, (s, sec) in stacks.items()}
    print(f"FIGURE keepalive idle: {IDLE_S:.0f}s idle at 1 ping/s, {len(found)} GOAWAY/too_many_pings/closed-session "
          f"lines; sessions before {before} after {after}")
    assert not found, "\n".join(found)
    assert before == after
