"""gateway/app.py limits_shrunk: when a restarted verifier can no longer serve what the split
gateway admits by the limits it read at start (the gateway then exits: test_services_health.py)."""
from __future__ import annotations

import pytest

from specsplit.gateway.app import limits_shrunk
from specsplit.v1 import common_pb2


def _info(vocab=256, max_model_len=256, max_num_seqs=8, blocks=100, block_size=16, features=("min_tokens", "min_p")):
    return common_pb2.ServiceInfo(vocab_size=vocab, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                  kv=common_pb2.KvStats(paged=True, num_blocks=blocks, free_blocks=blocks,
                                                        block_size=block_size), sampling_features=features)


@pytest.mark.parametrize("now", [_info(), _info(max_model_len=512, max_num_seqs=16, blocks=200),
                                 _info(blocks=95), _info(features=("min_p", "min_tokens", "later"))])
# the same, larger, a start-up's profiling noise, more features (a newer verifier)
def test_the_same_or_larger_limits_are_served_on(now):
    assert limits_shrunk(_info(), now, max_num_seqs=8) is None


@pytest.mark.parametrize("now, why", [
    (_info(max_model_len=128), "max_model_len 256 -> 128"),
    (_info(vocab=300), "vocab_size 256 -> 300"),
    (_info(max_num_seqs=4), "max_num_seqs 4, this gateway admits 8"),
    (_info(blocks=80), "KV blocks 100 -> 80"),
    (_info(block_size=32), "KV block size 16 -> 32"),
    (_info(features=("min_tokens",)), "sampling features min_p no longer applied (an older verifier)"),
])
def test_smaller_or_other_limits_are_named(now, why):
    assert why in limits_shrunk(_info(), now, max_num_seqs=8)


def test_a_gateway_admitting_fewer_sequences_than_the_verifier_is_not_affected():
    assert limits_shrunk(_info(max_num_seqs=16), _info(max_num_seqs=8), max_num_seqs=8) is None
