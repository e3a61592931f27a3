"""The EAGLE-3 feature drafter (specsplit.feature_drafter) behind the real SpecDecoder and engines.

A tiny random head over tiny_llama (written in the public EAGLE-3 layout, read back by the loader)
drafts from the target's captured layer outputs. Greedy output equals target-only at batches 1/4/16,
lockstep and pre-drafting, alone and with prompt lookup; sampled output keeps the target's
distribution (chi-square and TV on the joint of four tokens); features reach the drafter for every
committed position and none are kept while speculation is off; a drafter that loses its features
(a restart) re-syncs and the output does not change."""
from __future__ import annotations

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.feature_drafter import FeatureDrafter
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.protocols import SeqAdd
from specsplit.sampling.params import SamplingParams
from specsplit.spec import IDLE_FEATURE_ROWS
from tests.helpers.chisquare import joint_fit
from tests.helpers.eagle3 import write_tiny_head
from tests.helpers.greedy import assert_greedy_equal_or_tie
from tests.unit.test_spec_async_draft import NEW_TOKENS, NUM_SAMPLES, PARAMS, PROMPT, _joint
from tests.unit.test_spec_greedy_equality import MAX_LEN, _requests


def _colo(target, draft, k, max_num_seqs=16, async_draft=False, max_len=MAX_LEN):
    tc = EngineConfig(model=str(target), max_model_len=max_len, max_num_seqs=max_num_seqs)
    dc = EngineConfig(model=str(draft), max_model_len=max_len, max_num_seqs=max_num_seqs)
    return build_colocated(tc, dc, SpecConfig(num_speculative_tokens=k, async_draft=async_draft, k_policy="fixed"),
                           show_progress=False)


def _feature_drafter(colo) -> FeatureDrafter:
    d = colo.drafter
    return d.model if hasattr(d, "model") else d


def _assert_released(colo):
    bm = colo.target.block_manager
    assert colo.target.num_running == 0 and bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    fd = _feature_drafter(colo)
    assert fd.num_running == 0 and fd.cache_bytes() == 0 and fd.num_q_rows == 0
    assert all(s.step_features is None for s in colo.target.seqs.values())


@pytest.fixture(scope="module")
def reference(tiny_llama):
    cache = {}

    def get(batch):
        if batch not in cache:
            tc = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=16)
            colo = build_colocated(tc, None, SpecConfig(num_speculative_tokens=0), show_progress=False)
            cache[batch] = [s.output for s in Scheduler(colo.decoder, colo.eos_token_ids, 16).run(_requests(batch, seed=batch))]
            colo.close()
        return cache[batch]

    return get


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("hybrid,async_draft", [(False, False), (True, False), (False, True)],
                         ids=["lockstep", "+ngram", "pre-drafting"])
def test_feature_drafter_greedy_equals_target_only(tiny_llama, tiny_llama_logits, tiny_head, reference, batch,
                                                   hybrid, async_draft):
    colo = _colo(tiny_llama, f"{tiny_head}+ngram" if hybrid else tiny_head, 3, async_draft=async_draft)
    assert colo.decoder.feature_layers == (0, 1, 1)
    states = Scheduler(colo.decoder, colo.eos_token_ids, 16).run(_requests(batch, seed=batch))
    for req, s, ref in zip(_requests(batch, seed=batch), states, reference(batch)):
        assert_greedy_equal_or_tie(ref, tiny_llama_logits, s.output, prompt=req.prompt_token_ids)
    assert sum(s.proposed for s in states) > 0  # the head drafted (its first step has no features yet)
    _assert_released(colo)
    colo.close()


def test_features_reach_the_drafter_for_every_committed_position(tiny_llama, tiny_head):
    """After each step the drafter's committed entries cover every position the verifier
    committed (all but the last token): none missing, none twice."""
    colo = _colo(tiny_llama, tiny_head, 3, max_num_seqs=2)
    dec, fd = colo.decoder, _feature_drafter(colo)
    dec.add(SeqAdd("a", (5, 6, 7, 8, 9, 10)))
    dec.step()  # the prefill: no features yet, so no drafts; the verifier sends the prompt's
    for _ in range(8):
        dec.step()
        s, t = fd.seqs["a"], dec.tracks["a"]
        # this step's propose brought the previous step's features: every position before the
        # tokens it knew, but the last one (x_{t+1} is the entry's input token)
        known = len(t.tokens) - len(t.unsent)
        assert s.committed == s.next_pos == known - 1, (s.committed, s.next_pos, known)
    dec.release(["a"])
    colo.close()


def test_no_features_kept_while_speculation_is_off(tiny_llama, tiny_head):
    """disable_by_batch_size: past it the step never asks the drafter, and each sequence keeps at
    most IDLE_FEATURE_ROWS rows waiting (flat memory), however long it decodes."""
    tc = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=4)
    dc = EngineConfig(model=str(tiny_head), max_model_len=MAX_LEN, max_num_seqs=4)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=3, disable_by_batch_size=1, k_policy="fixed"),
                           show_progress=False)
    reqs = [GenerationRequest(f"r{i}", tuple(range(5, 5 + 90)), 60, ignore_eos=True) for i in range(2)]
    dec = colo.decoder
    for r in reqs:
        dec.add(SeqAdd(r.request_id, r.prompt_token_ids))
    for _ in range(40):
        dec.step()
        for t in dec.tracks.values():
            assert t.feature_rows <= IDLE_FEATURE_ROWS and sum(p.shape[0] for p in t.feat_pieces) == t.feature_rows
    assert _feature_drafter(colo).cache_bytes() == 0  # never asked: nothing computed drafter-side
    dec.release(list(dec.tracks))
    colo.close()


def test_drafter_restart_loses_features_output_unchanged(tiny_llama, tiny_llama_logits, tiny_head, reference):
    """Every few steps the drafter forgets every sequence (as a restarted service would); the step
    re-syncs it with tokens only, the head drafts again once the next verify brings features."""
    colo = _colo(tiny_llama, tiny_head, 3)
    dec, fd = colo.decoder, _feature_drafter(colo)
    dec.drafter_retry_s = 0.0
    real_propose, calls = fd.propose, [0]

    def forgetful(reqs):
        calls[0] += 1
        if calls[0] % 5 == 0:
            fd.seqs.clear()  # the restart: the next call fails (unknown sequence), then re-sync
        return real_propose(reqs)

    fd.propose = forgetful
    states = Scheduler(dec, colo.eos_token_ids, 16).run(_requests(4, seed=4))
    for req, s, ref in zip(_requests(4, seed=4), states, reference(4)):
        assert_greedy_equal_or_tie(ref, tiny_llama_logits, s.output, prompt=req.prompt_token_ids)
    assert calls[0] >= 10 and sum(s.proposed for s in states) > 0
    colo.close()


@pytest.mark.slow
def test_feature_drafter_sampling_keeps_the_target_distribution(tiny_llama, tmp_path):
    """Rejection sampling (no coupling) with the head's q over its draft vocabulary: the tokens the
    target can emit here plus a few it cannot (so q and p overlap often, and differ: accepts,
    rejections and residual draws all happen)."""
    joint = _joint(tiny_llama)
    support = sorted({t for key in joint for t in key} | {3, 4, 250})
    write_tiny_head(tmp_path / "head", support, seed=5)
    colo = _colo(tiny_llama, tmp_path / "head", 2, max_num_seqs=8, max_len=64)
    reqs = [GenerationRequest(f"r{i}", PROMPT, NEW_TOKENS, SamplingParams(seed=i, coupling=False, **PARAMS),
                              ignore_eos=True) for i in range(NUM_SAMPLES)]
    states = Scheduler(colo.decoder, colo.eos_token_ids, 8).run(reqs)
    pvalue, tv = joint_fit([s.output for s in states], joint)
    proposed, accepted = sum(s.proposed for s in states), sum(s.accepted for s in states)
    print(f"FIGURE feature drafter sampling: chi-square p {pvalue:.3g}, TV {tv:.4f}; accepted {accepted}/{proposed}")
    assert proposed > 1000 and 0 < accepted < proposed
    assert pvalue > 1e-3 and tv < 0.12, (pvalue, tv)
    _assert_released(colo)
    colo.close()


@pytest.mark.parametrize("stop", [0.0, 0.3, 1.0])
def test_a_greedy_chain_stops_where_the_head_is_unsure(tiny_llama, tiny_llama_logits, tiny_head, reference, stop):
    """SpecConfig.draft_stop: a greedy chain ends before the draft at which the product of the
    head's top-1 probabilities falls below it (one draft at least); output stays the target's."""
    from specsplit.draft_tree import runner_up
    from specsplit.protocols import ProposeRequest

    colo = _colo(tiny_llama, tiny_head, 3)
    fd = _feature_drafter(colo)
    fd.stop_below = stop
    states = Scheduler(colo.decoder, colo.eos_token_ids, 16).run(_requests(4, seed=4))
    for req, s, ref in zip(_requests(4, seed=4), states, reference(4)):
        assert_greedy_equal_or_tie(ref, tiny_llama_logits, s.output, prompt=req.prompt_token_ids)
    steps, proposed = sum(s.speculative_steps for s in states), sum(s.proposed for s in states)
    assert steps > 0
    if stop == 1.0:
        assert proposed == steps  # never sure enough for a second draft
    elif stop == 0.0:
        assert proposed > 2 * steps  # K = 3 but where the request's last tokens leave fewer
    # one chain, checked against the rule itself
    prompt = tuple(range(5, 30))
    fd.add([SeqAdd("c", prompt, SamplingParams())])
    feats = torch.randn(len(prompt), fd.feature_size)
    (p,) = fd.propose([ProposeRequest("c", (), 3, features=feats, features_start=0)])
    fd.release(["c"])
    fd.add([SeqAdd("c", prompt, SamplingParams())])
    fd.stop_below = 0.0
    (full,) = fd.propose([ProposeRequest("c", (), 3, features=feats, features_start=0)])
    fd.release(["c"])
    assert p.token_ids == full.token_ids[:len(p.token_ids)] and len(full.token_ids) == 3
    assert not fd.seqs
    colo2 = _colo(tiny_llama, tiny_head, 3)
    try:
        d = _feature_drafter(colo2)
        d.add([SeqAdd("c", prompt, SamplingParams())])
        d._commit_features(d.seqs["c"], feats, 0)
        h, sure, expect = d.seqs["c"].last_h, 1.0, 0
        seq = d.seqs["c"]
        for j, t in enumerate(full.token_ids):
            sure *= runner_up(d.head.logits(h)[0])[0]
            if j > 0 and sure < stop:
                break
            expect += 1
            h = d.head.extend(seq.cache, h, d._embed(torch.tensor([t])).to(h.dtype), seq.next_pos + j)
        assert len(p.token_ids) == expect
    finally:
        colo2.close()
    _assert_released(colo)
    colo.close()


def target_embedding(model_dir) -> torch.Tensor:
    """The target's token embedding [V, H], read from its checkpoint (what a drafter is given)."""
    from specsplit.models.loader import TensorSource, hf_dir_for

    src = TensorSource(hf_dir_for(str(model_dir), show_progress=False))
    try:
        return src.get("model.embed_tokens.weight")
    finally:
        src.close()


@pytest.mark.parametrize("mode", ["int8", "q8", "fp32"])
def test_head_layer_runs_on_q8_0_blocks_unless_told_not_to(tiny_llama, tiny_head, monkeypatch, mode):
    """On a CPU with the quant kernel the head's layer (fc, q|k|v, o, gate|up, down) and lm head run
    on Q8_0 blocks: with int8 activations (models/int8_linear; on every CPU, AMX included), with
    fp32 ones under SPECSPLIT_DRAFT_INT8=0; SPECSPLIT_DRAFT_Q8=0 keeps the layer fp32. The outputs stay
    within the roundings' reach of the fp32 head's, and the memory plan counts the bytes each holds."""
    from specsplit.feature_drafter import load_feature_drafter
    from specsplit.kernels import quant_linear
    from specsplit.kv.meters import tensor_storage_bytes
    from specsplit.models.eagle3 import DraftCache
    from specsplit.models.int8_linear import Int8Linear

    if quant_linear.load() is None:
        pytest.skip("no quant kernel on this CPU (it needs AVX2 + FMA + F16C and a compiler)")
    embedding = target_embedding(tiny_llama)
    monkeypatch.setenv("SPECSPLIT_DRAFT_Q8", "0")
    monkeypatch.setenv("SPECSPLIT_DRAFT_INT8", "0")
    monkeypatch.setenv("SPECSPLIT_HUGE_PAGES", "0")  # each linear's own bytes (the shared buffer: the next test)
    ref = load_feature_drafter(str(tiny_head), MAX_LEN, embedding=embedding).head
    monkeypatch.setenv("SPECSPLIT_DRAFT_Q8", "0" if mode == "fp32" else "1")
    monkeypatch.setenv("SPECSPLIT_DRAFT_INT8", "1" if mode == "int8" else "0")
    head = load_feature_drafter(str(tiny_head), MAX_LEN, embedding=embedding).head
    layer = head.midlayer
    linears = [head.fc, layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    assert all(isinstance(m, Int8Linear) == (mode == "int8") for m in linears + [head.head_linear])
    assert all((getattr(m, "quant", None) is not None) == (mode == "q8") for m in linears)
    ref_linears = [ref.fc, ref.midlayer.qkv_proj, ref.midlayer.o_proj, ref.midlayer.gate_up_proj, ref.midlayer.down_proj]
    fp32_bytes = sum(m.weight.numel() * 4 for m in ref_linears)
    # 34 bytes per 32 weights, plus the int8 copy's 4-byte bound per output row (16-row groups:
    # the tiny head's rows are multiples of 16)
    held = {"int8": lambda m: m.groups.numel() + m.cmax.numel() * 4, "q8": lambda m: m.quant_blocks.numel(),
            "fp32": lambda m: 0}[mode]
    expect = fp32_bytes * 34 // 128 + (sum(m.out_features for m in linears) * 4 if mode == "int8" else 0)
    assert sum(held(m) for m in linears) == (expect if mode != "fp32" else 0)
    # The memory plan's weights (tensor_storage_bytes): a Q8_0 linear holds its blocks (or their
    # int8 loop's copy) only; an fp32 one its weight and the CPU kernel's copy of it; the lm head is
    # Q8_0 in both (with fp32 or int8 activations); the rest of the head is the same.
    assert all(tensor_storage_bytes(r) >= r.weight.numel() * 4 for r in ref_linears)
    if mode != "fp32":
        assert [tensor_storage_bytes(m) for m in linears] == [held(m) for m in linears]
    assert tensor_storage_bytes(ref) - tensor_storage_bytes(head) == sum(
        tensor_storage_bytes(r) - tensor_storage_bytes(m)
        for r, m in zip(ref_linears + [ref.head_linear], linears + [head.head_linear]))

    torch.manual_seed(0)
    H = head.cfg.hidden_size
    feats, emb = torch.randn(9, 3 * H), torch.randn(9, H)
    outs = []
    for h in (ref, head):
        cache = DraftCache()
        h.extend(cache, h.fuse(feats[:6]), emb[:6], 0)
        outs.append(h.logits(h.extend(cache, h.fuse(feats[6:]), emb[6:], 6)))  # [3, draft_vocab]
    err = (outs[1] - outs[0]).abs().max().item()
    scale = outs[0].abs().max().item()
    if mode != "fp32":
        assert 0 < err < 0.05 * scale, (err, scale)
    else:
        assert err == 0


def test_int8_linears_share_one_huge_page_buffer(tiny_llama, tiny_head, monkeypatch):
    """Where huge pages are available the head's int8 linears read their copies from one buffer
    (in the order a step reads them), counted once by the memory meters, with the same outputs."""
    from specsplit.feature_drafter import load_feature_drafter
    from specsplit.kernels import quant_linear
    from specsplit.kv import huge_pages
    from specsplit.kv.meters import tensor_storage_bytes
    from specsplit.models.int8_linear import Int8Linear

    if quant_linear.load() is None:
        pytest.skip("no quant kernel on this CPU (it needs AVX2 + FMA + F16C and a compiler)")
    if not huge_pages.available():
        pytest.skip("no transparent huge pages here")
    embedding = target_embedding(tiny_llama)
    heads = {}
    for huge in ("0", "1"):
        monkeypatch.setenv("SPECSPLIT_HUGE_PAGES", huge)
        heads[huge] = load_feature_drafter(str(tiny_head), MAX_LEN, embedding=embedding).head
    plain, head = heads["0"], heads["1"]
    layer = head.midlayer
    linears = [head.fc, layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj, head.head_linear]
    assert all(isinstance(m, Int8Linear) for m in linears)
    storage = {m.groups.untyped_storage().data_ptr() for m in linears}
    assert len(storage) == 1  # one buffer
    starts = [m.groups.data_ptr() for m in linears]
    assert starts == sorted(starts) and all(s % huge_pages.PAGE == 0 for s in starts)  # step order, page-aligned
    buffer = linears[0].groups.untyped_storage().nbytes()
    copies = sum(m.groups.numel() for m in linears)
    assert copies <= buffer <= copies + huge_pages.HUGE_PAGE + len(linears) * huge_pages.PAGE
    assert tensor_storage_bytes(head) - tensor_storage_bytes(plain) == buffer - copies  # counted once
    torch.manual_seed(0)
    x = torch.randn(3, head.cfg.hidden_size)
    assert torch.equal(head.head_linear(x), plain.head_linear(x))
    assert torch.equal(layer.gate_up_proj(x), plain.midlayer.gate_up_proj(x))


def test_colocated_head_comes_off_the_joint_budget(tiny_llama, tiny_head):
    """Colocated, the EAGLE-3 head is loaded into the joint budget before the verifier's KV cache is
    sized: its weights (as the profiler measured them) and its KV caches at their bound (max_num_seqs
    x max_model_len rows) are in the plan's drafter row and come off what the verifier's cache gets;
    the head's caches never grow past that bound."""
    from specsplit.kv.meters import tensor_storage_bytes

    budget = 64 << 20  # small enough that the budget, not max_num_seqs, sizes the verifier's cache
    tc = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=4, memory_budget_bytes=budget,
                      kv_cap=False)
    dc = EngineConfig(model=str(tiny_head), max_model_len=MAX_LEN, max_num_seqs=4)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=3, k_policy="fixed"), show_progress=False)
    try:
        plan, fd = colo.plan, _feature_drafter(colo)
        head, ver = plan.services["drafter"], plan.services["verifier"]
        assert plan.joint and head.kv_limited_by == "none"
        assert head.weights_bytes == tensor_storage_bytes(fd.head) > 0
        per_token = FeatureDrafter.cache_bytes_per_token(fd.head, torch.float32)
        assert head.activation_peak_bytes == fd.cache_bound_bytes(4) == 4 * MAX_LEN * per_token > 0
        fixed = sum(p.weights_bytes + p.activation_peak_bytes + p.non_torch_bytes for p in plan.services.values())
        assert ver.kv_limited_by == "budget" and ver.kv_available_bytes == budget - fixed
        assert ver.kv_cache_bytes <= budget - fixed and sum(p.used_bytes for p in plan.services.values()) <= budget
        assert "draft 0 B" not in " ".join(plan.log_lines())
        # one sequence's head cache at max_model_len rows holds no more than its share of the bound
        fd.add([SeqAdd("s", list(range(3, 3 + 8)), SamplingParams())])
        cache = fd.seqs["s"].cache
        H = fd.head.cfg
        for _ in range(MAX_LEN):
            cache.append(torch.zeros(1, H.num_key_value_heads, H.hd), torch.zeros(1, H.num_key_value_heads, H.hd))
        assert len(cache) == MAX_LEN and cache.nbytes() == MAX_LEN * per_token
        fd.release(["s"])
    finally:
        colo.close()


def test_draft_cache_doubles_up_to_its_limit_and_past_it_only_as_needed():
    from specsplit.models.eagle3 import DraftCache

    kv = lambda n: (torch.zeros(n, 2, 4), torch.zeros(n, 2, 4))  # noqa: E731
    c = DraftCache(limit=100)
    c.append(*kv(70))
    assert c.k.shape[0] == 70  # the first allocation: max(64, need)
    c.append(*kv(1))
    assert c.k.shape[0] == 100  # doubling stops at the limit
    c.append(*kv(40))
    assert len(c) == 111 and c.k.shape[0] == 111  # past it: exactly what is needed
    assert torch.equal(c.keys(), torch.zeros(111, 2, 4))
    free = DraftCache()
    free.append(*kv(70))
    free.append(*kv(1))
    assert free.k.shape[0] == 140
