"""An EAGLE-3 head served alone (a drafter service, `specsplit profile`): it holds its target's
token embedding itself, so its memory plan counts it, and a GGUF target's embedding is kept as the
file's quantized rows, the very numbers the colocated head (which shares the target's module) looks up."""
from __future__ import annotations

import logging

import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_draft_engine, plan_memory
from specsplit.feature_drafter import FeatureDrafter, base_embedding, calibrate_feature_drafter, load_feature_drafter
from specsplit.kv.meters import tensor_storage_bytes
from specsplit.models.gguf_native import QuantEmbedding
from specsplit.models.loader import TensorSource, hf_dir_for
from tests.helpers.gguf import NEEDS_GGUF, NEEDS_QUANT_KERNEL
from tests.unit.test_spec_greedy_equality import MAX_LEN

SPEC = SpecConfig(num_speculative_tokens=3, k_policy="auto")


def _head_of(engine) -> FeatureDrafter:
    return engine.model if hasattr(engine, "model") else engine


def test_a_drafter_services_plan_counts_the_embedding_it_holds(tiny_llama, tiny_head, caplog):
    caplog.set_level(logging.INFO, logger="specsplit.kv.profiler")
    cfg = EngineConfig(model=str(tiny_head), max_model_len=MAX_LEN, max_num_seqs=4)
    engine, plan = build_draft_engine(cfg, SPEC)
    fd = _head_of(engine)
    row = plan.services["drafter"]
    emb = fd.embedding
    assert isinstance(emb, torch.Tensor) and tuple(emb.shape) == (256, fd.head.cfg.hidden_size)  # tiny_llama: dense
    assert row.weights_bytes == tensor_storage_bytes(fd.head) + emb.untyped_storage().nbytes()
    assert emb.untyped_storage().nbytes() >= emb.numel() * 4 > 0
    assert "the target's embedding" in row.weights and "(float32)" in row.weights
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan [drafter]"))
    assert f"[{row.weights}]" in line
    assert fd.step_costs is not None  # a service calibrates for the K policy


def test_profile_plans_a_split_head_with_its_weights(tiny_llama, tiny_head):
    """`specsplit profile` (split): the head is loaded for its numbers (it read 'no weights, no KV
    cache' before), not calibrated, and nothing stays allocated."""
    target = EngineConfig(model=str(tiny_llama), max_model_len=MAX_LEN, max_num_seqs=4, memory_budget_bytes=64 << 20)
    draft = EngineConfig(model=str(tiny_head), max_model_len=MAX_LEN, max_num_seqs=4)
    plan = plan_memory(target, draft, SPEC, colocated=False)
    row = plan.services["drafter"]
    head = load_feature_drafter(str(tiny_head), MAX_LEN)
    assert row.weights_bytes == tensor_storage_bytes(head.head) + head.embedding.untyped_storage().nbytes()
    assert row.activation_peak_bytes == head.cache_bound_bytes(4) > 0
    line = next(x for x in plan.log_lines() if x.startswith("memory plan [drafter]"))
    assert "no weights" not in line and "a KV cache per sequence as it grows" in line


@NEEDS_GGUF
@NEEDS_QUANT_KERNEL
def test_a_service_head_keeps_a_gguf_targets_embedding_as_its_blocks():
    rows = base_embedding("smollm2-135m", "cpu", torch.float32)
    assert isinstance(rows, QuantEmbedding) and rows.quant.qtype == "Q8_0"
    src = TensorSource(hf_dir_for("smollm2-135m", show_progress=False))
    try:
        dense = src.get("model.embed_tokens.weight")  # [V, H] the dequantized directory's
    finally:
        src.close()
    assert torch.equal(rows.weight, dense)  # the same numbers
    ids = torch.tensor([0, 5, 9690, 49151])
    assert torch.equal(rows(ids), dense[ids])
    assert tensor_storage_bytes(rows) < 0.3 * dense.numel() * 4  # Q8_0: 34 bytes a block of 32
    # the served head and one built over the dense rows (the colocated fp32 path) are the same function
    served = load_feature_drafter("smollm2-135m-eagle3", 256)
    over_dense = load_feature_drafter("smollm2-135m-eagle3", 256, embedding=dense)
    assert isinstance(served.embedding, QuantEmbedding)
    torch.manual_seed(0)
    x = torch.randn(2, served.head.cfg.hidden_size)
    assert torch.equal(served.head.logits(x), over_dense.head.logits(x))
    assert torch.equal(served._embed(ids), over_dense._embed(ids))


def test_the_heads_calibration_is_interleaved_monotone_and_leaves_nothing(tiny_head):
    """calibrate_feature_drafter: every batch size timed in each of its rounds (the spread says how
    far the rounds were apart), a table that never gets cheaper with more sequences, no calibration
    sequence left on the drafter; a max_model_len with room for fewer rounds gets fewer, and one
    with room for none an empty table (the K policy then prices drafting at nothing known)."""
    head = load_feature_drafter(str(tiny_head), MAX_LEN)
    costs = calibrate_feature_drafter(head, 4, rounds=5)
    assert sorted(costs.draft) == [1, 2, 4] and costs.verify == {}
    ds = [costs.draft[b] for b in sorted(costs.draft)]
    assert ds == sorted(ds) and all(s > 0 for s in ds) and costs.spread >= 0.0
    assert head.num_running == 0
    short = load_feature_drafter(str(tiny_head), 64 + 2 + 2 * 3)  # room for 2 rounds after the warm-up
    assert sorted(calibrate_feature_drafter(short, 2, rounds=9).draft) == [1, 2] and short.num_running == 0
    none = load_feature_drafter(str(tiny_head), 64 + 3)
    assert calibrate_feature_drafter(none, 2).draft == {} and none.num_running == 0
