"""Structured output and penalties stay lossless under speculation (greedy, fp32, tiny pairs):
speculative output == target-only output with the same grammar / penalties / logit_bias, token for
token, for a close model draft (its drafts often leave the grammar: cut) and the n-gram proposer;
a difference only at a certified near-tie of the *constrained* target (tests/helpers/greedy.py with
the penalties and the grammar's mask applied to the reference's logits)."""
from __future__ import annotations

import re

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.protocols import SeqAdd, VerifyRequest
from specsplit.request import GenerationRequest
from specsplit.sampling.params import Grammar, SamplingParams
from specsplit.scheduler import Scheduler
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.helpers.structured import constrained_next_logits

MAX_LEN = 128
# The tiny tokenizer's words are w0 .. w252 (ids 3 .. 255); the output must alternate a small and a
# large word: a regex the random target would never follow on its own. (A small word then "w23",
# which only begins a large one, is a dead end: the output stops there, with the target alone too.)
WORDS_A = [f"w{i}" for i in range(0, 40)]
WORDS_B = [f"w{i}" for i in range(200, 240)]
REGEX = f"(({'|'.join(WORDS_A)}) ({'|'.join(WORDS_B)}) )*"
GRAMMAR = Grammar("regex", REGEX.replace(" ", ""))
PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias=((40, 4.0), (41, -100.0)))

CASES = {
    "grammar": SamplingParams(grammar=GRAMMAR),
    "penalties": SamplingParams(**PENALTIES),
    "both": SamplingParams(grammar=GRAMMAR, **PENALTIES),
}


def _requests(params: SamplingParams, n: int = 4, max_tokens: int = 20) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (4 + i,), generator=g).tolist()
        prompt = (base * 3)[: 6 + 3 * i]  # repetitive: the n-gram proposer finds something
        out.append(GenerationRequest(f"r{i}", tuple(prompt), max_tokens, params=params))
    return out


def _run(target, draft, k, requests):
    tc = EngineConfig(model=str(target), max_model_len=MAX_LEN, max_num_seqs=8)
    dc = None if draft is None or draft == "ngram" else EngineConfig(model=str(draft), max_model_len=MAX_LEN, max_num_seqs=8)
    colo = build_colocated(tc, dc if draft != "ngram" else EngineConfig(model="ngram", max_model_len=MAX_LEN),
                           SpecConfig(num_speculative_tokens=k), show_progress=False)
    states = Scheduler(colo.decoder, colo.eos_token_ids, 8).run(requests)
    bm = colo.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "target KV blocks leaked"
    return [s.output for s in states], sum(s.proposed for s in states), sum(s.accepted for s in states), colo


@pytest.fixture(scope="module")
def references(tiny_llama):
    out = {}
    for name, params in CASES.items():
        tokens, _, _, colo = _run(tiny_llama, None, 0, _requests(params))
        out[name] = tokens
        out["compiler"] = colo.target.grammars
        out["tokenizer"] = colo.tokenizer
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("draft, k", [("close", 4), ("ngram", 3)])
def test_speculative_equals_target_only(tiny_llama, tiny_draft_close, tiny_llama_logits, references, case, draft, k):
    params = CASES[case]
    reqs = _requests(params)
    out, proposed, accepted, _ = _run(tiny_llama, tiny_draft_close if draft == "close" else "ngram", k, reqs)
    assert proposed > 0, "the drafter never proposed: nothing was tested"
    if draft == "close" and case != "both":  # the model drafter applies the same rules: most drafts agree
        assert accepted / proposed > 0.4, (accepted, proposed)
    for req, o, r in zip(reqs, out, references[case]):
        f = constrained_next_logits(tiny_llama_logits, params, len(req.prompt_token_ids), references["compiler"])
        assert_greedy_equal_or_tie(r, f, o, prompt=req.prompt_token_ids)
    if params.grammar is not None:  # and the output follows the grammar: a fresh matcher takes it all
        for o in out:
            references["compiler"].state(params.grammar).sync(o)  # GrammarError on a token outside it
        words = " ".join(references["tokenizer"].decode([t]) for t in out[0] if t != 2)
        assert re.fullmatch(r"(w\d+ ?)+", words)
    if "logit_bias" in PENALTIES and params.logit_bias:
        assert all(41 not in o for o in out), "a token biased by -100 was emitted"


def test_grammar_cuts_drafts_on_the_verifier(tiny_llama):
    """A draft the grammar refuses is cut where it leaves the grammar: greedy drops it (the masked
    target's own token is emitted there), a sampled sequence keeps it as a surely rejected draft."""
    colo = build_colocated(EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=2), None,
                           SpecConfig(num_speculative_tokens=0), show_progress=False)
    eng = colo.target
    a, b = 3 + 5, 3 + 210  # w5 (small), w210 (large)
    eng.add([SeqAdd("g", (5, 6, 7), SamplingParams(grammar=GRAMMAR))])
    (res,) = eng.verify([VerifyRequest("g", (a, b, b, a))])  # the third draft leaves the grammar
    assert res.num_accepted <= 2 and len(res.token_ids) == res.num_accepted + 1
    st = eng.seqs["g"].grammar
    st.sync(res.token_ids)  # every emitted token is in the grammar
    eng.add([SeqAdd("s", (5, 6, 7), SamplingParams(temperature=1.0, grammar=GRAMMAR))])
    cut, _ = eng._constrain([VerifyRequest("s", (a, b, b, a), (0.5, 0.5, 0.5, 0.5))], [eng.seqs["s"]])
    assert cut[0].draft_token_ids == (a, b, b) and cut[0].draft_probs == (0.5, 0.5, 0.5)
    cut, masks = eng._constrain([VerifyRequest("g", (0, a))], [eng.seqs["g"]])  # <unk> is never in it
    assert cut[0].draft_token_ids == () and masks[0].shape[0] == 1
    colo.close()


def test_resumed_sequence_matcher_takes_its_generated_tokens(tiny_llama):
    """A preempted sequence comes back with prompt + output (SeqAdd.generated): its matcher and its
    penalties count the output as generated, so it continues exactly as if never preempted."""
    colo = build_colocated(EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=2), None,
                           SpecConfig(num_speculative_tokens=0), show_progress=False)
    eng = colo.target
    params = SamplingParams(grammar=GRAMMAR, **PENALTIES)
    eng.add([SeqAdd("x", (5, 6, 7), params)])
    emitted = []
    for _ in range(5):
        (res,) = eng.verify([VerifyRequest("x")])
        emitted += res.token_ids
    eng.add([SeqAdd("y", (5, 6, 7) + tuple(emitted[:3]), params, generated=3)])
    resumed = list(emitted[:3])
    for _ in range(2):
        (res,) = eng.verify([VerifyRequest("y")])
        resumed += res.token_ids
    assert resumed == emitted
    colo.close()


@pytest.mark.parametrize("vocab", [256, 200], ids=["full-vocab", "subset-vocab"])
def test_eagle3_head_drafts_inside_the_grammar(tiny_llama, tiny_llama_logits, references, tmp_path, vocab):
    """The EAGLE-3 feature drafter masks its drafts with the request's grammar (colocated, the
    verifier's compiler): every chain it proposes is one the grammar takes after the output so far,
    and the output is still the target's. With a draft vocabulary that lacks the grammar's next
    tokens (ids >= 200 here: the large words), the chain ends there instead."""
    from tests.helpers.eagle3 import write_tiny_head

    head = write_tiny_head(tmp_path, torch.arange(3, vocab))
    params = CASES["grammar"]
    reqs = _requests(params)
    tc = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=8)
    colo = build_colocated(tc, EngineConfig(model=str(head), max_model_len=MAX_LEN, max_num_seqs=8),
                           SpecConfig(num_speculative_tokens=3, k_policy="fixed"), show_progress=False)
    fd = colo.drafter
    assert fd.grammars is colo.target.grammars
    chains, _ = _record_chains(fd)
    states = Scheduler(colo.decoder, colo.eos_token_ids, 8).run(reqs)
    assert sum(s.proposed for s in states) > 0 and chains
    _assert_inside_the_grammar_and_exact(chains, reqs, states, params, references, tiny_llama_logits)
    colo.close()


def test_eagle3_head_stops_inside_the_grammar_where_unsure(tiny_llama, tiny_llama_logits, references, tmp_path):
    """SpecConfig.draft_stop with a grammar: the head's greedy chain ends where the product of the
    masked distribution's top-1 probabilities falls below the threshold, as without one (before the
    twenty-second session a request with a grammar always drafted the step's K). At 1.0 only forced
    tokens (one allowed, top-1 probability 1) extend a chain past its first draft; the output is the
    constrained target's either way."""
    from tests.helpers.eagle3 import write_tiny_head

    head = write_tiny_head(tmp_path, torch.arange(3, 256))
    params = CASES["grammar"]
    proposed = {}
    for stop in (0.0, 1.0):
        reqs = _requests(params)
        tc = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=8)
        colo = build_colocated(tc, EngineConfig(model=str(head), max_model_len=MAX_LEN, max_num_seqs=8),
                               SpecConfig(num_speculative_tokens=3, k_policy="fixed", draft_stop=stop), show_progress=False)
        assert colo.drafter.stop_below == stop
        chains, _ = _record_chains(colo.drafter)
        states = Scheduler(colo.decoder, colo.eos_token_ids, 8).run(reqs)
        _assert_inside_the_grammar_and_exact(chains, reqs, states, params, references, tiny_llama_logits)
        proposed[stop] = (sum(s.proposed for s in states), sum(s.speculative_steps for s in states))
        colo.close()
    assert proposed[1.0][0] < proposed[0.0][0] * proposed[1.0][1] / proposed[0.0][1], proposed  # fewer drafts a step


def test_eagle3_head_reads_the_grammar_mask_on_its_draft_vocabulary(tiny_llama, tmp_path):
    """A greedy draft under a grammar masks the head's draft-vocabulary logits only
    (FeatureDrafter._allowed), not [V] logits: the tokens it allows are exactly those the whole
    vocabulary's mask (apply_masks) leaves finite, on random bitmasks (bit 31 set included)."""
    from specsplit.sampling.grammar import apply_masks
    from tests.helpers.eagle3 import write_tiny_head

    head = write_tiny_head(tmp_path, torch.arange(3, 200))
    tc = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=8)
    colo = build_colocated(tc, EngineConfig(model=str(head), max_model_len=MAX_LEN, max_num_seqs=8),
                           SpecConfig(num_speculative_tokens=3, k_policy="fixed"), show_progress=False)
    fd = colo.drafter
    vocab = fd.vocab_size
    gen = torch.Generator().manual_seed(0)
    for density in (0.02, 0.5, 0.98):
        bits = torch.rand(vocab, generator=gen) < density
        words = torch.zeros(-(-vocab // 32), dtype=torch.int64)
        for i in torch.nonzero(bits).flatten().tolist():
            words[i // 32] |= 1 << (i % 32)
        mask = (words - (words >= 2**31) * 2**32).to(torch.int32).view(1, -1)  # int32 words, as the compiler fills them
        full = torch.zeros(1, vocab)
        apply_masks(full, mask)
        assert torch.equal(fd._allowed(mask), torch.isfinite(full[0, fd.head.draft_ids]))
        assert torch.equal(fd._allowed(mask), bits[fd.head.draft_ids])
    colo.close()


def _record_chains(fd) -> tuple[list, list]:
    """Wraps a feature drafter's propose: (each proposed sequence's output + chain after the call,
    whether it had a draft grammar), filled as it drafts."""
    chains, with_grammar = [], []
    propose = fd.propose

    def recording(preqs):
        out = propose(preqs)
        for r in preqs:
            s = fd.seqs[r.seq_id]
            chains.append(s.tokens[s.prompt_len:] + s.drafted)
            with_grammar.append(s.grammar is not None)
        return out

    fd.propose = recording
    return chains, with_grammar


def _assert_inside_the_grammar_and_exact(chains, reqs, states, params, references, next_logits):
    for chain in chains:
        references["compiler"].state(params.grammar).sync(chain)  # GrammarError on a draft outside it
    for req, s, r in zip(reqs, states, references["grammar"]):
        f = constrained_next_logits(next_logits, params, len(req.prompt_token_ids), references["compiler"])
        assert_greedy_equal_or_tie(r, f, s.output, prompt=req.prompt_token_ids)


def _service_engine(role: str, model, *flags: str):
    """An engine built as `specsplit drafter` / `specsplit verifier` builds it (rpc/build.py, its
    own process's way: a drafter with no verifier beside it)."""
    from specsplit.cli import build_parser
    from specsplit.rpc.build import build_engine

    args = build_parser().parse_args([role, "--model", str(model), "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8",
                                      "--num-speculative-tokens", "3", "--k-policy", "fixed", *flags])
    return build_engine(args, role).engine


def _split_run(tiny_llama, draft: str, reqs, masked: bool):
    """The drafter service's feature drafter (its own compiler) and the verifier service's engine
    behind one SpecDecoder: (states, the head's chains after each propose, its draft grammars seen)."""
    from specsplit.factory import colocated_decoder
    from specsplit.feature_drafter import FeatureDrafter

    drafter = _service_engine("drafter", draft, "--draft-stop", "0")
    fd = getattr(drafter, "model", drafter)  # MODEL+ngram: the head behind the lookup
    assert isinstance(fd, FeatureDrafter) and fd.grammars is not None
    if masked:  # compiled before the run (a drafter never waits for a compile: unmasked until it is done)
        fd.grammars.compile(GRAMMAR)
    else:
        fd.grammars = None  # as before: the drafter service's head had no compiler
    target = _service_engine("verifier", tiny_llama)
    chains, with_grammar = _record_chains(fd)
    decoder = colocated_decoder(target, drafter, SpecConfig(num_speculative_tokens=3, k_policy="fixed"), MAX_LEN)
    states = Scheduler(decoder, tuple(target.runner.model.cfg.eos_token_ids), 8).run(reqs)
    assert fd.num_running == 0 and target.num_running == 0
    return states, chains, with_grammar


@pytest.mark.parametrize("vocab, hybrid", [(256, False), (256, True), (200, False)],
                         ids=["full-vocab", "full-vocab+ngram", "subset-vocab"])
def test_eagle3_head_on_a_drafter_service_drafts_inside_the_grammar(tiny_llama, tiny_llama_logits, tiny_head, references,
                                                                     tmp_path, vocab, hybrid):
    """A drafter service's EAGLE-3 head (no verifier beside it) compiles the request's grammar with
    its target's tokenizer and config (the head's `specsplit_base_model`): the grammar reaches it
    through the drafter's add (behind prompt lookup too), every chain it drafts is one the grammar
    takes, and the output is still the constrained target's. Acceptance with and without the
    drafter's mask is printed (docs/structured-output.md), not asserted."""
    from tests.helpers.eagle3 import write_tiny_head

    head = tiny_head if vocab == 200 else write_tiny_head(tmp_path, torch.arange(3, vocab),
                                                          extra_json={"specsplit_base_model": str(tiny_llama)})
    params = CASES["grammar"]
    reqs = _requests(params)
    draft = f"{head}+ngram" if hybrid else str(head)
    states, chains, with_grammar = _split_run(tiny_llama, draft, reqs, masked=True)
    assert sum(s.proposed for s in states) > 0 and chains and all(with_grammar)
    _assert_inside_the_grammar_and_exact(chains, reqs, states, params, references, tiny_llama_logits)
    unmasked, _, _ = _split_run(tiny_llama, draft, _requests(params), masked=False)
    print(f"\n{draft.rsplit('/', 1)[-1]}: drafter-side mask {sum(s.accepted for s in states)}/"
          f"{sum(s.proposed for s in states)} drafts accepted, unmasked "
          f"{sum(s.accepted for s in unmasked)}/{sum(s.proposed for s in unmasked)}")


def test_feature_grammars_without_a_base_model(tiny_llama, tmp_path, caplog):
    """A head whose config names no base model (or one that cannot be read) gets no compiler: one
    line in the log, drafted unmasked as before (load_feature_drafter itself needs the embedding,
    so the drafter service cannot load such a head; this is the compiler's own fallback)."""
    from specsplit.factory import feature_grammars
    from tests.helpers.eagle3 import write_tiny_head

    bare = write_tiny_head(tmp_path / "bare", torch.arange(3, 256))
    gone = write_tiny_head(tmp_path / "gone", torch.arange(3, 256), extra_json={"specsplit_base_model": str(tmp_path / "nope")})
    with caplog.at_level("WARNING", logger="specsplit.factory"):
        assert feature_grammars(str(bare)) is None and feature_grammars(str(gone)) is None
    assert sum("no structured-output compiler" in r.message for r in caplog.records) == 2
    compiler = feature_grammars(str(write_tiny_head(tmp_path / "ok", torch.arange(3, 256),
                                                    extra_json={"specsplit_base_model": str(tiny_llama)})))
    assert compiler is not None and compiler.vocab_size == 256 and compiler._compiler is None  # the tokenizer: on first use
    compiler.state(CASES["grammar"].grammar)
    assert compiler.compiles == 1


def test_a_drafter_never_waits_for_a_compile(tiny_llama, tiny_head):
    """A drafter answers within the step's deadline, and a first compile (here: the tokenizer's
    table, held back until the test lets it load) takes longer: the sequence is added at once and
    drafts unmasked, then masked once its grammar is compiled; a grammar that does not compile is
    drafted unmasked (logged), never an error."""
    import threading

    from specsplit.engine import draft_grammar
    from specsplit.factory import grammar_compiler
    from specsplit.models.loader import load_tokenizer, model_config_from_hf
    import json

    gate = threading.Event()

    def slow_tokenizer():
        gate.wait(30)
        return load_tokenizer(tiny_llama)

    config = model_config_from_hf(json.loads((tiny_llama / "config.json").read_text()))
    compiler = grammar_compiler(slow_tokenizer, config)
    g = draft_grammar(compiler, "s", CASES["grammar"])
    assert g.mask([]) is None and g.pending is not None  # not compiled yet: unmasked, nothing waited for
    gate.set()
    g.pending.result(timeout=30)
    mask = g.mask([3 + 5])  # w5 (a small word): a large one must follow
    assert mask is not None and g.state is not None
    allowed = {t for t in range(256) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
    assert 3 + 210 in allowed and 3 + 5 not in allowed
    bad = draft_grammar(compiler, "b", SamplingParams(grammar=Grammar("regex", "(w1")))
    bad.pending.exception(timeout=30)
    assert bad.mask([]) is None and bad.state is None and bad.pending is None
