"""When the drafter is lost between propose and fetch_rows, sampled output keeps the target's
distribution: the step is abandoned as a whole (Verifier.abandon) and sampled again, instead of
resolving the rejection with a one-hot q (biased)."""
from __future__ import annotations

import torch
from scipy import stats

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.sampling import logits_to_probs
from specsplit.sampling.params import SamplingParams
from tests.helpers.chisquare import pooled_chisquare
from tests.helpers.drafters import LosesRows

PROMPT = (5, 6, 7, 8, 9, 5, 6, 7)
# With the far draft the one-hot fallback emitted the first token off by TV 0.08 at a lost step.
PARAMS = dict(temperature=1.0, top_k=20)
NUM_SAMPLES = 4000


def _target_probs(target_dir, contexts: list[tuple[int, ...]]) -> torch.Tensor:  # [N, V] next-token p
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    rows = []
    with torch.no_grad():
        for ctx in contexts:
            logits = model(torch.tensor([ctx])).logits[0, -1:]
            rows.append(logits_to_probs(logits, torch.tensor([PARAMS["temperature"]]), torch.tensor([PARAMS["top_k"]]),
                                        torch.tensor([1.0]))[0])
    return torch.stack(rows)


def test_drafter_lost_mid_step_keeps_the_target_distribution(tiny_llama, tiny_draft_far):
    tc = EngineConfig(model=str(tiny_llama), max_model_len=64, max_num_seqs=8)
    dc = EngineConfig(model=str(tiny_draft_far), max_model_len=64, max_num_seqs=8)
    colo = build_colocated(tc, dc, SpecConfig(num_speculative_tokens=3, disable_by_batch_size=0), show_progress=False)
    lossy = LosesRows(colo.drafter)
    colo.decoder.drafter = lossy
    colo.decoder.drafter_retry_s = 0.0  # re-sync at once: most steps speculate and lose their rows
    gen = Scheduler(colo.decoder, colo.eos_token_ids, 8)
    # coupling=False: rejection sampling, the path that needs the q rows (coupled requests need none)
    reqs = [GenerationRequest(f"r{i}", PROMPT, 2, SamplingParams(seed=i, coupling=False, **PARAMS), ignore_eos=True)
            for i in range(NUM_SAMPLES)]
    states = gen.run(reqs)
    assert lossy.failures > 100
    assert sum(s.proposed for s in states) > 0

    p0 = _target_probs(tiny_llama, [PROMPT])[0]  # [V]
    support = torch.nonzero(p0).flatten().tolist()
    p1 = _target_probs(tiny_llama, [PROMPT + (t,) for t in support])  # [S, V]
    joint = {(a, b): float(p0[a] * p1[i, b]) for i, a in enumerate(support) for b in torch.nonzero(p1[i]).flatten().tolist()}
    counts: dict[tuple[int, int], int] = {}
    for s in states:
        key = tuple(s.output)
        assert key in joint, f"emitted {key}, which the target gives no mass"
        counts[key] = counts.get(key, 0) + 1
    pvalue, _ = pooled_chisquare(counts, joint, NUM_SAMPLES)
    first = torch.zeros_like(p0, dtype=torch.float64)
    for s in states:
        first[s.output[0]] += 1
    tv_first = 0.5 * float((first / NUM_SAMPLES - p0.double()).abs().sum())
    keep = p0 > 0
    p_first = stats.chisquare(first[keep].numpy(), (p0.double()[keep] / p0.double()[keep].sum() * NUM_SAMPLES).numpy()).pvalue
    print(f"FIGURE exact fallback: first token chi-square p {p_first:.3g}, TV {tv_first:.4f}; first two tokens "
          f"chi-square p {pvalue:.3g}; {lossy.failures} lost steps")
    assert p_first > 1e-3 and tv_first < 0.05 and pvalue > 1e-3, (p_first, tv_first, pvalue)

    bm_t, bm_d = colo.target.block_manager, colo.drafter.block_manager
    assert colo.target.num_running == 0 and colo.drafter.num_running == 0
    assert bm_t.num_free_blocks == bm_t.num_blocks and bm_d.num_free_blocks == bm_d.num_blocks
    colo.close()
