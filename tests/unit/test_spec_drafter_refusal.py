"""A drafter that refuses some sequences (no room in its cache, invalid for it) is not down: only
those sequences decode target-only, the others keep speculating, and a re-sync that it refuses in
one call is retried one sequence at a time (specsplit/spec/drafter_health.py `refused`)."""
from __future__ import annotations

import grpc

from specsplit.config import EngineConfig, SpecConfig
from specsplit.engine import EngineError
from specsplit.factory import build_colocated, build_draft_engine, build_target_engine
from specsplit.gateway.peer_clients import RemoteError
from specsplit.kv.block_manager import OutOfBlocks
from specsplit.protocols import SeqAdd
from specsplit.request import GenerationRequest
from specsplit.sampling.params import SamplingParams
from specsplit.scheduler import Scheduler
from specsplit.spec.decoder import SpecDecoder
from specsplit.spec.drafter_health import refused
from tests.helpers.greedy import assert_outputs_equal_or_tie


def test_what_counts_as_a_refusal():
    assert refused(EngineError("prompt too long"))
    assert refused(OutOfBlocks("no room"))
    assert refused(RemoteError(grpc.StatusCode.RESOURCE_EXHAUSTED, "session holds too many", broken=False))
    assert refused(RemoteError(grpc.StatusCode.INVALID_ARGUMENT, "bad ids", broken=False))
    # failing, shutting down or gone is not a refusal: the drafter is down
    assert not refused(RemoteError(grpc.StatusCode.UNAVAILABLE, "shutting down", broken=False))
    assert not refused(RemoteError(grpc.StatusCode.INVALID_ARGUMENT, "stream broke", broken=True))
    assert not refused(RemoteError(grpc.StatusCode.INTERNAL, "bug", broken=False))
    assert not refused(ConnectionError("unreachable"))
    assert not refused(RuntimeError("anything else"))


# The drafter's cache: 7 blocks of 16 tokens (one --max-model-len 64 sequence fits, as the plan
# demands); a 33-token prompt takes 3 blocks and stays within them for NEW tokens (drafts included:
# the budgets cap them), so it holds two sequences and has no room for a third.
PROMPT, NEW = 33, 12


class _Engines:
    """A verifier and a drafter each on its own cache (as the services are; one process's joint
    plan would give both the same), under one SpecDecoder."""

    def __init__(self, tiny_llama, tiny_draft_close):
        spec = SpecConfig(num_speculative_tokens=3)
        self.target, _ = build_target_engine(EngineConfig(model=str(tiny_llama), max_model_len=64, max_num_seqs=4), spec)
        self.drafter, _ = build_draft_engine(
            EngineConfig(model=str(tiny_draft_close), max_model_len=64, max_num_seqs=4, num_blocks=7), spec)
        self.decoder = SpecDecoder(self.target, self.drafter, spec, max_model_len=64)

    def close(self) -> None:
        for engine in (self.target, self.drafter):
            engine.release(list(engine.seqs))


def _adds():
    return [SeqAdd(f"s{i}", tuple(range(5 + i, 5 + i + PROMPT)), SamplingParams()) for i in range(4)]


def _drive(decoder, n: int = NEW) -> dict[str, list[int]]:
    """Step every sequence until each emitted n tokens; its tokens, and each step's output."""
    outs = {s: [] for s in decoder.tracks}
    steps = []
    while any(len(v) < n for v in outs.values()):
        out = decoder.step({s: max(1, n - len(outs[s])) for s in outs})
        steps.append(out)
        for s, toks in out.tokens.items():
            outs[s].extend(toks)
    return {s: v[:n] for s, v in outs.items()}, steps


def test_a_sequence_the_drafter_has_no_room_for_goes_target_only_alone(tiny_llama, tiny_draft_close):
    eng = _Engines(tiny_llama, tiny_draft_close)
    try:
        decoder = eng.decoder
        for a in _adds():
            decoder.add(a)
        on = {s: t.on_drafter for s, t in decoder.tracks.items()}
        assert on == {"s0": True, "s1": True, "s2": False, "s3": False}
        assert decoder.drafter_up  # before: the third add's OutOfBlocks took the drafter down for all
        assert [decoder.tracks[s].k for s in ("s2", "s3")] == [0, 0]
        _, steps = _drive(decoder)
        assert all({s for s, (p, _) in out.drafts.items() if p} <= {"s0", "s1"} for out in steps)
        assert any(out.speculated for out in steps)
        decoder.release(list(decoder.tracks))
        for engine in (eng.target, eng.drafter):
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        eng.close()


def test_a_resync_the_drafter_refuses_as_a_whole_goes_one_by_one(tiny_llama, tiny_draft_close):
    """Four sequences arrive while the drafter is down; back, it has room for two: the re-sync's
    one add of all four is refused, so it adds them one at a time; two speculate, two decode
    target-only, and the drafter is up (before: 'still unavailable', retried forever)."""
    eng = _Engines(tiny_llama, tiny_draft_close)
    try:
        decoder = eng.decoder
        decoder.drafter_retry_s = 0.0
        decoder.health.failed(ConnectionError("the drafter restarted"), decoder.tracks)  # down, holding nothing
        for a in _adds():  # admitted while it was down: all four speculate once it is back
            decoder.add(a)
        assert all(t.k == 3 and not t.on_drafter for t in decoder.tracks.values())
        decoder.health.maybe_resync(decoder.tracks)
        assert decoder.drafter_up
        on = sorted(s for s, t in decoder.tracks.items() if t.on_drafter)
        assert len(on) == 2 and sorted(s for s, t in decoder.tracks.items() if t.k == 0 and not t.on_drafter) == \
            sorted(set(decoder.tracks) - set(on))
        _, steps = _drive(decoder)
        assert all({s for s, (p, _) in out.drafts.items() if p} <= set(on) for out in steps)
        assert any(out.speculated for out in steps)
        decoder.release(list(decoder.tracks))
        assert eng.drafter.block_manager.num_free_blocks == eng.drafter.block_manager.num_blocks
    finally:
        eng.close()


def test_greedy_output_unchanged_when_the_drafter_refuses_some(tiny_llama, tiny_draft_close, tiny_llama_logits):
    eng = _Engines(tiny_llama, tiny_draft_close)
    ref = build_colocated(EngineConfig(model=str(tiny_llama), max_model_len=64, max_num_seqs=4), None,
                          SpecConfig(num_speculative_tokens=0), show_progress=False)
    try:
        reqs = [GenerationRequest(a.seq_id, a.prompt_token_ids, NEW, ignore_eos=True) for a in _adds()]
        # the scheduler counts the drafter's cache too (it would admit only what both hold): the
        # decoder is driven directly, every sequence added at once
        for a in _adds():
            eng.decoder.add(a)
        outs, _ = _drive(eng.decoder)
        got = [outs[r.request_id] for r in reqs]
        want = [s.output for s in Scheduler(ref.decoder, ref.eos_token_ids, 4).run(reqs)]
        assert_outputs_equal_or_tie(want, got, [r.prompt_token_ids for r in reqs], tiny_llama_logits)
    finally:
        eng.close()
        ref.close()
