"""A newer gateway in front of an older verifier (tests/helpers/older_verifier.py: the real verifier,
answering as one from before SamplingParams' min_tokens and min_p). Proto3 drops the fields a peer
does not know, so such a verifier would sample as if they were unset: the gateway reads the
verifier's sampling_features and refuses those requests with INVALID_ARGUMENT / 400 naming the
field, and serves the others as before. A current verifier lists every feature."""
from __future__ import annotations

import json

import grpc
import pytest

from specsplit.sampling.params import SAMPLING_FEATURES
from tests.services.procs import (HOST, TINY_ENGINE, ServiceProcess, Stack, free_port, generate, http_call, request,
                                  service_info)


@pytest.fixture(scope="module")
def older(tmp_path_factory, tiny_llama):
    log_dir = tmp_path_factory.mktemp("older-verifier")
    vport, gport, hport = free_port(), free_port(), free_port()
    stack = Stack()
    stack.procs["verifier"] = ServiceProcess("verifier", ["verifier", "--model", str(tiny_llama), "--port", str(vport),
                                                          *TINY_ENGINE], log_dir, vport,
                                             module="tests.helpers.older_verifier")
    stack.procs["gateway"] = ServiceProcess("gateway", ["gateway", "--verifier", f"{HOST}:{vport}", "--port", str(gport),
                                                        "--http-port", str(hport)], log_dir, gport)
    try:
        yield stack.ready()
    finally:
        stack.stop()


def test_a_current_verifier_lists_every_sampling_feature(split_stack):
    info = service_info(split_stack.procs["verifier"].address, "verifier")
    assert tuple(info.sampling_features) == SAMPLING_FEATURES


def test_requests_an_older_verifier_would_ignore_are_refused(older):
    info = service_info(older.procs["verifier"].address, "verifier")
    assert list(info.sampling_features) == []
    for fields, name in ((dict(min_p=0.1, temperature=1.0), "min_p"), (dict(min_tokens=3), "min_tokens")):
        with pytest.raises(grpc.RpcError) as err:
            generate(older.gateway, request([5, 6, 7], max_tokens=4, **fields))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{name} is not applied by this server's verifier" in err.value.details()
    status, raw = http_call(older.http_port, "/v1/completions",
                            {"model": json.loads(http_call(older.http_port, "/v1/models")[1])["data"][0]["id"],
                             "prompt": [5, 6, 7], "max_tokens": 4, "min_p": 0.2})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "min_p" and "upgrade the verifier" in err["message"], raw
    status, raw = http_call(older.http_port, "/v1/completions",
                            {"model": json.loads(http_call(older.http_port, "/v1/models")[1])["data"][0]["id"],
                             "prompt": [5, 6, 7], "max_tokens": 4, "prompt_logprobs": 1})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "prompt_logprobs" and "upgrade the verifier" in err["message"], raw
    out = generate(older.gateway, request([5, 6, 7], max_tokens=4, ignore_eos=True))  # the rest as before
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"
