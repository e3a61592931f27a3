"""CPU bf16 prepacking (specsplit/models/cpu_packing.py): same numbers as the dense bf16 path, the
packed bytes are counted, the dense weights come back on demand, and the switch turns it off."""
from __future__ import annotations

import pytest
import torch

from specsplit.models import cpu_packing
from specsplit.models.llama import Linear
from specsplit.models.loader import load_model
from specsplit.models.runner import ForwardItem, ModelRunner

pytestmark = pytest.mark.skipif(not cpu_packing.supported("cpu", torch.bfloat16),
                                reason="this CPU/torch has no oneDNN bf16 support")


def _load(path, monkeypatch, packed: bool):
    monkeypatch.setenv(cpu_packing.ENV_SWITCH, "1" if packed else "0")
    return load_model(str(path), dtype=torch.bfloat16, show_progress=False).model


def _logits(model, prompts, qs):
    """Prefill several sequences, then decode/verify-shaped steps; all logits, in order."""
    runner = ModelRunner(model, num_blocks=64, block_size=4, max_model_len=256)
    out = runner.forward([ForwardItem(f"s{i}", 0, p, num_logits=len(p)) for i, p in enumerate(prompts)])
    lens = [len(p) for p in prompts]
    g = torch.Generator().manual_seed(3)
    for q in qs:
        new = [torch.randint(0, 256, (q,), generator=g).tolist() for _ in prompts]
        out += runner.forward([ForwardItem(f"s{i}", n, t, num_logits=q) for i, (n, t) in enumerate(zip(lens, new))])
        lens = [n + q for n in lens]
    return out


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])  # untied head; tied head + qkv bias
def test_packed_logits_equal_dense_bf16(fixture, request, monkeypatch):
    path = request.getfixturevalue(fixture)
    dense, packed = _load(path, monkeypatch, False), _load(path, monkeypatch, True)
    assert dense.untracked_weight_bytes == 0 and packed.untracked_weight_bytes > 0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20)]
    for a, b in zip(_logits(dense, prompts, (1, 4, 2)), _logits(packed, prompts, (1, 4, 2))):
        # Same bf16 products and fp32 accumulation; a different blocking may round the last bit
        # of a bf16 output differently, which is all this tolerance allows.
        torch.testing.assert_close(b, a, atol=0.02 * float(a.abs().max()), rtol=0)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_packed_weights_are_counted_and_recoverable(tiny_llama, monkeypatch):
    dense, packed = _load(tiny_llama, monkeypatch, False), _load(tiny_llama, monkeypatch, True)
    dense_linears = [m for m in dense.modules() if isinstance(m, Linear)]
    packed_linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.weight.numel() == 0 for m in packed_linears)
    for d, p in zip(dense_linears, packed_linears):
        assert torch.equal(p.dense_weight(), d.weight)  # the blocked layout round-trips exactly
    expected = sum(m.weight.numel() * 2 for m in dense_linears)
    if dense.lm_head is None:  # tied: the head gets its own packed copy beside the dense embedding
        expected += dense.embed_tokens.weight.numel() * 2
    assert packed.untracked_weight_bytes == expected


def test_draft_subset_head_is_packed_and_subset_order_enforced(tiny_llama, monkeypatch):
    monkeypatch.setenv(cpu_packing.ENV_SWITCH, "0")
    dense = load_model(str(tiny_llama), dtype=torch.bfloat16, show_progress=False).model
    monkeypatch.setenv(cpu_packing.ENV_SWITCH, "1")
    packed = load_model(str(tiny_llama), dtype=torch.bfloat16, show_progress=False).model
    assert packed.prepack() is False  # already packed: a second call changes nothing
    with pytest.raises(RuntimeError, match="before prepack"):
        packed.set_vocab_subset(torch.arange(0, 256, 2))
    # A fresh packed model with a subset head: -inf outside the subset, same values inside.
    subset = torch.arange(0, 256, 2)
    dense.set_vocab_subset(subset)
    monkeypatch.setenv(cpu_packing.ENV_SWITCH, "0")
    sub = load_model(str(tiny_llama), dtype=torch.bfloat16, show_progress=False).model
    sub.set_vocab_subset(subset)
    monkeypatch.setenv(cpu_packing.ENV_SWITCH, "1")
    assert sub.prepack() and sub._subset_head is None
    prompt = [[5, 6, 7, 8, 9]]
    a, b = _logits(dense, prompt, (1,)), _logits(sub, prompt, (1,))
    for x, y in zip(a, b):
        assert torch.isinf(y[:, 1::2]).all()
        torch.testing.assert_close(y[:, ::2], x[:, ::2], atol=0.02 * float(x[:, ::2].abs().max()), rtol=0)


def test_switch_and_dtypes(monkeypatch):
    monkeypatch.setenv(cpu_packing.ENV_SWITCH, "0")
    assert not cpu_packing.supported("cpu", torch.bfloat16)
    monkeypatch.setenv(cpu_packing.ENV_SWITCH, "1")
    assert cpu_packing.supported("cpu", torch.bfloat16)
    assert not cpu_packing.supported("cpu", torch.float32)
    assert not cpu_packing.supported("meta", torch.bfloat16)
