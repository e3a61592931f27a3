"""Fixtures: the tiny split stack (drafter + verifier + gateway), the tiny colocated server, both
started at once and shared by the session, and an in-process target-only reference."""
from __future__ import annotations

import random

import pytest

from tests.services.procs import free_port, start_colocated, start_split

PROMPT_SEED = 1234


@pytest.fixture(scope="session")
def tiny_servers(tmp_path_factory, tiny_llama, tiny_draft_close):
    """All three stacks start at once (their start-ups overlap); each fixture below waits for its own.

    split:     drafter + verifier + gateway, max_num_seqs 8, max_queue 32
    colocated: `specsplit serve` with the same pair
    small:     verifier + gateway, no drafter, max_num_seqs 2, max_queue 1 (test_services_verifier_down
               kills its verifier and stops its gateway)
    The split and small gateways also serve the OpenAI-compatible HTTP API (Stack.http_port).
    """
    stacks = {
        "split": start_split(tmp_path_factory.mktemp("split-logs"), tiny_llama, tiny_draft_close,
                             gateway_extra=("--http-port", str(free_port()))),
        "colocated": start_colocated(tmp_path_factory.mktemp("colocated-logs"), tiny_llama, tiny_draft_close),
        "small": start_split(tmp_path_factory.mktemp("small-logs"), tiny_llama, None, max_num_seqs=2, max_queue=1,
                             gateway_extra=("--http-port", str(free_port()))),
    }
    try:
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


@pytest.fixture(scope="session")
def split_stack(tiny_servers):
    return tiny_servers["split"].ready()


@pytest.fixture(scope="session")
def colocated_stack(tiny_servers):
    return tiny_servers["colocated"].ready()


@pytest.fixture(scope="session")
def small_stack(tiny_servers):
    return tiny_servers["small"].ready()


@pytest.fixture(scope="session")
def prompts():
    """Random prompts over the tiny vocabulary (ids 3.. avoid <unk>, <s>, </s>)."""
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 24))] for _ in range(24)]


@pytest.fixture(scope="session")
def reference(tiny_llama):
    """target_only(prompt_ids, max_tokens, ignore_eos) -> greedy tokens of the target alone."""
    from specsplit.config import EngineConfig, SpecConfig
    from specsplit.factory import build_colocated
    from specsplit.request import GenerationRequest
    from specsplit.scheduler import Scheduler

    colo = build_colocated(EngineConfig(model=str(tiny_llama), max_model_len=256, max_prefill_tokens=128, max_num_seqs=1),
                           None, SpecConfig(num_speculative_tokens=0), show_progress=False)
    cache: dict = {}

    def target_only(ids, max_tokens: int, ignore_eos: bool = False) -> list[int]:
        key = (tuple(ids), max_tokens, ignore_eos)
        if key not in cache:
            gen = Scheduler(colo.decoder, colo.eos_token_ids, max_num_seqs=1)
            (state,) = gen.run([GenerationRequest("ref", tuple(ids), max_tokens, ignore_eos=ignore_eos)])
            cache[key] = state.output
        return cache[key]

    yield target_only
    colo.close()


@pytest.fixture(scope="session")
def target_logits(tiny_llama_logits):
    """The target's next-token logits after a context (transformers, fp32): certifies near-ties."""
    return tiny_llama_logits


@pytest.fixture(scope="session")
def expect_greedy(reference, target_logits):
    """expect_greedy(prompt_ids, tokens, max_tokens, ignore_eos): tokens are the target alone's greedy
    output, except from a certified near-tie on (tests/helpers/greedy.py)."""
    from tests.helpers.greedy import assert_greedy_equal_or_tie

    def check(ids, tokens, max_tokens: int, ignore_eos: bool = False):
        return assert_greedy_equal_or_tie(reference(ids, max_tokens, ignore_eos), target_logits, tokens, prompt=ids)

    return check
