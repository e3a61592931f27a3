"""A tree of drafts: what a drafter proposes and the verifier scores in one forward.

Nodes are numbered 0..n-1 in the order they are sent; `parents[i]` is the node drafted just
before node i, or ROOT (-1) for a child of the root, the last token before the drafts (the one
whose KV the verify step writes first). Every parent comes before its children (parents[i] < i),
so a forward that writes the nodes in order writes each ancestor first. A chain is the tree with
parents (-1, 0, 1, ..., n-2); `parents=None` on the wire means that chain.

The verifier's forward scores the root row and one row per node: rope position = the root's
position + depth(node), and each node attends to the cached context, the root and its own
ancestors (`ancestor_mask`). Greedy acceptance (`greedy_walk`) follows, from the root, the child
whose token is the target's argmax at its parent's row, as far as it goes; the bonus token is the
target's argmax at the last accepted row. That is exactly the target's own greedy continuation, as
with a chain: a node is accepted only when it equals what the target emits there.

Which requests may carry a tree (`tree_eligible`): greedy ones whose logits the verifier does not
process (no penalties, logit_bias or grammar, which depend on the chain of drafts before each
row). Sampled requests keep the chain: a lossless multi-draft rejection scheme (SpecInfer's) is
not built here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specsplit.sampling.params import SamplingParams

ROOT = -1
# A model drafter adds the runner-up token as a leaf sibling of a draft only where its top-1
# probability is below this: where it is confident, the tree stays a chain there.
LEAF_MAX_CONFIDENCE = 0.8


def tree_eligible(params: SamplingParams) -> bool:
    """Whether a request may be verified as a tree (else it is verified as a chain)."""
    return params.greedy and not params.processed


def chain_parents(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def tree_depths(parents: Sequence[int]) -> tuple[int, ...]:
    """[n] depth of each node: 1 for the root's children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return tuple(out)


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: [i, j] is True where node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p != ROOT:
            mask[i] |= mask[p]
    return mask


def ancestor_bits(parents: Sequence[int]) -> list[int]:
    """Node i's row of ancestor_mask as an int: bit j set where node j is node i or one of its
    ancestors (the attention kernel's tree_mask, kernels/cpu/decode_ops.cpp)."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append(1 << i | (bits[p] if p != ROOT else 0))
    return bits


def runner_up(logits: torch.Tensor) -> tuple[float, int]:
    """logits [V] of one draft position -> (top-1 probability, the second most likely index)."""
    x = logits.float()
    top = torch.topk(x, 2)
    p1 = float(torch.exp(top.values[0] - torch.logsumexp(x, dim=-1)))  # softmax at the top-1, no [V] output
    return p1, int(top.indices[1])


def chain_with_leaves(chain: Sequence[int], alternatives: Sequence[tuple[float, int]], budget: int,
                      max_confidence: float = LEAF_MAX_CONFIDENCE) -> "DraftTree":
    """The cheapest useful tree of a model drafter: its chain, plus the runner-up token as a leaf
    sibling of chain node j (parent j-1) at the `budget` depths where the draft was least sure
    (alternatives[j] = (top-1 probability, runner-up token) of chain[j]), only where that
    probability is below max_confidence (a runner-up < 0: none there). Leaves need no draft forward
    and no drafter KV."""
    picks = sorted((j for j, (p1, alt) in enumerate(alternatives[:len(chain)])
                    if p1 < max_confidence and alt >= 0 and alt != chain[j]), key=lambda j: alternatives[j][0])
    picks = sorted(picks[:max(0, budget)])
    return DraftTree(tuple(chain) + tuple(alternatives[j][1] for j in picks),
                     chain_parents(len(chain)) + tuple(j - 1 for j in picks))


def parents_problem(parents: Sequence[int], n: int) -> str | None:
    """Why `parents` cannot describe a tree of n nodes (sent in order), or None."""
    if len(parents) != n:
        return f"{len(parents)} parents for {n} drafts"
    for i, p in enumerate(parents):
        if not ROOT <= p < i:
            return f"node {i} has parent {p} (must be in [-1, {i}))"
    return None


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [n] draft token per node
    parents: tuple[int, ...]  # [n] parent node per node, ROOT for the root's children

    def __post_init__(self):
        why = parents_problem(self.parents, len(self.tokens))
        if why is not None:
            raise ValueError(why)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "DraftTree":
        return cls(tuple(tokens), chain_parents(len(tokens)))

    @classmethod
    def from_branches(cls, branches: Sequence[Sequence[int]]) -> "DraftTree":
        """The trie of several continuations of the root: common prefixes share nodes. Nodes are
        numbered branch by branch, so the first branch is nodes 0..len-1 (the main chain)."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for branch in branches:
            at = ROOT
            for t in branch:
                node = children.get((at, t))
                if node is None:
                    node = len(tokens)
                    tokens.append(int(t))
                    parents.append(at)
                    children[(at, t)] = node
                at = node
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == chain_parents(len(self.tokens))

    @property
    def depths(self) -> tuple[int, ...]:
        return tree_depths(self.parents)

    @property
    def depth(self) -> int:
        """The longest path: the most drafts one step can accept."""
        return max(self.depths, default=0)

    @property
    def main_chain(self) -> int:
        """How many leading nodes form a chain from the root (nodes 0..m-1, each the parent of
        the next): the branch a drafter drafted first, verifiable on its own as a chain."""
        m = 0
        while m < len(self.parents) and self.parents[m] == m - 1:
            m += 1
        return m

    def first(self, n: int) -> "DraftTree":
        """The tree of nodes 0..n-1 (closed under parents: every parent comes before its child)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`, in order (empty for ROOT)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)

    def greedy_walk(self, choice: Sequence[int]) -> list[int]:
        """The accepted path (node indices, root first) given the target's token at each row:
        choice[0] at the root, choice[1 + i] at node i. The bonus token is choice[1 + path[-1]]
        (choice[0] when the path is empty)."""
        children: dict[tuple[int, int], int] = {}
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            children.setdefault((p, t), i)  # a duplicate sibling never wins: the first is taken
        path: list[int] = []
        at = ROOT
        while True:
            node = children.get((at, int(choice[at + 1])))
            if node is None:
                return path
            path.append(node)
            at = node
