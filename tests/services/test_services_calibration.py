"""Start-up calibration over gRPC: the engines report their step costs in GetInfo, a gateway with
the K policy reads them, adds the measured round trip and reports all of it in GetServerInfo; its
greedy tokens equal the fixed-K gateway's on the same engines."""
from __future__ import annotations

from specsplit.gateway.bench_client import gateway_stub, policy_costs
from tests.services.procs import HOST, ServiceProcess, free_port, generate, request, server_info, service_info


def test_engines_report_step_costs_and_the_policy_gateway_uses_them(split_stack, tmp_path):
    v_addr, d_addr = split_stack["verifier"].address, split_stack["drafter"].address
    vinfo, dinfo = service_info(v_addr, "verifier"), service_info(d_addr, "drafter")
    k = vinfo.num_speculative_tokens
    assert {(c.batch, c.rows) for c in vinfo.step_costs} >= {(1, r) for r in range(1, k + 2)}
    assert all(c.seconds > 0 for c in vinfo.step_costs)
    assert dinfo.step_costs and all(c.rows == 1 and c.seconds > 0 for c in dinfo.step_costs)

    port = free_port()
    gw = ServiceProcess("gateway-policy", ["gateway", "--verifier", f"{HOST}:{v_addr.rsplit(':', 1)[1]}",
                                           "--drafter", f"{HOST}:{d_addr.rsplit(':', 1)[1]}", "--port", str(port),
                                           "--max-num-seqs", "4", "--k-policy", "auto"], tmp_path, port)
    try:
        gw.wait_serving()
        info = server_info(gw.address)
        assert {(c.batch, c.rows, c.seconds) for c in info.verify_costs} == \
            {(c.batch, c.rows, c.seconds) for c in vinfo.step_costs}
        assert {(c.batch, c.seconds) for c in info.draft_costs} == {(c.batch, c.seconds) for c in dinfo.step_costs}
        assert info.network_s > 0
        assert "K policy on" in gw.log_tail(200)
        prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
        policy_out = generate(gw.address, request(prompt, max_tokens=24, ignore_eos=True))
        fixed_out = generate(split_stack.gateway, request(prompt, max_tokens=24, ignore_eos=True))
        assert policy_out["token_ids"] == fixed_out["token_ids"]
        # the fixed-K gateway reports no costs: it has no policy
        assert not server_info(split_stack.gateway).verify_costs
        # what `bench async` records of each split stack (its K policy's table, read as the log says it)
        with gateway_stub(gw.address) as stub:
            described = policy_costs(stub)
        assert described.startswith("B=1: ") and "draft/token B=1: " in described and described.endswith(" ms")
        with gateway_stub(split_stack.gateway) as stub:
            assert policy_costs(stub) is None
    finally:
        gw.stop()
