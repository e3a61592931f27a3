"""A drafter that comes back (restarted: it lost every sequence) is caught up in bounded pieces
across steps, not in one call that computes every context (#24 item 1): each drafter call after
the restart computes at most CATCH_UP_TOKENS (+ a draft's tokens) per step, the sequences decode
target-only until caught up and then speculate again, the greedy output is the target's, and every
KV block is free after. A re-sync of many sequences is spread over steps too (RESYNC_TOKENS)."""
from __future__ import annotations

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.spec import drafter_health
from specsplit.spec.decoder import CATCH_UP_TOKENS
from tests.helpers.greedy import assert_outputs_equal_or_tie
from tests.unit.test_spec_drafter_faults import FlakyDrafter

K = 3


class Recording(FlakyDrafter):
    """FlakyDrafter that records, per call after the restart, what the real engine computed (KV
    positions written) and the adds it was sent."""

    def __init__(self, engine):
        super().__init__(engine)
        self.restarted = False
        self.computed: list[int] = []  # per propose call after the restart: tokens computed, all sequences
        self.pieces: list[int] = []  # prefill_tokens of each catch-up piece after the restart
        self.adds: list[int] = []  # sequences per add call after the restart

    def restart(self):
        super().restart()
        self.restarted = True

    def add(self, seqs):
        out = super().add(seqs)
        if self.restarted:
            self.adds.append(len(seqs))
        return out

    def propose(self, reqs):
        self._check()
        if not self.restarted:
            return self.engine.propose(reqs)
        before = {r.seq_id: self.engine.seqs[r.seq_id].num_computed for r in reqs}
        out = self.engine.propose(reqs)
        # KV written this call: what the sequence has computed now minus before, drafts included
        self.computed.append(sum(max(0, self.engine.seqs[s].num_computed - n) for s, n in before.items()))
        self.pieces += [r.prefill_tokens for r in reqs if r.k == 0 and r.prefill_tokens]
        return out


def _run(tiny_llama, tiny_draft_close, reqs, down_at=4, restart_at=7):
    tc = EngineConfig(model=str(tiny_llama), max_model_len=256, max_num_seqs=4)
    # no prefix cache on the drafter: the restarted one recomputes every context, as a new process does
    dc = EngineConfig(model=str(tiny_draft_close), max_model_len=256, max_num_seqs=4, prefix_caching=False)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=K), show_progress=False)
    drafter = Recording(colo.drafter)
    colo.decoder.drafter = drafter
    colo.decoder.drafter_retry_s = 0.0
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 4)
    states = [gen.submit(r) for r in reqs]
    speculated_after = 0
    for step in range(1000):
        if step == down_at:
            drafter.down = True
        if step == restart_at:
            drafter.restart()
        before = gen.speculative_steps
        gen.step()
        if step > restart_at and gen.speculative_steps > before:
            speculated_after += 1
        if not gen.running:
            break
    assert all(s.finished for s in states)
    return colo, drafter, states, speculated_after


def _reference(tiny_llama, reqs):
    tc = EngineConfig(model=str(tiny_llama), max_model_len=256, max_num_seqs=4)
    ref = build_colocated(tc, None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    return Scheduler(ref.decoder, ref.eos_token_ids, 4).run(reqs)


def _assert_all_free(colo):
    for engine in (colo.drafter, colo.target):
        assert engine.num_running == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_restarted_drafter_catches_up_in_bounded_pieces(tiny_llama, tiny_draft_close, tiny_llama_logits):
    # two sequences of 100-token prompts: ~200 tokens to re-compute on the restarted drafter
    reqs = [GenerationRequest(f"r{i}", tuple(range(5 + i, 105 + i)), 60, ignore_eos=True) for i in range(2)]
    colo, drafter, states, speculated_after = _run(tiny_llama, tiny_draft_close, reqs)

    assert len(drafter.pieces) >= 4, drafter.pieces  # ~200 tokens, at most CATCH_UP_TOKENS a step
    assert all(n <= CATCH_UP_TOKENS for n in drafter.pieces), drafter.pieces
    # no call after the restart computed a whole context: a step's catch-up, plus one draft's tokens
    # (a draft: the last token again, the unsent ones, K drafts)
    assert max(drafter.computed) <= CATCH_UP_TOKENS + len(reqs) * (2 * K + 3), drafter.computed
    assert speculated_after > 0  # caught up, it drafts again
    assert_outputs_equal_or_tie([s.output for s in _reference(tiny_llama, reqs)], [s.output for s in states],
                                [r.prompt_token_ids for r in reqs], tiny_llama_logits)
    _assert_all_free(colo)
    colo.close()


def test_a_resync_of_many_sequences_is_spread_over_steps(tiny_llama, tiny_draft_close, tiny_llama_logits,
                                                         monkeypatch):
    monkeypatch.setattr(drafter_health, "RESYNC_TOKENS", 60)  # about one 40-token sequence a step
    reqs = [GenerationRequest(f"r{i}", tuple(range(5 + i, 45 + i)), 40, ignore_eos=True) for i in range(4)]
    colo, drafter, states, speculated_after = _run(tiny_llama, tiny_draft_close, reqs)

    assert len(drafter.adds) >= 3 and max(drafter.adds) <= 2, drafter.adds  # not one add of all four
    assert colo.decoder.health.readds == len(drafter.adds)
    assert speculated_after > 0
    assert_outputs_equal_or_tie([s.output for s in _reference(tiny_llama, reqs)], [s.output for s in states],
                                [r.prompt_token_ids for r in reqs], tiny_llama_logits)
    _assert_all_free(colo)
    colo.close()
