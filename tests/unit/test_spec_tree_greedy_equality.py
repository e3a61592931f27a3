"""Tree verification end to end in one process (SpecConfig.tree_nodes): speculative greedy output
with draft trees == target-only greedy, token for token (a difference only at a certified near-tie
of the target, tests/helpers/greedy.py), at batches 1, 4 and 16, with the n-gram drafter's trees
(several earlier continuations), the suffix drafter's (its heaviest path plus second heaviest
children) and the model drafters' (their chain plus runner-up leaves); trees are
really verified and branches accepted; every KV block is free afterwards on both sides; sampled
requests keep the chain."""
from __future__ import annotations

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.protocols import ProposeRequest, SeqAdd, VerifyRequest
from specsplit.request import GenerationRequest
from specsplit.sampling.params import SamplingParams
from specsplit.scheduler import Scheduler
from tests.helpers.greedy import assert_greedy_equal_or_tie

MAX_LEN = 160


def _requests(n: int, seed: int, max_tokens: int = 24, temperature: float = 0.0) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(8, 48, (1,), generator=g))
        # Few distinct tokens: the suffix recurs with several continuations (branches to find).
        base = torch.randint(3, 12, (max(1, length // 2),), generator=g).tolist()
        prompt = (base * 3)[:length]
        params = SamplingParams(temperature=temperature, seed=i if temperature else None)
        out.append(GenerationRequest(f"r{i}", tuple(prompt), max_tokens, ignore_eos=True, params=params))
    return out


def _colo(target, draft, k: int, tree_nodes: int, max_num_seqs: int = 16):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    dc = None if draft is None else EngineConfig(model=str(draft), max_model_len=MAX_LEN, max_num_seqs=max_num_seqs)
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k, tree_nodes=tree_nodes), show_progress=False)


def _run(colo, requests):
    """Outputs, and per step stats summed: (steps, tree nodes verified)."""
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 16)
    totals = {"tree_nodes": 0, "accepted": 0}
    step = colo.decoder.step

    def counted(*a, **kw):  # the real step; its stats are summed
        out = step(*a, **kw)
        totals["tree_nodes"] += out.stats.tree_nodes
        totals["accepted"] += out.stats.accepted
        return out

    colo.decoder.step = counted
    states = gen.run(requests)
    bm = colo.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "target KV blocks leaked"
    if colo.draft_model is not None:
        bm = colo.drafter.block_manager
        assert bm.num_free_blocks == bm.num_blocks, "draft KV blocks leaked"
    return [s.output for s in states], totals


@pytest.fixture(scope="module")
def reference(tiny_llama):
    cache = {}

    def get(batch):
        if batch not in cache:
            cache[batch] = _run(_colo(tiny_llama, None, 0, 0), _requests(batch, seed=batch))[0]
        return cache[batch]

    return get


def _assert_equal(out, ref, batch, next_logits):
    assert len(out) == len(ref)
    for req, o, r in zip(_requests(batch, seed=batch), out, ref):
        assert_greedy_equal_or_tie(r, next_logits, o, prompt=req.prompt_token_ids)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_ngram_trees_greedy_equal(tiny_llama, tiny_llama_logits, reference, batch):
    out, totals = _run(_colo(tiny_llama, "ngram", 3, 4), _requests(batch, seed=batch))
    _assert_equal(out, reference(batch), batch, tiny_llama_logits)
    assert totals["tree_nodes"] > 0, "the n-gram drafter should have proposed trees"


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_suffix_trees_greedy_equal(tiny_llama, tiny_llama_logits, reference, batch):
    out, totals = _run(_colo(tiny_llama, "suffix", 3, 2), _requests(batch, seed=batch))
    _assert_equal(out, reference(batch), batch, tiny_llama_logits)
    if batch == 16:  # fewer requests rarely leave the heaviest path unsure (test_suffix_drafter.py has the rule)
        assert totals["tree_nodes"] > 0, "the suffix drafter should have added its second heaviest children"


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_model_draft_trees_greedy_equal(tiny_llama, tiny_draft_close, tiny_llama_logits, reference, batch):
    out, totals = _run(_colo(tiny_llama, tiny_draft_close, 3, 2), _requests(batch, seed=batch))
    _assert_equal(out, reference(batch), batch, tiny_llama_logits)
    assert totals["tree_nodes"] > 0, "an unsure draft should have added leaves"


def test_a_branch_is_accepted_and_the_kv_is_the_chains(tiny_llama):
    """Verify a tree whose main chain is wrong and whose branch is the target's own continuation:
    the branch is accepted, and the next step (the KV moved into the chain's slots) emits what the
    target emits after it."""
    colo = _colo(tiny_llama, None, 4, 4)
    engine = colo.target
    prompt = tuple(_requests(1, seed=3)[0].prompt_token_ids)
    engine.add([SeqAdd("ref", prompt), SeqAdd("t", prompt)])
    greedy = []
    for _ in range(4):  # the target's own greedy continuation, one token a step
        greedy += engine.verify([VerifyRequest("ref")])[0].token_ids
    wrong = [(greedy[0] + 1) % 200 + 3, greedy[1]]
    tokens = tuple(wrong) + (greedy[0], greedy[1], greedy[2])  # chain: wrong; branch: right
    parents = (-1, 0, -1, 2, 3)
    res = engine.verify([VerifyRequest("t", tokens, None, parents)])[0]
    assert res.num_accepted == 3 and list(res.token_ids) == greedy[:4]
    assert engine.seqs["t"].num_computed == len(prompt) + 3
    assert engine.block_manager.length("t") == len(prompt) + 3  # the rejected branch's KV is gone
    nxt = engine.verify([VerifyRequest("t")])[0].token_ids
    ref = engine.verify([VerifyRequest("ref")])[0].token_ids
    assert nxt == ref
    engine.release(["ref", "t"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_tree_asked_for_logprobs_gives_its_paths(tiny_llama):
    """With logprobs asked, the tree's logits (not the greedy ids alone) decide: the accepted
    branch's tokens and logprobs are the ones of the same tokens verified as a chain."""
    colo = _colo(tiny_llama, None, 4, 4)
    engine = colo.target
    prompt = tuple(_requests(1, seed=4)[0].prompt_token_ids)
    engine.add([SeqAdd(s, prompt, logprobs=2) for s in ("ref", "t", "chain")])
    greedy = []
    for _ in range(4):  # the target's own greedy continuation, one token a step
        greedy += engine.verify([VerifyRequest("ref")])[0].token_ids
    engine.release(["ref"])
    assert [engine.verify([VerifyRequest(s)])[0].token_ids for s in ("t", "chain")] == [(greedy[0],)] * 2
    chain = engine.verify([VerifyRequest("chain", tuple(greedy[1:3]))])[0]
    wrong = (greedy[1] + 1) % 200 + 3
    tree = engine.verify([VerifyRequest("t", (wrong, greedy[1], greedy[2]), None, (-1, -1, 1))])[0]
    assert tree.num_accepted == chain.num_accepted == 2 and tree.token_ids == chain.token_ids
    for a, b in zip(tree.logprobs, chain.logprobs):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [a.logprob, *(lp for _, lp in a.top)] == pytest.approx([b.logprob, *(lp for _, lp in b.top)], abs=1e-5)
    engine.release(["t", "chain"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sampled_requests_keep_the_chain(tiny_llama, tiny_draft_close):
    colo = _colo(tiny_llama, tiny_draft_close, 3, 4)
    asks = []
    propose = colo.drafter.propose

    def seen(reqs):  # the real drafter; the asks recorded
        asks.extend(reqs)
        return propose(reqs)

    colo.drafter.propose = seen
    reqs = _requests(2, seed=5, max_tokens=8, temperature=0.9)
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 16)
    gen.run(reqs)
    assert asks and all(a.tree_nodes == 0 for a in asks)
    engine = colo.target
    engine.add([SeqAdd("s", (5, 6, 7), SamplingParams(temperature=0.9, seed=1))])
    with pytest.raises(ValueError, match="trees"):
        engine.verify([VerifyRequest("s", (5, 6), (1.0, 1.0), (-1, -1))])
    engine.release(["s"])


def test_drafter_tree_proposals_follow_the_ask(tiny_llama, tiny_draft_far):
    colo = _colo(tiny_llama, tiny_draft_far, 3, 2)
    d = colo.drafter
    d.add([SeqAdd("a", (5, 6, 7, 8)), SeqAdd("b", (5, 6, 7, 8))])
    p_tree, p_chain = d.propose([ProposeRequest("a", (), 3, tree_nodes=2), ProposeRequest("b", (), 3)])
    assert p_chain.parents is None and len(p_chain.token_ids) == 3
    assert p_tree.token_ids[:3] == p_chain.token_ids  # the chain is the same; leaves come after it
    assert len(p_tree.token_ids) <= 5
    d.release(["a", "b"])


def test_a_drafter_that_loses_state_resyncs_with_trees(tiny_llama, tiny_draft_close, tiny_llama_logits, reference):
    """The drafter goes down mid-generation and comes back empty (a restart): the streams go on
    target-only, the drafter is re-synced, trees are verified again, and the output is the target's."""
    from tests.unit.test_spec_drafter_faults import FlakyDrafter

    colo = _colo(tiny_llama, tiny_draft_close, 3, 2)
    flaky = FlakyDrafter(colo.drafter)
    colo.decoder.drafter = flaky
    colo.decoder.drafter_retry_s = 0.0
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 16)
    reqs = _requests(4, seed=4)
    states = [gen.submit(r) for r in reqs]
    nodes_after = 0
    for step in range(200):
        if step == 3:
            flaky.down = True
        if step == 6:
            flaky.restart()
        before = colo.decoder.tree_value.nodes
        gen.step()
        if step > 6:
            nodes_after += colo.decoder.tree_value.nodes - before
        if not gen.running:
            break
    assert all(s.finished for s in states) and flaky.calls_while_down >= 1
    assert nodes_after > 0, "trees after the re-sync"
    _assert_equal([s.output for s in states], reference(4), 4, tiny_llama_logits)
    for bm in (colo.drafter.block_manager, colo.target.block_manager):
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_feature_drafter_trees_greedy_equal(tiny_llama, tiny_head, tiny_llama_logits, reference, batch):
    out, totals = _run(_colo(tiny_llama, tiny_head, 3, 2), _requests(batch, seed=batch))
    _assert_equal(out, reference(batch), batch, tiny_llama_logits)
    assert totals["tree_nodes"] > 0, "the feature drafter's unsure drafts should have added leaves"
