"""`python -m tests.helpers.older_verifier verifier ...`: the real verifier CLI, behaving as a
verifier built before SamplingParams had the fields in SAMPLING_FEATURES: its GetInfo lists no
sampling features, the params it receives lose those fields (proto3 drops the fields a peer
does not know), and the logprobs it sends have no rank (TokenLogprob.rank 0). Test-only: production code carries no hook.

Used by tests/services/test_services_version_skew.py: a newer gateway must refuse what such a
verifier would silently ignore.
"""
from __future__ import annotations

import dataclasses
import logging
import sys

from specsplit.cli import main
from specsplit.rpc import wire
from specsplit.sampling.params import SamplingParams

log = logging.getLogger("tests.older_verifier")


def arm() -> None:
    from specsplit.verifier_svc import service

    info_pb = service.info_pb

    def older_info(*args, **kw):
        info = info_pb(*args, **kw)
        del info.sampling_features[:]
        return info

    params_from_pb = wire.params_from_pb

    def older_params(m) -> SamplingParams:
        defaults = SamplingParams()
        return dataclasses.replace(params_from_pb(m), min_tokens=defaults.min_tokens,
                                   min_tokens_stop_ids=defaults.min_tokens_stop_ids, min_p=defaults.min_p)

    logprobs_to_pb = wire.logprobs_to_pb

    def older_logprobs(lps):
        return logprobs_to_pb([dataclasses.replace(x, rank=0) for x in lps])

    service.info_pb = older_info
    wire.params_from_pb = older_params
    wire.logprobs_to_pb = older_logprobs
    log.warning("TEST: this verifier acts as one from before sampling features (it ignores min_tokens, min_p; no logprob ranks)")


if __name__ == "__main__":
    arm()
    sys.exit(main(sys.argv[1:]))
