"""A draft tree in one forward (ForwardItem.tree; attention.BatchMetadata's tree mask and rope
positions): each node's logits equal those of its own path verified as a chain, in a batch with
plain chains and prefill chunks, on the default path (torch attention for the tree, the C++ kernel
for the chains) and the batch-invariant one (exactly); ModelRunner.move_kv moves a path's KV."""
from __future__ import annotations

import pytest
import torch

from specsplit.draft_tree import ROOT, DraftTree
from specsplit.models.attention import BatchMetadata
from specsplit.models.loader import load_model
from specsplit.models.runner import ForwardItem, ModelRunner

TREE = DraftTree((40, 41, 42, 50, 60, 61, 43), (ROOT, 0, 1, 0, ROOT, 4, 2))


def _runner(path, deterministic: bool) -> ModelRunner:
    model = load_model(str(path), dtype=torch.float32, show_progress=False).model
    if deterministic:
        from specsplit.models.deterministic import make_deterministic

        make_deterministic(model)
    return ModelRunner(model, num_blocks=96, block_size=4, max_model_len=128)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_metadata_positions_and_mask():
    # one sequence: 2 cached tokens, new = the root + 3 nodes (root -> a -> b, root -> c)
    meta = BatchMetadata.build([4], [6], [[0, 1]], list(range(2, 6)), [4], 4, torch.device("cpu"),
                               trees=[(ROOT, 0, ROOT)])
    assert meta.positions.tolist() == [2, 3, 4, 3] and meta.has_tree
    mask = meta.groups[0].mask[0, 0]  # [q, S]
    assert mask[:, :6].int().tolist() == [
        [1, 1, 1, 0, 0, 0],  # the root: causal
        [1, 1, 1, 1, 0, 0],  # a
        [1, 1, 1, 1, 1, 0],  # b sees a
        [1, 1, 1, 0, 0, 1],  # c sees the root only
    ]


@pytest.mark.parametrize("deterministic", [False, True])
def test_tree_rows_equal_their_paths_as_chains(tiny_llama, deterministic):
    runner = _runner(tiny_llama, deterministic)
    prompt = _prompt(1, 21)
    other = _prompt(2, 30)
    runner.forward([ForwardItem("t", 0, prompt[:-1])])
    # in company: a sequence mid-prefill and a plain verify chain, in the same forward
    runner.forward([ForwardItem("o", 0, other[:10])])
    n = len(TREE)
    logits = runner.forward([
        ForwardItem("o", 10, other[10:]),
        ForwardItem("t", len(prompt) - 1, [prompt[-1], *TREE.tokens], n + 1, tree=TREE.parents),
        ForwardItem("c", 0, prompt + [7, 8], 3),
    ])[1]  # [1 + n, V]
    for node in [ROOT, *range(n)]:
        path = TREE.path(node)
        seq = f"ref{node}"
        runner.forward([ForwardItem(seq, 0, prompt[:-1])])
        ref = runner.forward([ForwardItem(seq, len(prompt) - 1, [prompt[-1], *(TREE.tokens[j] for j in path)],
                                          len(path) + 1)])[0][-1]
        if deterministic:
            assert torch.equal(logits[node + 1], ref), node
        else:
            torch.testing.assert_close(logits[node + 1], ref, atol=1e-4, rtol=1e-4)
        runner.free(seq)


def test_move_kv_makes_the_path_a_chain(tiny_llama):
    runner = _runner(tiny_llama, False)
    prompt = _prompt(3, 13)
    runner.forward([ForwardItem("t", 0, prompt[:-1])])
    base = len(prompt)
    runner.forward([ForwardItem("t", base - 1, [prompt[-1], *TREE.tokens], len(TREE) + 1, tree=TREE.parents)])
    path = TREE.path(5)  # nodes 4, 5: at positions base + 4, base + 5, moved to base, base + 1
    runner.move_kv("t", [base + j for j in path], [base + d for d in range(len(path))])
    runner.truncate("t", base + len(path))
    after = runner.forward([ForwardItem("t", base + len(path), [9])])[0][-1]
    chain = [TREE.tokens[j] for j in path]
    runner.forward([ForwardItem("ref", 0, prompt + chain)])
    ref = runner.forward([ForwardItem("ref", base + len(path), [9])])[0][-1]
    torch.testing.assert_close(after, ref, atol=1e-4, rtol=1e-4)
