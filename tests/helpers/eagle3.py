"""Tiny random EAGLE-3 heads for tiny_llama (hidden 64, 4/2 heads, vocab 256), written in the
public checkpoint layout so the real loader reads them."""
from __future__ import annotations

from pathlib import Path

import torch

from specsplit.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3


def write_tiny_head(out: Path, draft_ids, seed: int = 3, extra_json: dict | None = None) -> Path:
    """A random head fusing the outputs of layers 0, 1, 1 (a repeated layer exercises the
    verifier's column gathering), over the draft vocabulary `draft_ids` (target ids)."""
    torch.manual_seed(seed)
    draft_ids = torch.as_tensor(draft_ids)
    cfg = Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       vocab_size=256, draft_vocab_size=int(draft_ids.numel()), aux_layers=(0, 1, 1), rope_theta=10000.0)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    save_eagle3(head, out, draft_ids, dtype=torch.float32, extra_json=extra_json)
    return out
