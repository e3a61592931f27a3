"""A message that does not decode on an engine's internal Session stream (a string field holding
bytes that are not UTF-8) ends that stream INVALID_ARGUMENT naming the method and the decode error
(gRPC alone answers UNKNOWN "Unexpected DecodeError"); the messages before it were answered, what
the stream added is freed, and the engine serves the next stream. A real `specsplit drafter`
(the n-gram proposer: no model to load) on loopback."""
from __future__ import annotations

import grpc
import pytest

from specsplit.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from tests.services.procs import ServiceProcess, free_port, service_info, wait_for

PLACEHOLDER = "QQQQ"
NOT_UTF8 = b"\xff\xfe\xc3\x28"
SESSION = "/specsplit.v1.Drafter/Session"


@pytest.fixture(scope="module")
def ngram_drafter(tmp_path_factory):
    port = free_port()
    proc = ServiceProcess("ngram-drafter", ["drafter", "--model", "ngram", "--port", str(port)],
                          tmp_path_factory.mktemp("bad-messages"), port)
    try:
        yield proc.serving(120)
    finally:
        proc.stop()


def _add(msg_id: int, seq_id: str) -> drafter_pb2.DrafterRequest:
    return drafter_pb2.DrafterRequest(id=msg_id, add=common_pb2.AddSeqs(seqs=[
        common_pb2.SeqAdd(seq_id=seq_id, prompt_token_ids=[5, 6, 7, 5, 6], params=common_pb2.SamplingParams(top_p=1.0))]))


def test_an_undecodable_session_message_ends_the_stream_invalid_argument(ngram_drafter):
    good = _add(1, "a").SerializeToString()
    bad = _add(2, PLACEHOLDER).SerializeToString().replace(PLACEHOLDER.encode(), NOT_UTF8)
    never = drafter_pb2.DrafterRequest(id=3, release=common_pb2.Release(seq_ids=["a"])).SerializeToString()
    responses = []
    with grpc.insecure_channel(ngram_drafter.address) as ch:
        session = ch.stream_stream(SESSION, request_serializer=lambda b: b,
                                   response_deserializer=drafter_pb2.DrafterResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            for r in session(iter([good, bad, never]), timeout=60):
                responses.append(r)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    details = err.value.details()
    assert "specsplit.v1.Drafter/Session" in details and "could not be decoded" in details, details
    assert "must be valid UTF-8" in details, details
    # The message before it was served; the one after it never was.
    assert [(r.id, r.HasField("ack")) for r in responses] == [(1, True)], responses
    # The stream's sequence is freed with it, and the drafter serves on.
    assert wait_for(lambda: service_info(ngram_drafter.address, "drafter").num_running == 0, 30) is not None
    assert ngram_drafter.alive()
    with grpc.insecure_channel(ngram_drafter.address) as ch:
        again = list(drafter_pb2_grpc.DrafterStub(ch).Session(
            iter([_add(1, "b"), drafter_pb2.DrafterRequest(id=2, release=common_pb2.Release(seq_ids=["b"]))]),
            timeout=60))
    assert [(r.id, r.HasField("error")) for r in again] == [(1, False), (2, False)]
