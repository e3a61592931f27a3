"""Verifier.abandon over gRPC (AbandonStep): the step is rolled back exactly -- the next verify
emits what a sequence that never took that step emits, and nothing is left behind."""
from __future__ import annotations

import grpc

from specsplit.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.services.procs import service_info, wait_for

PROMPT = [5, 6, 7, 8, 9]


def _session(address: str, messages) -> list:
    for i, m in enumerate(messages, 1):
        m.id = i
    with grpc.insecure_channel(address) as ch:
        return list(verifier_pb2_grpc.VerifierStub(ch).Session(iter(messages), timeout=60))


def _add(seq_id: str, seed: int):
    params = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=seed)
    return verifier_pb2.VerifierRequest(add=common_pb2.AddSeqs(seqs=[common_pb2.SeqAdd(
        seq_id=seq_id, prompt_token_ids=PROMPT, params=params)]))


def _verify(seq_id: str, drafts=(), probs=()):
    return verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifyBatch(items=[verifier_pb2.VerifyItem(
        seq_id=seq_id, draft_token_ids=list(drafts), draft_probs=list(probs))]))


def test_abandon_rolls_a_step_back_over_grpc(split_stack):
    address = split_stack["verifier"].address
    before = service_info(address, "verifier").kv.free_blocks
    responses = _session(address, [
        _add("a", 77), _add("b", 77),
        _verify("a", [11, 12, 13], [0.9, 0.9, 0.9]),  # a speculative step on 'a' (pending or not) ...
        verifier_pb2.VerifierRequest(abandon=verifier_pb2.AbandonStep(seq_ids=["a", "unknown"])),  # ... undone
        _verify("a"), _verify("b"),  # both now decode the first position target-only
        verifier_pb2.VerifierRequest(release=common_pb2.Release(seq_ids=["a", "b"])),
    ])
    assert [r.WhichOneof("kind") for r in responses] == ["ack", "ack", "results", "ack", "results", "results", "ack"], \
        [r.error.message for r in responses]
    a, b = responses[4].results.results[0], responses[5].results.results[0]
    assert len(a.token_ids) == 1 and list(a.token_ids) == list(b.token_ids)
    assert wait_for(lambda: service_info(address, "verifier").kv.free_blocks == before, 5.0) is not None
