"""The draft tree type (specsplit/draft_tree.py), the n-gram branches that build one, the model
drafter's chain-plus-leaves tree and the tree sizing rule (specsplit/k_policy.py tree_nodes)."""
from __future__ import annotations

import pytest
import torch

from specsplit.calibration import StepCosts
from specsplit.draft_tree import (
    ROOT,
    DraftTree,
    chain_with_leaves,
    parents_problem,
    runner_up,
    tree_eligible,
)
from specsplit.k_policy import TreeValue, tree_nodes
from specsplit.sampling.ngram import ngram_branches, ngram_propose
from specsplit.sampling.params import SamplingParams


def _tree() -> DraftTree:
    #   root -> 10 -> 11 -> 12        nodes 0, 1, 2
    #        \      \-> 21            node 3 (sibling of 11)
    #         \-> 30 -> 31            nodes 4, 5
    return DraftTree((10, 11, 12, 21, 30, 31), (ROOT, 0, 1, 0, ROOT, 4))


def test_depths_paths_and_main_chain():
    t = _tree()
    assert t.depths == (1, 2, 3, 2, 1, 2)
    assert t.depth == 3
    assert t.path(2) == [0, 1, 2] and t.path(3) == [0, 3] and t.path(5) == [4, 5] and t.path(ROOT) == []
    assert t.main_chain == 3 and not t.is_chain
    assert DraftTree.chain((5, 6, 7)).is_chain and DraftTree.chain((5, 6, 7)).main_chain == 3
    assert t.first(4) == DraftTree((10, 11, 12, 21), (ROOT, 0, 1, 0))


def test_ancestor_mask():
    m = _tree().ancestor_mask()
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, want)
    assert torch.equal(DraftTree.chain((1, 2, 3)).ancestor_mask(), torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("choice, path", [
    # choice[0]: the target's token after the root; choice[1 + i]: after node i
    ([10, 11, 12, 99, 0, 0, 0], [0, 1, 2]),  # the main chain, all of it
    ([10, 21, 0, 0, 7, 0, 0], [0, 3]),  # the sibling leaf
    ([30, 0, 0, 0, 0, 31, 0], [4, 5]),  # the second branch
    ([30, 0, 0, 0, 0, 8, 0], [4]),
    ([99, 0, 0, 0, 0, 0, 0], []),  # nothing accepted: the bonus is choice[0]
])
def test_greedy_walk(choice, path):
    assert _tree().greedy_walk(choice) == path


def test_from_branches_shares_prefixes():
    t = DraftTree.from_branches([[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]])
    assert t == DraftTree((1, 2, 3, 4, 5), (ROOT, 0, 1, 1, ROOT))
    assert DraftTree.from_branches([[1, 2]]).is_chain
    assert DraftTree.from_branches([]) == DraftTree((), ())


@pytest.mark.parametrize("parents, n, bad", [
    ((ROOT, 0, 1), 3, False),
    ((ROOT, ROOT), 2, False),
    ((0,), 1, True),  # its own parent
    ((ROOT, 2, 0), 3, True),  # a child before its parent
    ((ROOT, -2), 2, True),
    ((ROOT,), 2, True),  # length
])
def test_parents_problem(parents, n, bad):
    assert (parents_problem(parents, n) is not None) == bad
    if bad:
        with pytest.raises(ValueError):
            DraftTree(tuple(range(n)), parents)


def test_tree_eligible_is_greedy_with_raw_logits():
    assert tree_eligible(SamplingParams())
    assert not tree_eligible(SamplingParams(temperature=0.8))
    assert not tree_eligible(SamplingParams(repetition_penalty=1.2))


def test_ngram_branches_first_is_the_chain_then_distinct_continuations():
    ctx = [1, 2, 3, 9, 9, 1, 2, 4, 8, 1, 2, 3, 7, 6, 1, 2]
    branches = ngram_branches(ctx, 3, 5)
    assert branches[0] == ngram_propose(ctx, 3)
    assert branches == [[3, 7, 6], [4, 8, 1], [3, 9, 9]]
    assert ngram_branches(ctx, 3, 1) == [ngram_propose(ctx, 3)]
    assert ngram_branches([1, 2, 3], 3, 4) == []
    # a continuation that is a prefix of an earlier one adds nothing
    assert ngram_branches([3, 8, 9, 1, 3, 8, 9, 3], 2, 4) == [[8, 9]]
    assert ngram_branches([3, 8, 3, 8, 3], 3, 4) == [[8, 3], [8, 3, 8]]


def test_chain_with_leaves_only_where_unsure():
    chain = [10, 11, 12, 13]
    alts = [(0.95, 20), (0.3, 21), (0.6, 22), (0.5, 13)]  # depth 4's runner-up is the draft itself
    t = chain_with_leaves(chain, alts, budget=1)
    assert t == DraftTree((10, 11, 12, 13, 21), (ROOT, 0, 1, 2, 0))  # the least sure depth first
    t = chain_with_leaves(chain, alts, budget=5)
    assert t.tokens[4:] == (21, 22) and t.parents[4:] == (0, 1)
    assert chain_with_leaves(chain, alts, budget=0).is_chain
    assert chain_with_leaves(chain, [(0.99, 1)] * 4, budget=3).is_chain  # sure everywhere: a chain


def test_runner_up():
    p1, alt = runner_up(torch.tensor([0.0, 3.0, 2.0, float("-inf")]))
    assert alt == 2 and p1 == pytest.approx(torch.softmax(torch.tensor([0.0, 3.0, 2.0]), 0)[1].item())


def _costs(per_row: float) -> StepCosts:
    """A verify that costs 1 s for one row and `per_row` more for each further row (batch 1..4)."""
    return StepCosts(verify={(b, r): b * (1.0 + per_row * (r - 1)) for b in (1, 4) for r in range(1, 6)})


def test_tree_sizing_rule():
    value = TreeValue().value
    assert value == pytest.approx(0.1)
    # rows cost 35% of a step (this CPU with the native quantized weights): a node worth 0.1 tokens never pays
    assert tree_nodes(_costs(0.35), 1, 3, expected=2.0, value=value, max_nodes=4) == 0
    # rows nearly free (a memory-bound accelerator): the whole budget
    assert tree_nodes(_costs(0.001), 1, 3, expected=2.0, value=value, max_nodes=4) == 4
    # rows at 6% of a verify: a node worth 0.1 tokens does not pay on the verify alone, but it does
    # where drafting and the network cost as much as the verify again (they do not grow with leaves)
    assert tree_nodes(_costs(0.06), 1, 3, expected=2.0, value=value, max_nodes=4) == 0
    assert tree_nodes(_costs(0.06), 1, 3, expected=2.0, value=value, max_nodes=4, fixed_s=1.0) == 4
    # past the calibrated rows the cost is extrapolated, never cheaper
    assert _costs(0.1).verify_rows_s(1, 8) == pytest.approx(1.7)
    # the flag alone without costs; nothing without a budget or a chain
    assert tree_nodes(None, 1, 3, 2.0, value, 3) == 3
    assert tree_nodes(_costs(0.001), 1, 3, 2.0, value, 0) == 0
    assert tree_nodes(_costs(0.001), 1, 0, 2.0, value, 4) == 0


def test_tree_value_learns():
    v = TreeValue()
    v.update(nodes=100, gained=50)
    assert v.value > 0.35
