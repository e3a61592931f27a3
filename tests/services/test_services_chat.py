"""The public API's defaults and chat turns, through a real gateway: a request with only a prompt
and max_tokens is served (top_p unset = 1.0), and chat messages need the model's chat template
(the tiny test model has none: INVALID_ARGUMENT that says so; the SmolLM2 rendering is checked
against transformers in test_services_wire.py)."""
from __future__ import annotations

import grpc
import pytest

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc


def test_prompt_and_max_tokens_alone_are_served(split_stack):
    with grpc.insecure_channel(split_stack.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        msgs = list(stub.Generate(gateway_pb2.GenerateRequest(prompt="w5 w6 w7", max_tokens=5), timeout=60))
    assert msgs[-1].finish_reason in ("length", "stop")
    assert 1 <= sum(len(m.token_ids) for m in msgs) <= 5


def test_chat_messages_without_a_template_are_refused_with_the_reason(split_stack):
    req = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="w5 w6")], max_tokens=4)
    with grpc.insecure_channel(split_stack.gateway) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no chat template" in err.value.details()
