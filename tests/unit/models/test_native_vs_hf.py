"""The native runner's logits equal transformers' (fp32, 1e-4) over the paged cache."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specsplit.models.loader import load_model
from specsplit.models.runner import ForwardItem, ModelRunner

TOL = 1e-4


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=["tiny_llama", "tiny_mistral", "tiny_qwen2"])
def pair(request):
    path = request.getfixturevalue(request.param)
    native = load_model(str(path), show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(native.model, num_blocks=64, block_size=4, max_model_len=256)
    yield runner, hf
    del runner, native, hf


def test_batched_prefill_mixed_lengths(pair):
    runner, hf = pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 13, 30)]
    items = [ForwardItem(f"s{i}", 0, p, num_logits=len(p)) for i, p in enumerate(prompts)]
    out = runner.forward(items)
    for p, logits in zip(prompts, out):
        torch.testing.assert_close(logits, _hf_logits(hf, p), atol=TOL, rtol=0)


def test_decode_and_multi_token_decode(pair):
    runner, hf = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 17)]
    runner.forward([ForwardItem(f"s{i}", 0, p) for i, p in enumerate(prompts)])
    # single-token decode for all, then q = 4 new tokens per sequence (verification shape)
    for q in (1, 4, 3):
        new = [torch.randint(0, 256, (q,), generator=g).tolist() for _ in prompts]
        out = runner.forward([ForwardItem(f"s{i}", len(p), n, num_logits=q) for i, (p, n) in enumerate(zip(prompts, new))])
        for i, (p, n) in enumerate(zip(prompts, new)):
            prompts[i] = p + n
            torch.testing.assert_close(out[i], _hf_logits(hf, prompts[i])[-q:], atol=TOL, rtol=0)


def test_mixed_q_lengths_in_one_batch(pair):
    runner, hf = pair
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 256, (9,), generator=g).tolist(), torch.randint(0, 256, (3,), generator=g).tolist()
    runner.forward([ForwardItem("a", 0, a)])
    # a decodes 1 token while b prefills 3 and c verifies 5 after a 2-token prefix
    c = torch.randint(0, 256, (7,), generator=g).tolist()
    runner.forward([ForwardItem("c", 0, c[:2])])
    out = runner.forward([ForwardItem("a", 9, [5], 1), ForwardItem("b", 0, b, 3), ForwardItem("c", 2, c[2:], 5)])
    torch.testing.assert_close(out[0], _hf_logits(hf, a + [5])[-1:], atol=TOL, rtol=0)
    torch.testing.assert_close(out[1], _hf_logits(hf, b), atol=TOL, rtol=0)
    torch.testing.assert_close(out[2], _hf_logits(hf, c)[-5:], atol=TOL, rtol=0)


def test_truncate_then_decode_equals_never_appended(pair):
    runner, hf = pair
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (10,), generator=g).tolist()
    runner.forward([ForwardItem("s", 0, prompt)])
    # append 5 drafts, reject all but 2 of them, then decode a different token
    runner.forward([ForwardItem("s", 10, [1, 2, 3, 4, 5], 5)])
    runner.truncate("s", 12)
    assert runner.block_manager.length("s") == 12
    out = runner.forward([ForwardItem("s", 12, [42], 1)])
    torch.testing.assert_close(out[0], _hf_logits(hf, prompt + [1, 2, 42])[-1:], atol=TOL, rtol=0)


def test_freeing_returns_blocks(pair):
    runner, _ = pair
    free0 = runner.block_manager.num_free_blocks
    runner.forward([ForwardItem("x", 0, list(range(20)))])
    assert runner.block_manager.num_free_blocks < free0
    runner.free("x")
    assert runner.block_manager.num_free_blocks == free0


def test_llama3_rope_scaling_matches_hf(tmp_path):
    from tests.helpers.tiny_models import write_tiny_model

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = write_tiny_model(tmp_path / "l3", "llama", seed=5, rope_scaling=scaling, rope_theta=500000.0)
    native = load_model(str(path), show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(native.model, num_blocks=64, block_size=16, max_model_len=256)
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    out = runner.forward([ForwardItem("s", 0, ids, num_logits=150)])
    torch.testing.assert_close(out[0], _hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs_close(tiny_llama, dtype):
    native = load_model(str(tiny_llama), dtype=dtype, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    runner = ModelRunner(native.model, num_blocks=32, block_size=16, max_model_len=128)
    ids = list(range(3, 40))
    out = runner.forward([ForwardItem("s", 0, ids, num_logits=len(ids))])[0]
    ref = _hf_logits(hf, ids)
    assert runner.kv.data.dtype == dtype
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
