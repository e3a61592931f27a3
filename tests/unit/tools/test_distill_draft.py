"""tools/distill_draft.py: ShareGPT reading, the loss, and the shipped draft format (tiny random model)."""
from __future__ import annotations

import json

import pytest
import torch

from specsplit.datasets import sharegpt
from tests.helpers.tools import load_tool

distill = load_tool("distill_draft")


def _conv(i, human="hello", gpt="hi there"):
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"{human} {i}"}, {"from": "gpt", "value": gpt}]}


def test_truncated_sharegpt_stops_at_last_whole_entry(tmp_path):
    whole = [_conv(i) for i in range(5)]
    whole.insert(2, {"id": "empty", "conversations": [{"from": "gpt", "value": "no human turn"}]})
    text = json.dumps(whole + [_conv(99)], indent=1)
    cut = text[: text.rindex('"c99"') + 3]  # cut inside the last entry
    f = tmp_path / "sg.json"
    f.write_text(cut)
    convs = list(sharegpt.iter_conversations(f))
    assert [c["id"] for c in convs] == ["c0", "c1", "empty", "c2", "c3", "c4"]
    prompts = sharegpt.load_prompts(f)
    assert [p[0] for p in prompts] == ["c0", "c1", "c2", "c3", "c4"]
    train, held = sharegpt.split_heldout(prompts, 2)
    assert [p[0] for p in held] == ["c3", "c4"] and len(train) == 3
    ex = sharegpt.load_exchanges(f)
    assert ex[0] == ("c0", "hello 0", "hi there") and len(ex) == 5


def _tiny_target(layers=4, vocab=96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                      max_position_embeddings=64, rope_theta=1e5)
    return LlamaForCausalLM(cfg).eval()


def test_student_copies_target_layers_and_freezes_embedding():
    target = _tiny_target()
    student = distill.make_student(target, [0, 3])
    assert student.config.num_hidden_layers == 2
    assert torch.equal(student.model.layers[1].mlp.down_proj.weight, target.model.layers[3].mlp.down_proj.weight)
    assert torch.equal(student.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert not student.model.embed_tokens.weight.requires_grad
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()


def test_export_roundtrip_sub_vocab(tmp_path):
    target = _tiny_target()
    student = distill.make_student(target, [0, 3])
    with torch.no_grad():  # make it differ from the target's layers
        for p in student.model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    subset = torch.tensor([0, 1, 2, 5, 7, 11, 40, 95])
    out = tmp_path / "draft"
    distill.export_draft(student, subset, out, {"steps": 1, "tokens": 2, "wall_hours": 0.0,
                                                "final_eval_agreement": 0.5, "command": "x"},
                         heldout_ids=["a", "b"], dtype=torch.float32)
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert "model.embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    assert set(tensors) == {k for k in student.state_dict() if k.startswith(("model.layers.", "model.norm."))}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"]
    assert cfg["vocab_size"] == 96
    meta = json.loads((out / "specsplit_draft.json").read_text())
    assert meta["shared_tensors"] == ["model.embed_tokens.weight"]
    assert meta["vocab_subset"] == "vocab_subset.safetensors" and meta["base_model"] == "smollm2-135m"
    ids = load_file(str(out / "vocab_subset.safetensors"))["token_ids"]
    assert ids.dtype == torch.int64 and torch.equal(ids, subset)
    assert json.loads((out / "heldout_ids.json").read_text()) == ["a", "b"]

    model, sub = distill.load_exported(out, target.model.embed_tokens.weight.detach())
    x = torch.randint(0, 96, (1, 10))
    head = target.model.embed_tokens.weight[sub]
    a = distill.student_logits(student, x, student.model.embed_tokens.weight[subset], False)
    b = distill.student_logits(model, x, head, False)
    torch.testing.assert_close(a, b)
    # the sub-vocab head is the full head restricted to the subset's rows
    full = model(input_ids=x).logits
    torch.testing.assert_close(full[..., sub], b, rtol=1e-4, atol=1e-5)


def test_loss_prefers_matching_argmax_and_ignores_out_of_subset():
    vocab, n = 20, 6
    subset = torch.tensor([0, 2, 4, 6, 8, 10])
    full2sub = torch.full((vocab,), -1, dtype=torch.long)
    full2sub[subset] = torch.arange(n)
    tk_ids = torch.tensor([[[4, 2, 13]], [[13, 0, 2]]], dtype=torch.int32)  # 2nd argmax is out of subset
    tk_vals = torch.tensor([[[5.0, 1.0, 0.5]], [[9.0, 1.0, 0.0]]], dtype=torch.float16)
    w = torch.ones(2, 1)
    good = torch.zeros(2, 1, n)
    good[0, 0, 2] = 8.0  # sub index of token 4
    bad = torch.zeros(2, 1, n)
    bad[0, 0, 0] = 8.0
    lg = distill.distill_loss(good, tk_ids, tk_vals, w, full2sub, 0.5)
    lb = distill.distill_loss(bad, tk_ids, tk_vals, w, full2sub, 0.5)
    assert torch.isfinite(lg) and lg < lb
    # the out-of-subset row contributes nothing: changing its logits leaves the loss unchanged
    good2 = good.clone()
    good2[1, 0] = torch.randn(n)
    assert torch.allclose(distill.distill_loss(good2, tk_ids, tk_vals, w, full2sub, 0.5), lg)


def test_evaluate_counts_only_continuation_positions():
    target = _tiny_target()
    student = distill.make_student(target, [0, 1, 2, 3])  # = the target: agreement 1
    seq = torch.randint(0, 96, (12,)).tolist()
    with torch.no_grad():
        targ = target(input_ids=torch.tensor(seq)[None]).logits[0].argmax(-1)
    full2sub = torch.arange(96)
    ev = distill.evaluate(student, student.model.embed_tokens.weight.detach(), full2sub, [(seq, 5, targ)], False)
    assert ev["eval_tokens"] == 12 - 5 and ev["agreement"] == pytest.approx(1.0)
    assert ev["mean_accepted_k4"] > 0


def test_native_generation_equals_hf_greedy_and_teacher_topk(tiny_llama):
    """--gen-engine native: the same greedy continuations as HF generate and, at every position,
    the same top-k the teacher-forced pass gives (fp32, tiny random Llama)."""
    from transformers import AutoModelForCausalLM

    from specsplit.models.loader import load_model

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    loaded = load_model(str(tiny_llama), show_progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (4, 9, 15)]
    eos = 2
    made = distill.native_generate_topk(loaded, prompts, 12, eos, k=4, prefill_batch=2)
    ref = distill.greedy_generate(hf, prompts, 12, eos, pad=0)
    tk = distill.teacher_topk(hf, [p + c for p, c in zip(prompts, ref)], 4)
    for p, c, (ids, ti, tv), (rti, rtv) in zip(prompts, ref, made, tk):
        assert ids.tolist() == p + c
        n = len(p) + len(c) - 1  # the last position predicts nothing and is a copy
        assert ti.shape == (n + 1, 4) and tv.dtype == torch.float16
        assert torch.equal(ti[:n, 0], rti[:n, 0])  # the argmax, i.e. the hard label
        torch.testing.assert_close(tv[:n].float(), rtv[:n].float(), atol=2e-3, rtol=0)
