"""SmolLM2-135M split over 2 ranks (gloo; this process is rank 0): greedy, target-only and
speculative (the shipped draft with prompt lookup), equals transformers' fp32 greedy on held-out
ShareGPT prompts, token for token up to a certified near-tie (tests/helpers/greedy.py).

SmolLM2 has 9 query heads over 3 KV heads: rank 0 keeps 2 KV heads (6 query heads), rank 1 one (3)."""
from __future__ import annotations

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_draft_engine
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.hybrid_drafter import HybridDrafter
from specsplit.models.loader import hf_dir_for, load_tokenizer
from specsplit.models.registry import ASSETS_DIR, DRAFT_ALIAS
from specsplit.parallel.group import TPGroup
from specsplit.spec import SpecDecoder
from tests.helpers.greedy import assert_greedy_equal_or_tie, hf_next_logits
from tests.helpers.orphans import assert_gone

pytestmark = [pytest.mark.smollm, pytest.mark.slow]

NEW = 32
NUM_PROMPTS = 4
MAX_LEN = 256
K = 3


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(hf_dir_for("smollm2-135m", show_progress=False))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from specsplit.bench.suite import heldout_prompts

    return heldout_prompts(tokenizer, NUM_PROMPTS, 96)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir_for("smollm2-135m", show_progress=False), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: HF must not stop at EOS either
    yield model
    del model


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts):
    out = []
    for p in prompts:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def tp_engine():
    cfg = EngineConfig(model="smollm2-135m", max_model_len=MAX_LEN, max_num_seqs=4, max_prefill_tokens=128,
                       memory_budget_bytes=6 << 30)
    group, engine, plan = TPGroup.launch(cfg, SpecConfig(num_speculative_tokens=K), 2, threads=1)
    try:
        yield engine, plan
    finally:
        pids = [p.pid for p in group.procs]
        group.close()
        assert_gone(pids)


def _draft():
    name = DRAFT_ALIAS if (ASSETS_DIR / DRAFT_ALIAS / "config.json").exists() else "smollm2-135m"
    cfg = EngineConfig(model=name, max_model_len=MAX_LEN, max_num_seqs=4, max_prefill_tokens=128)
    engine = build_draft_engine(cfg, SpecConfig(num_speculative_tokens=K)).engine
    spec = SpecConfig(num_speculative_tokens=K)
    return HybridDrafter(engine, spec.ngram_min, spec.ngram_max, spec.draft_model_tokens)


@pytest.mark.parametrize("mode", ["target-only", "speculative"])
def test_tp2_greedy_equals_hf_fp32(tp_engine, prompts, hf, hf_greedy, mode):
    engine, plan = tp_engine
    ranks = plan.to_dict()["tensor_parallel"]["ranks"]
    per_block = [r["services"]["verifier"]["kv_bytes_per_block"] for r in ranks]
    assert per_block[0] == 2 * per_block[1]  # 2 KV heads on rank 0, 1 on rank 1
    if mode == "target-only":
        decoder = SpecDecoder(engine, None, SpecConfig(num_speculative_tokens=0), MAX_LEN)
    else:
        decoder = SpecDecoder(engine, _draft(), SpecConfig(num_speculative_tokens=K), MAX_LEN)
    requests = [GenerationRequest(f"p{i}", tuple(p), NEW, ignore_eos=True) for i, p in enumerate(prompts)]
    states = Scheduler(decoder, (), 4).run(requests)
    ties = []
    for p, ref, s in zip(prompts, hf_greedy, states):
        cmp = assert_greedy_equal_or_tie(ref, hf_next_logits(hf), s.output, prompt=p)
        if not cmp.equal:
            ties.append((cmp.tie_at, cmp.gap))
    if mode == "speculative":
        assert sum(s.proposed for s in states) > 0
    print(f"{mode}: {len(prompts)} prompts x {NEW} tokens, certified ties: {ties or 'none'}")
