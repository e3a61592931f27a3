"""specsplit/engine.py's drafter chain helpers: chain_tail is the context past a position without
copying the context before it (what the model drafter feeds and the EAGLE-3 head re-feeds)."""
from __future__ import annotations

import itertools

from specsplit.engine import chain_tail


def test_chain_tail_is_the_concatenation_s_tail():
    for n_tokens, n_drafted in itertools.product(range(4), range(3)):
        tokens, drafted = list(range(10, 10 + n_tokens)), list(range(50, 50 + n_drafted))
        for start in range(n_tokens + n_drafted + 2):
            assert chain_tail(tokens, drafted, start) == (tokens + drafted)[start:]


def test_chain_tail_never_aliases_the_sequence_s_lists():
    tokens, drafted = [1, 2], [3]
    for start in (0, 2, 3):
        tail = chain_tail(tokens, drafted, start)
        tail.append(99)
        assert tokens == [1, 2] and drafted == [3]
