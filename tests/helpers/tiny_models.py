"""Tiny random Llama / Mistral / Qwen2 checkpoints written to disk (no downloads).

Each checkpoint is a real Hugging Face directory: config.json, model.safetensors and a small
word-level tokenizer, so the same loader code paths run as for a real model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]  # vocab 256


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(VOCAB_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    # Pin the tokenizer class: otherwise AutoTokenizer picks the architecture's own (e.g. Qwen2's
    # BPE tokenizer), which cannot read a word-level vocabulary.
    cfg_path = Path(directory) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def tiny_config(arch: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    base = dict(
        vocab_size=len(VOCAB_WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    return cls(**base)


def write_tiny_model(directory: Path, arch: str = "llama", seed: int = 0, perturb_from: Path | None = None,
                     perturb_scale: float = 0.0, **overrides) -> Path:
    """Write a random model; with perturb_from, copy that model and add noise (a draft that
    agrees with its target often but not always)."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if perturb_from is not None:
        model = AutoModelForCausalLM.from_pretrained(perturb_from, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb_scale * p.std().clamp_min(1e-3))
    else:
        cfg = tiny_config(arch, **overrides)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            # Larger weights than the default init make logits peaked, so greedy ties are rare.
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory
