"""Tensor parallelism in-process: this test process is rank 0, one worker process is rank 1 (gloo).

TP=2 logits equal TP=1 logits within fp32 rounding for every way a model splits (KV heads split
evenly, unevenly, replicated; Qwen2's qkv bias and tied head); greedy decoding at TP=2, target-only
and speculative, equals transformers' fp32 greedy with every difference a certified near-tie; the
plan reports every rank; a budget that is too small is refused with every rank's numbers; no worker
outlives its group.
"""
from __future__ import annotations

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated, build_draft_engine, build_target_engine
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.kv.profiler import MemoryBudgetError
from specsplit.models.runner import ForwardItem
from specsplit.parallel.group import TPGroup
from specsplit.parallel.tensor_parallel import check_shardable, local_heads
from specsplit.spec import SpecDecoder
from tests.helpers.greedy import assert_greedy_equal_or_tie, hf_next_logits
from tests.helpers.orphans import assert_gone, tp_workers
from tests.helpers.tiny_models import write_tiny_model

MAX_LEN = 128
# fp32 rounding: the partial sums of a row-parallel layer add in another order, so logits differ by
# a few ulps of their magnitude (the tied Qwen2 head gives logits ~60, ulp 4e-6): 1e-5 absolute
# plus 1e-6 relative (~8 ulps); measured: at most 1.9e-5 at a logit of 57.
ATOL, RTOL = 1e-5, 1e-6


def _cfg(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), max_model_len=MAX_LEN, max_num_seqs=4, max_prefill_tokens=64,
                        memory_budget_bytes=kw.pop("budget", 2 << 30), **kw)


@pytest.fixture
def launch():
    """launch(cfg, k=2, world=2) -> (group, engine, plan); every group is closed and its workers
    checked gone at teardown, also when the test failed."""
    groups: list[TPGroup] = []

    def start(cfg, k=2, world=2):
        group, engine, plan = TPGroup.launch(cfg, SpecConfig(num_speculative_tokens=k), world, threads=1)
        groups.append(group)
        return group, engine, plan

    yield start
    for g in groups:
        pids = [p.pid for p in g.procs]
        g.close()
        assert_gone(pids)


def _tp1(cfg, k=2):
    return build_target_engine(cfg, SpecConfig(num_speculative_tokens=k)).engine


def _assert_same_logits(tp, ref, items_per_step):
    for items in items_per_step:
        a, b = tp.runner.forward(items), ref.runner.forward(items)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=RTOL)


def _steps():
    """Prefill of mixed lengths, decode, a verify-shaped step, mixed q lengths, re-feed after rollback."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, 256, (n,), generator=g).tolist()

    p = [ids(n) for n in (1, 9, 30)]
    return [
        [ForwardItem(f"s{i}", 0, x, num_logits=len(x)) for i, x in enumerate(p)],
        [ForwardItem(f"s{i}", len(x), ids(1)) for i, x in enumerate(p)],
        [ForwardItem(f"s{i}", len(x) + 1, ids(3), num_logits=3) for i, x in enumerate(p)],
        [ForwardItem("s0", 5, ids(1)), ForwardItem("s1", 13, ids(2), 2), ForwardItem("s3", 0, ids(7), 7)],
        [ForwardItem("s2", 31, ids(4), 4)],  # rolls s2 back from 34 tokens to 31 and re-feeds
    ]


@pytest.mark.parametrize("shape", [
    dict(),  # 4 heads, 2 KV heads: one KV head per rank
    dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48),  # uneven: 2 + 1 KV heads
    dict(num_key_value_heads=1),  # fewer KV heads than ranks: replicated, query heads split
    dict(arch="qwen2", tie_word_embeddings=True),  # qkv bias, tied head
])
def test_tp2_logits_equal_tp1(tmp_path, launch, shape):
    shape = dict(shape)
    arch = shape.pop("arch", "llama")
    path = write_tiny_model(tmp_path / "m", arch, seed=3, **shape)
    cfg = _cfg(path)
    _, tp, _ = launch(cfg)
    _assert_same_logits(tp, _tp1(cfg), _steps())


def test_plan_reports_every_rank(tiny_llama, launch):
    cfg = _cfg(tiny_llama)
    group, tp, plan = launch(cfg)
    ref_plan = build_target_engine(cfg, SpecConfig(num_speculative_tokens=2)).plan.to_dict()["services"]["verifier"]
    d = plan.to_dict()
    ranks = d["tensor_parallel"]["ranks"]
    assert d["tensor_parallel"]["size"] == 2 and len(ranks) == 2
    for r in ranks:
        sp = r["services"]["verifier"]
        assert sp["kv_bytes_per_block"] * 2 == ref_plan["kv_bytes_per_block"]  # half the KV heads each
        assert 0 < sp["weights_bytes"] < ref_plan["weights_bytes"]
        assert sp["num_blocks"] == tp.runner.block_manager.num_blocks
        assert sp["budget_bytes"] <= (2 << 30) // 2  # a CPU host's budget is shared by the ranks
    assert d["services"]["verifier"] == ranks[0]["services"]["verifier"]
    assert any("rank 1/2" in line for line in plan.log_lines())
    assert len(tp_workers()) >= 1 and all(p.poll() is None for p in group.procs)


def test_budget_refusal_has_every_ranks_numbers(tiny_llama):
    cfg = _cfg(tiny_llama, budget=1 << 20)  # 512 KiB per rank: not even the weights and one sequence
    before = set(tp_workers())
    with pytest.raises(MemoryBudgetError) as err:
        TPGroup.launch(cfg, SpecConfig(num_speculative_tokens=2), 2, threads=1)
    msg = str(err.value)
    assert "rank 0" in msg and "rank 1" in msg and "KiB" in msg, msg
    assert_gone(set(tp_workers()) - before)


def test_unshardable_models_are_refused_with_the_reason():
    from specsplit.config import ModelConfig

    cfg = ModelConfig("llama", 256, 64, 128, 2, num_heads=6, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="6 query heads must divide by 4"):
        check_shardable(cfg, 4)
    check_shardable(cfg, 2)
    # SmolLM2-135M's shape: 9 query heads, 3 KV heads over 2 ranks -> 6 + 3 query heads, 2 + 1 KV heads
    smol = ModelConfig("llama", 49152, 576, 1536, 30, num_heads=9, num_kv_heads=3, head_dim=64)
    assert [tuple(map(len, local_heads(smol, r, 2))) for r in range(2)] == [(6, 2), (3, 1)]


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_tp2_greedy_target_only_and_speculative_equal_hf(tiny_llama, tiny_draft_close, hf_tiny, launch):
    cfg = _cfg(tiny_llama)
    _, tp, _ = launch(cfg, k=3)
    g = torch.Generator().manual_seed(11)
    prompts = []
    for _ in range(4):
        base = torch.randint(3, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append((base * 3)[: 3 * len(base)])
    n = 24
    requests = [GenerationRequest(f"r{i}", tuple(p), n, ignore_eos=True) for i, p in enumerate(prompts)]
    draft = build_draft_engine(_cfg(tiny_draft_close), SpecConfig(num_speculative_tokens=3)).engine
    runs = {
        "target-only": SpecDecoder(tp, None, SpecConfig(num_speculative_tokens=0), MAX_LEN),
        "speculative": SpecDecoder(tp, draft, SpecConfig(num_speculative_tokens=3), MAX_LEN),
    }
    ref = [_hf_greedy(hf_tiny, p, n) for p in prompts]
    for name, decoder in runs.items():
        states = Scheduler(decoder, (2,), 4).run(requests)
        for p, r, s in zip(prompts, ref, states):
            assert_greedy_equal_or_tie(r, hf_next_logits(hf_tiny), s.output, prompt=p)
        if name == "speculative":
            assert sum(s.accepted for s in states) > 0
        assert tp.runner.block_manager.num_free_blocks == tp.runner.block_manager.num_blocks


def test_close_stops_workers_and_a_dead_worker_fails_the_group(tiny_llama, launch):
    import os
    import signal
    import time

    from specsplit.parallel.group import TPWorkerFailed, is_group_failure

    group, tp, _ = launch(_cfg(tiny_llama))
    seen = []
    group.on_failure.append(seen.append)
    os.kill(group.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:  # the forward fails: nothing hangs in a collective
        for _ in range(100):
            tp.runner.forward([ForwardItem("x", 0, [5, 6, 7])])
            time.sleep(0.05)
    assert time.monotonic() - t0 < 5.0
    assert is_group_failure(group, err.value)
    assert group.failed and "rank 1" in group.failed and seen == [group.failed]
    with pytest.raises(TPWorkerFailed):
        tp.runner.forward([ForwardItem("y", 0, [5])])


def test_a_worker_that_cannot_start_fails_the_launch_at_once(tiny_llama, monkeypatch):
    import sys
    import time

    from specsplit.parallel.group import TPWorkerFailed

    monkeypatch.setattr(sys, "executable", "/bin/false")  # the worker process exits at once
    t0 = time.monotonic()
    with pytest.raises((TPWorkerFailed, OSError)):
        TPGroup.launch(_cfg(tiny_llama), SpecConfig(num_speculative_tokens=2), 2, threads=1)
    assert time.monotonic() - t0 < 10.0


def test_tp2_colocated_k_policy_auto_is_calibrated_across_the_group(tiny_llama, tiny_draft_close):
    """The tensor-parallel colocated server assembles its decoder as the one-device one does: with
    --k-policy auto the verifier's step costs are timed across the group (rank 0 drives every
    calibration forward on all ranks) and the K policy prices steps from them; it used to fall back
    to a fixed K silently."""
    spec = SpecConfig(num_speculative_tokens=3, k_policy="auto")
    colo = build_colocated(_cfg(tiny_llama, tensor_parallel_size=2), _cfg(tiny_draft_close), spec, show_progress=False)
    group = colo.target.tensor_parallel
    pids = [p.pid for p in group.procs]
    try:
        assert colo.target.step_costs is not None and colo.target.step_costs.verify
        assert colo.decoder.policy is not None
        assert colo.decoder.policy.costs.verify == colo.target.step_costs.verify
        # the draft masks with the verifier's compiler (one compiler, one cache), as on one device
        assert colo.target.grammars is not None and colo.drafter.grammars is colo.target.grammars
        (state,) = Scheduler(colo.decoder, colo.eos_token_ids, 4).run(
            [GenerationRequest("r0", (5, 6, 7, 5, 6, 7, 5, 6), 12, ignore_eos=True)])
        assert len(state.output) == 12
    finally:
        colo.close()
        group.close()
        assert_gone(pids)
