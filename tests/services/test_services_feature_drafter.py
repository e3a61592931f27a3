"""An EAGLE-3 feature drafter over real services: the verifier sends each step's features (bf16)
to the gateway, the gateway hands them to the drafter process with the next propose.

Split (three processes, lockstep) and colocated (`specsplit serve`, the same head in memory) emit
the target's greedy tokens and, step for step, the same drafts: the proposed and accepted counts
of every request are equal, which they are only if the drafter saw the same features over gRPC
as in memory. The wire format itself round-trips exactly (bf16)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specsplit.protocols import ProposeRequest, VerifyResult
from specsplit.rpc import wire
from tests.helpers.eagle3 import write_tiny_head
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.services.procs import generate, request, service_info, start_colocated, start_split

MAX_TOKENS = 24
# Full chains: with --draft-stop a chain's length hangs on a product of probabilities that two
# processes may round apart at the threshold, and this test counts drafts split vs colocated.
K = ("--num-speculative-tokens", "3", "--draft-stop", "0")


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, tiny_llama):
    # the drafter process reads the target's embedding from its base model
    return write_tiny_head(tmp_path_factory.mktemp("tiny-eagle3-svc"), torch.arange(256), seed=11,
                           extra_json={"specsplit_base_model": str(tiny_llama)})


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tiny_llama, head_dir):
    draft = f"{head_dir}+ngram"
    split = start_split(tmp_path_factory.mktemp("fd-split"), tiny_llama, draft,
                        gateway_extra=("--no-async-draft", *K))
    colo = start_colocated(tmp_path_factory.mktemp("fd-colo"), tiny_llama, draft, extra=K)
    try:
        yield split.ready(), colo.ready()
    finally:
        split.stop()
        colo.stop()


def _run(address, prompts, concurrency):
    reqs = [request(ids, max_tokens=MAX_TOKENS, ignore_eos=True) for ids in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda r: generate(address, r), reqs))


def test_drafter_reports_its_feature_layers(stacks):
    split, _ = stacks
    assert tuple(service_info(split.procs["drafter"].address, "drafter").feature_layers) == (0, 1, 1)


def test_drafter_builds_its_grammar_compiler_before_serving(stacks):
    """The drafter service's own compiler (the target's tokenizer) is built at start-up, not on the
    first grammar request, and the host memory it took is in its memory plan."""
    split, _ = stacks
    drafter = split.procs["drafter"]
    log = drafter.log_path.read_text(errors="replace")
    assert log.index("structured-output compiler ready") < log.index("health: SERVING")
    plan = json.loads(service_info(drafter.address, "drafter").memory_plan_json)["services"]["drafter"]
    assert plan["weights_bytes"] > 0 and plan["non_torch_bytes"] > 0, plan
    assert "memory plan [drafter]" in log and "(its grammar compiler)" in log


@pytest.mark.parametrize("concurrency", [1, 8])
def test_split_equals_colocated_equals_target(stacks, prompts, reference, target_logits, concurrency):
    split, colo = stacks
    batch = prompts[:8]
    s_out = _run(split.gateway, batch, concurrency)
    c_out = _run(colo.gateway, batch, concurrency)
    for ids, s, c in zip(batch, s_out, c_out):
        expected = reference(ids, MAX_TOKENS, ignore_eos=True)
        assert_greedy_equal_or_tie(expected, target_logits, s["token_ids"], prompt=ids)
        assert_greedy_equal_or_tie(expected, target_logits, c["token_ids"], prompt=ids)
        if concurrency == 1 and s["token_ids"] == c["token_ids"]:  # one stream: the same steps
            assert s["usage"]["proposed_draft_tokens"] == c["usage"]["proposed_draft_tokens"]
            assert s["usage"]["accepted_draft_tokens"] == c["usage"]["accepted_draft_tokens"]
    assert sum(r["usage"]["proposed_draft_tokens"] for r in s_out) > 0


@pytest.fixture(scope="module")
def constrained_reference(tiny_llama):
    """Target-only greedy tokens with a grammar (in-process), and its compiler."""
    from tests.helpers.structured import constrained_target

    with constrained_target(tiny_llama, MAX_TOKENS) as ref:
        yield ref


@pytest.fixture(scope="module")
def subset_split(tmp_path_factory, tiny_llama, tiny_head):
    """A split stack whose drafter process hosts tiny_head: a draft vocabulary of ids 3..199, so
    the large words (ids >= 200) that every other token of GRAMMAR must be are not in it."""
    split = start_split(tmp_path_factory.mktemp("fd-subset"), tiny_llama, tiny_head, gateway_extra=("--no-async-draft", *K))
    try:
        yield split.ready()
    finally:
        split.stop()


def test_split_with_a_grammar_equals_target_only(subset_split, prompts, constrained_reference, target_logits):
    """With a grammar the drafter process's head masks its drafts (its own compiler over the
    target's tokenizer, from the head's specsplit_base_model; the grammar comes with the drafter's
    add) and the output is the constrained target's. Where the grammar needs a large word the masked
    head has only the words that begin one (w2, w20 .. w23) and its chain often ends: about 1.2
    drafts a token here, where the unmasked head (before) drafts K = 3 every step (about 3 a token:
    nearly none is accepted). Until the drafter has compiled its first grammar (the tokenizer loads
    off its step thread) it drafts unmasked: the count is asserted once its log says it has."""
    from specsplit.sampling.params import SamplingParams
    from specsplit.v1 import common_pb2
    from tests.helpers.structured import constrained_next_logits
    from tests.unit.test_spec_structured import GRAMMAR

    run, compiler = constrained_reference
    params = SamplingParams(grammar=GRAMMAR)

    def generate_checked(ids):
        out = generate(subset_split.gateway, request(ids, max_tokens=MAX_TOKENS, grammar=common_pb2.Grammar(regex=GRAMMAR.text)))
        f = constrained_next_logits(target_logits, params, len(ids), compiler)
        assert_greedy_equal_or_tie(run(ids, params), f, out["token_ids"], prompt=ids)
        compiler.state(params.grammar).sync(out["token_ids"])  # in the grammar, token by token
        return out["usage"]["proposed_draft_tokens"], out["usage"]["accepted_draft_tokens"], len(out["token_ids"])

    generate_checked(prompts[0])  # its add starts the drafter's compile (drafts unmasked meanwhile)
    drafter = subset_split["drafter"]
    deadline = time.monotonic() + 120
    while "grammar compiled: regex" not in drafter.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the drafter never compiled the grammar:\n{drafter.log_tail()}"
        time.sleep(0.2)
    totals = [0, 0, 0]  # sequences added from now on draft masked from their first step
    for ids in prompts[1:7]:
        totals = [a + b for a, b in zip(totals, generate_checked(ids))]
    proposed, accepted, tokens = totals
    assert 0 < proposed <= 2 * tokens, totals  # a drafter late for its deadline only drafts less
    print(f"\ngrammar, subset head: {accepted}/{proposed} drafts accepted, {tokens} tokens")


def test_features_round_trip_the_wire():
    rows = torch.randn(5, 12)
    res = VerifyResult("s", 1, (3, 4), features=rows, features_start=7)
    (back,) = wire.results_from_pb(wire.results_to_pb([res]))
    assert back.features_start == 7 and torch.equal(back.features, rows.to(torch.bfloat16))
    req = ProposeRequest("s", (3,), 2, features=rows.to(torch.bfloat16), features_start=9)
    (back,) = wire.propose_from_pb(wire.propose_to_pb([req]))
    assert back.features_start == 9 and torch.equal(back.features, req.features)
    (plain,) = wire.propose_from_pb(wire.propose_to_pb([ProposeRequest("s", (3,), 2)]))
    assert plain.features is None
    # 2 bytes a value: what one committed position costs on the wire with SmolLM2's three layers
    assert len(wire.features_to_pb(torch.zeros(1, 3 * 576), 0).bf16) == 3456


def test_a_drafter_that_starts_after_the_gateway_gets_its_features(tmp_path, tiny_llama, head_dir, stacks, prompts,
                                                                  reference, target_logits):
    """A gateway whose drafter did not answer within --drafter-connect-timeout serves target-only and
    knows no feature layers. Once the drafter answers, the re-sync's GetInfo gives them, the
    verifier sends features with the steps, and the head drafts with the target's tokens."""
    stack = start_split(tmp_path, tiny_llama, f"{head_dir}+ngram",
                        gateway_extra=("--no-async-draft", "--drafter-connect-timeout", "1", *K))
    try:
        stack["drafter"].stop()  # the gateway is started while nothing listens on the drafter's port
        stack["gateway"].stop()
        stack["gateway"].start()
        stack["verifier"].wait_serving()
        stack["gateway"].wait_serving()
        before = _run(stack.gateway, prompts[:2], 1)  # target-only while the drafter is away
        assert all(r["usage"]["proposed_draft_tokens"] == 0 for r in before)
        stack["drafter"].start()
        stack["drafter"].wait_serving()
        # The steps probe it off the step thread (spec/drafter_health.py): requests keep coming
        # until one of them drafts, then the rest run with it
        joined, deadline = [], time.monotonic() + 60
        while not any(r["usage"]["proposed_draft_tokens"] for r in joined) and time.monotonic() < deadline:
            joined += _run(stack.gateway, prompts[2:3], 1)
        after = _run(stack.gateway, prompts[3:6], 1)
        for ids, r in zip(prompts[:2] + prompts[2:3] * len(joined) + prompts[3:6], before + joined + after):
            assert_greedy_equal_or_tie(reference(ids, MAX_TOKENS, ignore_eos=True), target_logits, r["token_ids"], prompt=ids)
        assert sum(r["usage"]["proposed_draft_tokens"] for r in after) > 0
        # Step for step what the colocated head drafts from the same features in memory
        _, colo = stacks
        for r, c in zip(after, _run(colo.gateway, prompts[3:6], 1)):
            if r["token_ids"] == c["token_ids"]:
                assert r["usage"]["proposed_draft_tokens"] == c["usage"]["proposed_draft_tokens"]
                assert r["usage"]["accepted_draft_tokens"] == c["usage"]["accepted_draft_tokens"]
    finally:
        stack.stop()
