"""SpecDecoder keeps streams going target-only when the drafter fails, and re-syncs it after."""
from __future__ import annotations

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.protocols import DrafterTraits
from tests.helpers.greedy import assert_outputs_equal_or_tie


class FlakyDrafter(DrafterTraits):
    """A real DraftEngine behind a switch: while `down`, every call raises like a dead peer, and
    coming back up it has lost all its sequences (a restarted process)."""

    def __init__(self, engine):
        self.engine = engine
        self.down = False
        self.calls_while_down = 0

    def _check(self):
        if self.down:
            self.calls_while_down += 1
            raise ConnectionError("drafter unreachable")

    def restart(self):
        self.engine.release(list(self.engine.seqs))
        self.down = False

    def add(self, seqs):
        self._check()
        return self.engine.add(seqs)

    def propose(self, reqs):
        self._check()
        return self.engine.propose(reqs)

    def fetch_rows(self, fetch):
        self._check()
        return self.engine.fetch_rows(fetch)

    def release(self, ids, finished=False):
        self._check()
        return self.engine.release(ids, finished=finished)


def _reqs():
    return [GenerationRequest(f"r{i}", tuple(range(5 + i, 20 + 2 * i)), 40, ignore_eos=True) for i in range(4)]


def test_drafter_outage_keeps_greedy_output_and_resumes(tiny_llama, tiny_draft_close, tiny_llama_logits):
    tc = EngineConfig(model=str(tiny_llama), max_model_len=128, max_num_seqs=4)
    dc = EngineConfig(model=str(tiny_draft_close), max_model_len=128, max_num_seqs=4)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=3), show_progress=False)
    flaky = FlakyDrafter(colo.drafter)
    colo.decoder.drafter = flaky
    colo.decoder.drafter_retry_s = 0.0
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 4)
    states = [gen.submit(r) for r in _reqs()]
    phases = []
    for step in range(200):
        if step == 3:
            flaky.down = True
        if step == 8:
            flaky.restart()
        before = gen.speculative_steps
        gen.step()
        phases.append(gen.speculative_steps > before)
        if not gen.running:
            break
    assert all(s.finished for s in states)
    assert any(phases[:3]) and not any(phases[3:8]) and any(phases[9:]), phases
    assert flaky.calls_while_down >= 1

    ref = build_colocated(tc, None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    ref_states = Scheduler(ref.decoder, ref.eos_token_ids, 4).run(_reqs())
    assert_outputs_equal_or_tie([s.output for s in ref_states], [s.output for s in states],
                                [r.prompt_token_ids for r in _reqs()], tiny_llama_logits)
    assert colo.drafter.block_manager.num_free_blocks == colo.drafter.block_manager.num_blocks
    assert colo.target.block_manager.num_free_blocks == colo.target.block_manager.num_blocks


def test_sequences_finished_while_the_drafter_was_down_are_released_there(tiny_llama, tiny_draft_close):
    """A drafter call that fails only for us (a timeout) leaves the drafter holding our sequences;
    those that finish before it answers again must still be released there on re-sync."""
    tc = EngineConfig(model=str(tiny_llama), max_model_len=128, max_num_seqs=4)
    dc = EngineConfig(model=str(tiny_draft_close), max_model_len=128, max_num_seqs=4)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=3), show_progress=False)
    flaky = FlakyDrafter(colo.drafter)
    colo.decoder.drafter = flaky
    colo.decoder.drafter_retry_s = 0.0
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 4)
    short = [GenerationRequest(f"s{i}", tuple(range(5 + i, 12 + i)), 6, ignore_eos=True) for i in range(2)]
    long = GenerationRequest("long", tuple(range(30, 40)), 40, ignore_eos=True)
    states = [gen.submit(r) for r in [*short, long]]
    gen.step()
    flaky.down = True  # transient: the engine keeps every sequence (no restart)
    while not all(s.finished for s in states[:2]):
        gen.step()
    assert not states[2].finished
    flaky.down = False
    while gen.running:
        gen.step()
    assert colo.drafter.num_running == 0, sorted(colo.drafter.seqs)
    assert colo.target.num_running == 0
    assert colo.drafter.block_manager.num_free_blocks == colo.drafter.block_manager.num_blocks
    assert colo.target.block_manager.num_free_blocks == colo.target.block_manager.num_blocks
    colo.close()
