"""The scheduler counts a request against the drafter's KV cache only if it speculates: target-only
requests (speculation disabled) are admitted by the verifier's cache alone, while speculating ones
still wait for room on the drafter. Real engines, each on its own cache (as the services are)."""
from __future__ import annotations

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_draft_engine, build_target_engine
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.spec.decoder import SpecDecoder

PROMPT, NEW = 33, 8  # 41 tokens: 3 blocks of 16 each; the drafter's 7 blocks hold two such


def _scheduler(tiny_llama, tiny_draft_close, k: int = 2):
    spec = SpecConfig(num_speculative_tokens=k)
    target, _ = build_target_engine(EngineConfig(model=str(tiny_llama), max_model_len=64, max_num_seqs=4), spec)
    drafter, _ = build_draft_engine(
        EngineConfig(model=str(tiny_draft_close), max_model_len=64, max_num_seqs=4, num_blocks=7), spec)
    return Scheduler(SpecDecoder(target, drafter, spec, max_model_len=64), eos_token_ids=(), max_num_seqs=4)


def _requests(disable: bool):
    return [GenerationRequest(f"r{i}", tuple(range(5 + i, 5 + i + PROMPT)), NEW, ignore_eos=True,
                              disable_speculation=disable) for i in range(4)]


def _most_running(sched, reqs) -> int:
    states = [sched.submit(r) for r in reqs]
    most = 0
    while sched.has_work:
        sched.step()
        most = max(most, len(sched.running))
    assert all(len(s.output) == NEW for s in states)
    return most


def test_target_only_requests_do_not_wait_for_the_drafters_cache(tiny_llama, tiny_draft_close):
    sched = _scheduler(tiny_llama, tiny_draft_close)
    assert {b.name for b in sched.kv} == {"verifier", "drafter"}
    assert _most_running(sched, _requests(disable=True)) == 4  # before: 2, as if each held drafter KV
    assert _most_running(sched, _requests(disable=False)) < 4  # speculating ones still wait for the drafter's room
    for engine in (sched.decoder.verifier, sched.decoder.drafter):
        assert engine.num_running == 0


def test_a_request_the_drafters_whole_cache_cannot_hold_decodes_target_only(tiny_llama, tiny_draft_close):
    """Before, it was refused (INVALID_ARGUMENT) although the verifier could serve it: now it runs
    target-only, never counted against the drafter's cache, and a short one beside it speculates."""
    from specsplit.scheduler import KvBudget

    sched = _scheduler(tiny_llama, tiny_draft_close)
    verifier = next(b for b in sched.kv if b.name == "verifier")
    sched.kv = [verifier, KvBudget("drafter", 2, 16)]  # as a drafter started with --num-blocks 2 reports it
    long = sched.submit(GenerationRequest("long", tuple(range(5, 5 + PROMPT)), NEW, ignore_eos=True))
    short = sched.submit(GenerationRequest("short", (5, 6, 7, 5, 6, 7), NEW, ignore_eos=True))
    assert long.target_only and "the drafter's whole KV cache holds 32 tokens" in long.target_only
    assert short.target_only is None
    while sched.has_work:
        sched.step()
        assert long.seq_id not in {s for s, t in sched.decoder.tracks.items() if t.on_drafter}
    assert len(long.output) == NEW and len(short.output) == NEW
    assert long.proposed == 0 and short.proposed > 0
    assert sched.decoder.drafter_up
    # disabled by the client: no reason to give, the same path
    off = sched.submit(GenerationRequest("off", tuple(range(5, 5 + PROMPT)), NEW, ignore_eos=True,
                                         disable_speculation=True))
    assert off.target_only is None  # disabled by the client: no reason to log
    while sched.has_work:
        sched.step()
    for engine in (sched.decoder.verifier, sched.decoder.drafter):
        assert engine.num_running == 0


def test_with_the_servers_k_at_0_nothing_waits_for_the_drafters_cache(tiny_llama, tiny_draft_close):
    """A drafter loaded but K 0 (serve --num-speculative-tokens 0): no request ever drafts, so none
    is counted against the drafter's cache, waiting ones included, and none is "set target-only"
    (before: admission counted a waiting request's drafter blocks until its track existed)."""
    from specsplit.scheduler import KvBudget

    sched = _scheduler(tiny_llama, tiny_draft_close, k=0)
    verifier = next(b for b in sched.kv if b.name == "verifier")
    sched.kv = [verifier, KvBudget("drafter", 4, 16)]  # one 41-token request, and no admission headroom
    states = [sched.submit(r) for r in _requests(disable=False)]
    assert all(s.target_only is None for s in states)
    most = 0
    while sched.has_work:
        sched.step()
        most = max(most, len(sched.running))
    assert most == 4 and all(len(s.output) == NEW for s in states)
    assert sched.decoder.drafter.num_running == 0
