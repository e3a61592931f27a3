"""The K policy (specsplit/k_policy.py): the K that maximizes expected tokens per second, 0 where
speculation cannot pay, probes while it could, and greedy output unchanged as K varies per step."""
from __future__ import annotations

import pytest
import torch

from specsplit.calibration import StepCosts
from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.k_policy import POOLED_PRIOR_WEIGHT, REQUEST_PRIOR_WEIGHT, Acceptance, KPolicy, Pooled, ProbeCost
from specsplit.protocols import SeqAdd
from tests.helpers.greedy import assert_outputs_equal_or_tie

MAX_LEN = 160


def _costs(v, draft=0.05, batches=(1, 2, 4, 8)) -> StepCosts:
    """Synthetic costs: a target step of 1.0 s per sequence-row-group, v[k] the k-draft step."""
    return StepCosts(verify={(b, k + 1): b * v[k] for b in batches for k in range(len(v))},
                     draft={b: draft * b for b in batches})


def _acc(rate: float, n: int = 200) -> Acceptance:
    a = Acceptance()
    for _ in range(n):  # positions accepted independently with `rate`: conditional rate = rate
        accepted = 0
        while accepted < 4 and (accepted + 1) * rate >= 1e-9 and torch.rand(1).item() < rate:
            accepted += 1
        a.update(4, accepted)
    return a


def _brute(policy: KPolicy, accs, caps) -> int:
    best = None
    for k in range(policy.max_k + 1):
        tokens = sum(a.expected_tokens(min(k, c)) for a, c in zip(accs, caps))
        rate = tokens / policy.step_time(len(accs), k)
        if best is None or rate > best[0] + 1e-12:
            best = (rate, k)
        if k == 0:
            target_only = rate
    return best[1] if best[0] >= target_only * (1 + policy.margin) else 0


def test_acceptance_counts_positions_conditionally():
    a = Acceptance(prior_rate=0.5, prior_weight=2.0)
    a.update(3, 1)  # position 0 accepted, position 1 rejected, position 2 never tried
    a.update(3, 3)
    assert a.tried == [2, 2, 1] and a.accepted == [2, 1, 1]
    assert a.rate(0) == pytest.approx((2 + 1) / 4) and a.rate(5) == pytest.approx(0.5)
    assert a.expected_tokens(0) == 1.0
    assert a.expected_tokens(2) == pytest.approx(1 + a.rate(0) + a.rate(0) * a.rate(1))


def test_a_drafter_that_stops_early_is_priced_by_the_rows_it_drafts():
    """Asked for 3, an EAGLE-3 head that stops after 2 where unsure (--draft-stop) verifies about
    3 rows, not 4, and position 2 is rarely there to accept: K=3 costs what K=2 does in the
    verify, and the policy no longer prices rows the drafter does not send."""
    full, stops = Acceptance(), Acceptance()
    for _ in range(40):
        full.update(3, 2, asked=3)
        stops.update(2, 2, asked=3)
    assert full.expected_rows(3) == pytest.approx(4.0)
    assert stops.drafted == [40, 40, 0] and stops.expected_rows(3) == pytest.approx(3 + 1 / 41)
    assert stops.expected_tokens(3) == pytest.approx(stops.expected_tokens(2)
                                                     + (1 / 41) * stops.rate(0) * stops.rate(1) * stops.rate(2))
    policy = KPolicy(_costs([1.0, 1.35, 1.7, 2.05], draft=0.0), max_k=3)
    assert policy.step_time(1, 3, rows=stops.expected_rows(3)) == pytest.approx(1.7 + 0.35 / 41)
    assert policy.step_time(1, 3, rows=4.0) == policy.step_time(1, 3) == pytest.approx(2.05)
    # expensive rows (35% of a step each), a head right 90% of the time: priced by the rows it
    # drafts, asking for 3 is as good as asking for 2 (the chain stops there anyway)
    rates = policy.rates([stops])
    assert rates[3] == pytest.approx(rates[2], rel=0.02)


def test_a_drafter_that_stops_early_pays_one_draft_forward_per_draft_it_sends():
    """The verify's first row is the last accepted token, so R(k) rows carry R(k) - 1 drafts: a
    head asked for 3 that sends 2 pays for 2 draft forwards, not 3 (the policy charged R(k) until
    the twenty-second session, a forward too many wherever the head stopped early)."""
    stops = Acceptance()
    for _ in range(40):
        stops.update(2, 2, asked=3)
    rows = stops.expected_rows(3)  # 3 + 1/41
    policy = KPolicy(_costs([1.0, 1.35, 1.7, 2.05], draft=0.2), max_k=3)
    assert policy.step_time(1, 3, rows=rows) == pytest.approx(1.7 + 0.35 / 41 + (rows - 1) * 0.2)
    assert policy.step_time(1, 3) == pytest.approx(2.05 + 3 * 0.2)  # a full chain: k drafts
    assert policy.step_time(1, 1, rows=stops.expected_rows(1)) == policy.step_time(1, 1) == pytest.approx(1.35 + 0.2)


def test_a_position_never_asked_for_is_drafted_as_often_as_the_one_before():
    """A chain drafts position j only after j - 1: where the K policy never asked for a third
    draft, d_2 reads as d_1 (a head that sends a second draft 30% of the time sends a third at most
    that often), not as a certain full chain."""
    a = Acceptance()
    for i in range(100):
        a.update(2 if i % 10 < 3 else 1, 0, asked=2)
    assert a.drafted_rate(1) == pytest.approx(31 / 101)
    assert a.drafted_rate(2) == a.drafted_rate(1)  # never asked: not 1.0
    assert a.expected_rows(3) == pytest.approx(1 + 1 + 2 * 31 / 101)


def test_a_head_that_stops_early_is_asked_for_its_whole_chain_where_rows_are_cheap():
    """The twenty-second session's served steps on an AMX Xeon (one thread, batch 1, the default
    EAGLE-3 head + prompt lookup, 6 held-out prompts x 64 tokens): the verify 11.8 ms with
    v(1..4) = 1, 1.05, 1.18, 1.24, a drafted token 1.21 ms; asked for 3 the head sent a second
    draft 52% and a third 34% of the time, accepted at 0.63, 0.68, 0.92. Fixed K = 3 ran at 128
    tok/s, the policy before the fix at 117-120 (it asked for 1 draft at 190 of 231 steps); the
    policy now asks for 3, as the fixed K did."""
    v = [1.0, 1.05, 1.18, 1.24]
    costs = StepCosts(verify={(1, k + 1): 0.0118 * v[k] for k in range(4)}, draft={1: 0.00121})
    # that run's counts: of 185 steps asked for 3, 179 sent a first draft, 96 a second, 61 a third
    head = Acceptance(tried=[179, 72, 37], accepted=[113, 49, 34], asked=[185, 183, 180], drafted=[179, 96, 61])
    policy = KPolicy(costs, max_k=3)
    rates = policy.rates([head])
    assert policy.choose([head]) == 3
    assert rates[3] > rates[1] * 1.03


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.6, 0.9])
@pytest.mark.parametrize("v", [[1.0, 1.05, 1.1, 1.15, 1.2], [1.0, 1.7, 2.2, 2.4, 2.6], [1.0, 1.2, 1.5, 2.5, 3.0]])
@pytest.mark.parametrize("batch", [1, 4])
def test_policy_picks_the_k_with_the_most_tokens_per_second(rate, v, batch):
    torch.manual_seed(0)
    policy = KPolicy(_costs(v), max_k=4)
    accs = [_acc(rate) for _ in range(batch)]
    caps = [4] * batch
    assert policy.choose(accs, caps) == _brute(policy, accs, caps)


def test_policy_turns_speculation_off_where_it_cannot_pay_and_on_where_it_does():
    steep = KPolicy(_costs([1.0, 1.9, 2.8, 3.7, 4.6]), max_k=4)
    assert steep.choose([_acc(0.9)]) == 0  # verifying costs almost a step per draft
    flat = KPolicy(_costs([1.0, 1.02, 1.04, 1.06, 1.08], draft=0.01), max_k=4)
    assert flat.choose([_acc(0.9)]) == 4
    assert flat.choose([_acc(0.0)]) == 0  # nothing is ever accepted
    # a costly draft model: one draft token costs half a target step
    pricey = KPolicy(_costs([1.0, 1.02, 1.04, 1.06, 1.08], draft=0.5), max_k=4)
    assert pricey.choose([_acc(0.4)]) == 0
    # the hybrid drafter's model drafts at most one token: lookup tokens are free
    assert KPolicy(_costs([1.0, 1.02, 1.04, 1.06, 1.08], draft=0.5), 4, model_tokens=1).choose([_acc(0.9)]) == 4


def test_probe_only_while_speculation_could_pay():
    flat = KPolicy(_costs([1.0, 1.02, 1.04, 1.06, 1.08]), max_k=4, probe_every=4)
    picks, probing = [], []
    for _ in range(12):
        picks.append(flat.choose([_acc(0.0)]))
        probing.append(flat.probing)
    assert picks.count(1) == 3 and set(picks) == {0, 1}
    assert probing == [k == 1 for k in picks]  # every 1 here is a probe: one sequence drafts
    steep = KPolicy(_costs([1.0, 2.5, 3.5, 4.5, 5.5]), max_k=4, probe_every=4)
    assert {steep.choose([_acc(0.0)]) for _ in range(12)} == {0}  # even all-accepted could not pay


def _probing(target, draft, batch: int, seed: int):
    """A colocated pair with `batch` sequences added whose policy sees flat costs (one draft could
    pay) and acceptances that never accept: K stays 0 and it probes every 2 steps."""
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=4)
    colo = build_colocated(tc, EngineConfig(model=str(draft), max_model_len=MAX_LEN, max_num_seqs=4),
                           SpecConfig(num_speculative_tokens=3, k_policy="auto"), show_progress=False)
    decoder = colo.decoder
    decoder.policy.costs, decoder.policy.probe_every = _costs([1.0, 1.05, 1.1, 1.15, 1.2], draft=0.0), 2
    for r in _requests(batch, seed=seed):
        decoder.add(SeqAdd(r.request_id, r.prompt_token_ids, r.params))
        decoder.tracks[r.request_id].acceptance = Acceptance(prior_rate=0.0, prior_weight=1000.0)
    return colo


def test_a_probe_drafts_for_one_sequence_in_turn(tiny_llama, tiny_draft_far):
    """At batch 4 with nothing ever accepted, K stays 0 and every probe step drafts one token for
    one sequence, each in turn: one verify row more, never the whole batch."""
    colo = _probing(tiny_llama, tiny_draft_far, 4, seed=7)
    decoder = colo.decoder
    drafted_by = []
    for _ in range(16):
        out = decoder.step()
        drafting = [s for s, (proposed, _) in out.drafts.items() if proposed]
        assert out.k in (0, 1) and len(drafting) == (1 if out.k else 0), out
        drafted_by += drafting
    assert decoder.k_chosen[0] == 8 and decoder.k_chosen[1] == 8
    assert sorted(set(drafted_by)) == sorted(decoder.tracks)  # each sequence probed in turn
    colo.close()


def _requests(n: int, seed: int, max_tokens: int = 24) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(GenerationRequest(f"r{i}", tuple((base * 3)[:40]), max_tokens, ignore_eos=True))
    return out


class _Cycling(KPolicy):
    """K per step from a fixed cycle (0 included): greedy output must not notice."""

    def __init__(self, cycle=(3, 0, 1, 4, 2, 2, 0, 4)):
        super().__init__(_costs([1.0] * 5), max_k=4)
        self.cycle, self.i = cycle, 0

    def choose(self, accs, caps=None) -> int:
        self.i += 1
        return self.cycle[self.i % len(self.cycle)]


def _run(target, draft, requests, policy=None):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=16)
    dc = None if draft is None else EngineConfig(model=str(draft), max_model_len=MAX_LEN, max_num_seqs=16)
    spec = SpecConfig(num_speculative_tokens=4 if draft else 0, k_policy="auto" if draft else "fixed")
    colo = build_colocated(tc, dc, spec, show_progress=False)
    if policy is not None:
        colo.decoder.policy = policy
    states = Scheduler(colo.decoder, colo.eos_token_ids, 16).run(requests)
    bm = colo.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [s.output for s in states], colo.decoder


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("draft", ["tiny_draft_close", "tiny_draft_far", "ngram"])
def test_greedy_equal_with_k_varying_per_step(tiny_llama, tiny_llama_logits, draft, batch, request):
    draft_model = "ngram" if draft == "ngram" else request.getfixturevalue(draft)
    requests = _requests(batch, seed=batch)
    reference, _ = _run(tiny_llama, None, requests)
    # K changes the rows of a forward and so, at a row-count boundary, the kernel: a difference is
    # accepted only at a certified near-tie of the target's logits (tests/helpers/greedy.py)
    out, decoder = _run(tiny_llama, draft_model, requests, _Cycling())
    assert_outputs_equal_or_tie(reference, out, [r.prompt_token_ids for r in requests], tiny_llama_logits)
    assert {k for k, n in decoder.k_chosen.items() if n} == {0, 1, 2, 3, 4}, decoder.k_chosen
    # and with the policy as built (timed costs)
    out, decoder = _run(tiny_llama, draft_model, requests)
    assert decoder.policy is not None
    assert_outputs_equal_or_tie(reference, out, [r.prompt_token_ids for r in requests], tiny_llama_logits)


def test_colocated_engines_calibrate_and_report(tiny_llama, tiny_draft_close):
    tc = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=4)
    colo = build_colocated(tc, EngineConfig(model=str(tiny_draft_close), max_model_len=MAX_LEN, max_num_seqs=4),
                           SpecConfig(num_speculative_tokens=3, k_policy="auto"), show_progress=False)
    costs = colo.decoder.policy.costs
    assert set(costs.verify) == {(b, r) for b in (1, 2, 4) for r in (1, 2, 3, 4)}
    assert set(costs.draft) == {1, 2, 4}
    assert all(s > 0 for s in list(costs.verify.values()) + list(costs.draft.values()))
    assert costs.verify_s(3, 2) > 0 and costs.verify_s(32, 4) > 0  # interpolated, extrapolated
    for engine in (colo.target, colo.drafter):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    fixed = build_colocated(tc, EngineConfig(model=str(tiny_draft_close), max_model_len=MAX_LEN, max_num_seqs=4),
                            SpecConfig(num_speculative_tokens=3, k_policy="fixed"), show_progress=False)
    assert fixed.decoder.policy is None and fixed.target.step_costs is None


def test_async_pricing_pays_drafting_only_on_a_miss():
    """With pre-drafting, drafting costs (1 - hit) of a just-in-time draft, plus what the pre-draft
    takes beyond the verify it overlaps; lockstep always pays it."""
    costs = _costs([1.0, 1.05, 1.1, 1.15, 1.2], draft=0.2)
    lock, ahead = KPolicy(costs, 4), KPolicy(costs, 4, async_draft=True)
    assert ahead.step_time(1, 0) == lock.step_time(1, 0) == pytest.approx(1.0)
    assert lock.step_time(1, 2) == pytest.approx(1.1 + 2 * 0.2)
    assert ahead.step_time(1, 2, hit=1.0) == pytest.approx(1.1)  # the pre-draft (0.6 s) hides under the verify
    assert ahead.step_time(1, 2, hit=0.0) == pytest.approx(lock.step_time(1, 2))
    assert ahead.step_time(1, 2, hit=0.5) == pytest.approx(1.1 + 0.5 * 0.4)
    slow = KPolicy(_costs([1.0, 1.05, 1.1, 1.15, 1.2], draft=0.5), 4, async_draft=True)
    assert slow.step_time(1, 2, hit=1.0) == pytest.approx(1.1 + (3 * 0.5 - 1.1))  # pre-draft longer than verify


def test_branch_hit_is_every_draft_then_the_bonus():
    a = Acceptance(prior_rate=0.5, prior_weight=2.0)
    assert a.branch_hit(0) == 1.0
    assert a.branch_hit(1) == pytest.approx(0.25) and a.branch_hit(2) == pytest.approx(0.125)


def test_async_never_prices_a_k_above_lockstep():
    """Drafting is cheaper when it overlaps the verify: while the pre-draft fits under the verify
    (here 5 x 0.15 s < 1.08 s), every K's expected tokens per second is at least lockstep's, and
    strictly more for K > 0 once drafts get accepted."""
    torch.manual_seed(0)
    costs = _costs([1.0, 1.02, 1.04, 1.06, 1.08], draft=0.15)
    for rate in (0.0, 0.3, 0.6, 0.9):
        accs = [_acc(rate), _acc(rate)]
        ahead, lock = KPolicy(costs, 4, async_draft=True).rates(accs), KPolicy(costs, 4).rates(accs)
        assert all(a >= b - 1e-12 for a, b in zip(ahead, lock)), (rate, ahead, lock)
        if rate > 0:
            assert all(a > b for a, b in zip(ahead[1:], lock[1:]))


def test_extrapolation_never_prices_a_bigger_batch_lower():
    """Noisy calibration can time batch 8 below batch 4; past the largest batch the cost must not
    fall (a negative step time made the policy pick nonsense)."""
    costs = StepCosts(verify={(1, 1): 0.05, (4, 1): 0.09, (8, 1): 0.08}, draft={1: 0.004, 4: 0.006, 8: 0.005})
    assert costs.verify_s(32, 1) >= costs.verify_s(8, 1) > 0
    assert costs.draft_s(32) >= costs.draft_s(8) > 0
    assert costs.verify_s(6, 1) == pytest.approx(0.085)  # inside the points: interpolated as measured


def test_a_gain_below_the_margin_stays_target_only():
    """k > 0 only when it beats target-only by the margin (3%): calibration noise is about that."""
    costs = _costs([1.0, 1.02, 1.04, 1.06, 1.08], draft=0.0)
    a = Acceptance(prior_rate=0.02, prior_weight=1000.0)  # E(1) = 1.02: 1.02 / 1.02 = no gain
    assert KPolicy(costs, 4).choose([a]) == 0
    b = Acceptance(prior_rate=0.06, prior_weight=1000.0)  # E(1) = 1.06: +3.9% at k = 1
    assert KPolicy(costs, 4).choose([b]) == 1 and KPolicy(costs, 4, margin=0.05).choose([b]) == 0


# ---- what probes cost (ProbeCost) ------------------------------------------------------------------
def test_probe_cost_is_the_median_probe_over_the_median_k0_step():
    c = ProbeCost(window=16, min_samples=4)
    for r in (1.0, 1.1, 0.9, 1.0):
        c.observe(2, False, r)
    for r in (1.8, 1.9, 40.0):  # one outlier (a pause): the median ignores it
        c.observe(2, True, r)
    assert c.extra(2) is None  # 3 probes < min_samples
    c.observe(2, True, 1.7)
    assert c.extra(2) == pytest.approx(0.85)
    assert c.extra(1) is None and c.samples(2, True) == 4 and c.samples(2, False) == 4
    for _ in range(4):
        c.observe(4, False, 1.0)
        c.observe(4, True, 0.9)
    assert c.extra(4) == 0.0  # a probe cheaper than a step (noise): no negative cost


def test_probes_that_cost_more_than_their_budget_come_less_often():
    policy = KPolicy(_costs([1.0, 1.02, 1.04, 1.06, 1.08]), max_k=4, probe_every=4, probe_budget=0.01)
    nothing = [Acceptance(prior_rate=0.0, prior_weight=1000.0)] * 2
    probes_at = []
    for step in range(400):
        k = policy.choose(nothing, [4, 4])
        if policy.probing:
            probes_at.append(step)
        policy.observe(k, policy.step_time(2, 0) * (1.5 if policy.probing else 1.0))  # a probe: +0.5 of a step
    assert policy.probe_cost.extra(2) == pytest.approx(0.5)
    assert policy.probe_interval(2) == 50 and policy.probe_interval(1) == 4  # batch 1: no probe measured
    gaps = [b - a for a, b in zip(probes_at, probes_at[1:])]
    assert gaps[:7] == [4] * 7 and set(gaps[-3:]) == {50}  # every 4 until 8 probes were measured


def test_observe_keeps_only_probe_and_k0_steps_the_policy_chose():
    policy = KPolicy(_costs([1.0, 1.02, 1.04, 1.06, 1.08], draft=0.0), max_k=4)
    policy.observe(0, 1.0)  # never chose: nothing to compare with
    policy.choose([_acc(0.0)])
    policy.observe(0, None)  # a step that computed a prompt
    policy.observe(0, 1.0)  # its choice was consumed already
    assert policy.probe_cost.samples(1, False) == 0
    assert policy.choose([_acc(0.0)]) == 0
    policy.observe(0, 1.0)
    assert policy.choose([_acc(0.9)]) > 0 and not policy.probing
    policy.observe(2, 1.0)  # a drafting step: not a probe, not k = 0
    assert policy.probe_cost.samples(1, False) == 1 and policy.probe_cost.samples(1, True) == 0


def test_the_decoder_times_its_steps_for_the_policy(tiny_llama, tiny_draft_close):
    """Every decode step at k = 0 and every probe is timed for ProbeCost; the prompt's step is not."""
    colo = _probing(tiny_llama, tiny_draft_close, 2, seed=5)
    decoder = colo.decoder
    for _ in range(13):
        decoder.step()
    cost = decoder.policy.probe_cost
    assert decoder.k_chosen[0] == 7 and decoder.k_chosen[1] == 6
    assert cost.samples(2, False) == 6 and cost.samples(2, True) == 6  # the first step computed the prompts
    colo.close()


def test_a_request_prior_is_centred_on_the_pooled_rate_and_weighs_request_prior_weight():
    pooled = Pooled()
    assert pooled.rate(0) == pytest.approx(0.6)  # the fixed prior until steps come
    for _ in range(300):  # 300 steps of one draft, 90 accepted: 0.3 at position 0
        pooled.update(1, 0)
    for _ in range(90):
        pooled.update(1, 1)
    assert pooled.rate(0) == pytest.approx((90 + 0.6 * POOLED_PRIOR_WEIGHT) / (390 + POOLED_PRIOR_WEIGHT))
    a = Acceptance(prior_weight=REQUEST_PRIOR_WEIGHT, pooled=pooled)
    assert a.rate(0) == pytest.approx(pooled.rate(0))  # a new request starts at the server's rate
    a.update(1, 1)
    a.update(1, 1)
    assert a.rate(0) == pytest.approx((2 + pooled.rate(0) * REQUEST_PRIOR_WEIGHT) / (2 + REQUEST_PRIOR_WEIGHT))


def test_a_few_early_misses_do_not_switch_speculation_off():
    """One draft costs 0.36 of a step here, so it pays from ~0.42 accepted; the drafter's true rate
    is 0.65. A server's first request missing 5 of its first 6 drafts (prompt lookup early on) must
    not pull every later request's prior under that: the pooled prior holds, and so does a single
    request that starts with 1 of 4 accepted (a fixed prior of 0.6 at weight 2 read 0.37 there)."""
    policy = KPolicy(_costs([1.0, 1.31]), max_k=1)
    pooled = Pooled()
    pooled.update(1, 1)
    for _ in range(5):
        pooled.update(1, 0)
    fresh = Acceptance(prior_weight=REQUEST_PRIOR_WEIGHT, pooled=pooled)
    assert policy.choose([fresh]) == 1
    unlucky = Acceptance(prior_weight=REQUEST_PRIOR_WEIGHT, pooled=pooled)
    for n in (1, 0, 0, 0):
        unlucky.update(1, n)
    assert Acceptance(prior_weight=2.0, tried=[4], accepted=[1]).rate(0) < 0.4 < unlucky.rate(0)
    assert policy.choose([unlucky]) == 1
    bad = Acceptance(prior_weight=REQUEST_PRIOR_WEIGHT, pooled=pooled)  # 40 steps at 0.2: off
    for j in range(40):
        bad.update(1, int(j % 5 == 0))
    assert policy.choose([bad]) == 0


def test_pooled_counts_halve_past_the_window():
    pooled = Pooled(window=100)
    for j in range(101):
        pooled.update(2, 2 if j % 2 else 1)
    assert pooled.tried[0] == 50 and pooled.accepted[0] == 50  # 101 -> halved
    assert pooled.tried[1] == 50 and pooled.accepted[1] == 25
