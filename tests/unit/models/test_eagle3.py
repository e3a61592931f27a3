"""The EAGLE-3 head: the training unroll sees exactly what incremental drafting sees, and the
public checkpoint format round-trips (a tiny random checkpoint written in that layout)."""
from __future__ import annotations

import json

import pytest
import torch

from specsplit.models.eagle3 import (Eagle3Config, Eagle3Head, DraftCache, d2t_from_ids, load_eagle3,
                                     rope_cos_sin, save_eagle3)


def tiny_cfg(vocab: int = 64) -> Eagle3Config:
    return Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                        vocab_size=vocab, draft_vocab_size=vocab, aux_layers=(0, 1, 2), rope_theta=10000.0)


def random_head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(tiny_cfg())
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return head.eval()


@pytest.mark.parametrize("anchor", [0, 3, 6])
def test_ttt_unroll_equals_incremental_chain(anchor):
    head = random_head()
    T, steps, H = 8, 3, 32
    feats = torch.randn(1, T, 3 * H)
    embeds = torch.randn(1, T + steps, H)  # embeds[:, t] = embedding of x_{t+1}
    with torch.no_grad():
        outs = head.ttt_forward(feats, embeds, steps)
        cache = DraftCache()
        # committed entries 0..anchor (target features), then the chain from the last one
        h = head.extend(cache, head.fuse(feats[0, : anchor + 1]), embeds[0, : anchor + 1], 0)[-1:]
        chain = [h]
        for j in range(1, steps):
            h = head.extend(cache, h, embeds[0, anchor + j: anchor + j + 1], anchor + j)
            chain.append(h)
    for j in range(steps):
        torch.testing.assert_close(chain[j][0], outs[j][0, anchor], rtol=1e-4, atol=1e-5)


def test_rope_rows_are_the_rows_rope_cos_sin_computes():
    """The decode path slices one rope table (grown by doubling) instead of computing each
    extend's rows: the same bits, past the table's first size too."""
    head, hd = random_head(), tiny_cfg().hd
    for start, n in [(0, 1), (5, 3), (250, 10), (255, 1), (600, 40), (3, 2), (2047, 1)]:
        cos, sin = rope_cos_sin(torch.arange(start, start + n), hd, head.cfg.rope_theta, torch.float32)
        c, signed = head._rope_rows(start, n)
        assert torch.equal(c, cos) and torch.equal(signed, torch.cat([-sin[:, : hd // 2], sin[:, hd // 2:]], -1))
    assert head._rope[0].shape[0] >= 2048


def test_truncate_drops_chain_entries():
    head = random_head()
    cache = DraftCache()
    with torch.no_grad():
        head.extend(cache, torch.randn(5, 32), torch.randn(5, 32), 0)
        assert len(cache) == 5
        cache.truncate(3)
    assert len(cache) == 3 and cache.keys().shape[0] == 3


def test_public_format_round_trip(tmp_path):
    head = random_head(1)
    embed = torch.randn(64, 32)
    ids = torch.tensor([0, 2, 3, 7, 10, 63])
    save_eagle3(head, tmp_path / "e3", ids, dtype=torch.float32)
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 6
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "e3" / "model.safetensors"))
    assert torch.equal(sd["d2t"], d2t_from_ids(ids)) and int(sd["t2d"].sum()) == 6
    back = load_eagle3(tmp_path / "e3", target_embedding=embed)
    assert torch.equal(back.draft_ids, ids)
    torch.testing.assert_close(back.lm_head, embed[ids])
    for k, v in head.hf_state_dict().items():
        torch.testing.assert_close(back.hf_state_dict()[k], v)


def test_public_format_with_own_lm_head_and_errors(tmp_path):
    head = random_head(2)
    ids = torch.arange(10)
    save_eagle3(head, tmp_path / "e3", ids, lm_head=torch.randn(10, 32), dtype=torch.float32)
    back = load_eagle3(tmp_path / "e3")  # its own head: no target embedding needed
    assert back.lm_head.shape == (10, 32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle3(tmp_path)
    save_eagle3(head, tmp_path / "tied", ids, dtype=torch.float32)
    with pytest.raises(ValueError, match="embedding"):
        load_eagle3(tmp_path / "tied")
