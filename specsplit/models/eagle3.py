"""EAGLE-3 draft head: one decoder layer over the target's own hidden states.

Vocabulary (as in the EAGLE-3 paper and its public checkpoints):
    target feature f_t   concat of the target's hidden states after three of its layers (low, middle,
                         high: ``aux_layers``) at position t, [3H]; the target computes it while it
                         verifies, so the drafter gets it for every committed position but the last.
    entry t              one row of the head's own KV cache: the input (g_t, x_{t+1}) at position t,
                         g_t = fc(f_t) for a committed position, or the head's own previous output for
                         a drafted one.
    chain step j         drafting the (j+1)-th token after the last committed one: a new entry at
                         position t+j whose input is (h^{j-1}, d_{t+1+j}); it attends to every
                         committed entry and to the chain's earlier entries.
    d2t / t2d            the draft vocabulary (a subset of the target's): draft id i is target id
                         i + d2t[i]; t2d[v] says whether target id v is in it. Logits outside the
                         subset are -inf, so q = 0 there and rejection sampling stays lossless.

The layer (``EagleLayer``) follows the public EAGLE-3 LlamaDecoderLayer: the token embedding and the
hidden input are RMS-normed separately and concatenated ([2H]) before q/k/v; the residual stream
is the (un-normed) hidden input; the MLP is the usual SwiGLU. The LM head is the target's tied
embedding restricted to the draft vocabulary (SmolLM2 ties its embeddings), or the checkpoint's own
``lm_head`` when it has one.

``ttt_forward`` is the training-time-test unroll used by tools/train_eagle3.py: J chain steps at
every anchor position at once, with exactly the attention an incremental draft would see.
``DraftCache`` + ``Eagle3Head.extend`` are the incremental path the drafter engine runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.kernels import decode_ops, quant_linear

EAGLE3_ARCH = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # target layers whose OUTPUT is fused (HF hidden_states index - 1)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def to_hf(self) -> dict:
        """config.json in the public EAGLE-3 layout (what vLLM/SGLang/SpecForge read)."""
        return {
            "architectures": [EAGLE3_ARCH],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.hd,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                             "use_aux_hidden_state": True},
            **self.extra,
        }

    @classmethod
    def from_hf(cls, cfg: dict, num_target_layers: int | None = None) -> "Eagle3Config":
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if num_target_layers is None:
                raise ValueError("the EAGLE-3 config names no eagle_aux_hidden_state_layer_ids and the "
                                 "target's layer count is unknown")
            aux = default_aux_layers(num_target_layers)
        rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            hidden_size=int(cfg["hidden_size"]), num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
            aux_layers=tuple(int(i) for i in aux), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope), max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            head_dim=int(cfg.get("head_dim") or 0),
        )


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high layers, as vLLM/SGLang pick them: outputs of layers 1, L/2-1, L-4."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_cos_sin(positions: torch.Tensor, hd: int, theta: float, dtype: torch.dtype):
    """cos/sin [*, hd] for integer positions [*] (HF rotate-half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=positions.device, dtype=torch.float32) / hd))
    ang = positions.float()[..., None] * inv  # [*, hd/2]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, hd]; cos/sin broadcastable to it."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


class EagleLayer(nn.Module):
    """The one decoder layer; q/k/v read the [2H] concat of normed embedding and normed hidden."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, nh, kvh, hd, I = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd, cfg.intermediate_size
        self.cfg = cfg
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.hidden_norm = nn.Parameter(torch.ones(H))
        # q, k, v fused into one matmul (and gate, up into another): one call each per step, which
        # is what matters on a CPU; hf_state_dict splits them back into the public names.
        self.split = (nh * hd, kvh * hd, kvh * hd)
        self.qkv_proj = nn.Linear(2 * H, sum(self.split), bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.gate_up_proj = nn.Linear(H, 2 * I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def qkv(self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor):
        """g, e [..., T, H], positions [..., T] -> q [..., nh, T, hd], k/v [..., kvh, T, hd] (roped)."""
        eps, hd = self.cfg.rms_norm_eps, self.cfg.hd
        x = torch.cat([rms_norm(e, self.input_layernorm, eps), rms_norm(g, self.hidden_norm, eps)], dim=-1)
        lead = x.shape[:-1]
        q, k, v = (t.reshape(*lead, -1, hd).transpose(-2, -3) for t in self.qkv_proj(x).split(self.split, dim=-1))
        cos, sin = rope_cos_sin(positions, hd, self.cfg.rope_theta, q.dtype)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual on the hidden input, then the MLP. attn [..., nh, T, hd] -> h [..., T, H]."""
        attn = attn.transpose(-2, -3).flatten(-2)
        h = g + self.o_proj(attn)
        x = rms_norm(h, self.post_attention_layernorm, self.cfg.rms_norm_eps)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class DraftCache:
    """The head's KV cache for one sequence: keys and values [capacity, kvh, hd] (the paged cache's
    per-token layout, as one block), the first ``len`` rows in use; capacity doubles as it fills.

    ``committed`` entries come from target features and are kept; entries past it were written by
    a chain and are dropped by ``truncate`` before the next step (the target's features replace them).
    """

    def __init__(self, limit: int | None = None):
        self.k: torch.Tensor | None = None  # [capacity, kvh, hd]
        self.v: torch.Tensor | None = None
        self.n = 0
        # capacity never doubles past this many rows (the sequence's max_model_len), so a drafter's
        # caches stay within max_num_seqs x limit rows, the bound its memory plan counts
        self.limit = limit

    def __len__(self) -> int:
        return self.n

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v [n, kvh, hd]
        need = self.n + k.shape[0]
        if self.k is None or need > self.k.shape[0]:
            cap = max(64, 2 * (0 if self.k is None else self.k.shape[0]))
            cap = max(need, cap if self.limit is None else min(cap, self.limit))
            nk, nv = k.new_empty(cap, *k.shape[1:]), v.new_empty(cap, *v.shape[1:])
            if self.n:
                nk[: self.n], nv[: self.n] = self.k[: self.n], self.v[: self.n]
            self.k, self.v = nk, nv
        self.k[self.n:need], self.v[self.n:need] = k, v
        self.n = need

    def keys(self) -> torch.Tensor:  # [len, kvh, hd]
        return self.k[: self.n]

    def values(self) -> torch.Tensor:
        return self.v[: self.n]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class Eagle3Head(nn.Module):
    """fc (3H -> H) + EagleLayer + final norm; the head reads the embedding it is given."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = EagleLayer(cfg)
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        # draft vocabulary: target ids of the draft's rows (sorted), [draft_vocab]
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.lm_head: torch.Tensor | None = None  # [draft_vocab, H]; set by use_head()
        self.head_linear = None  # a faster callable over lm_head (the CPU kernels; feature_drafter)
        # the decode path's rope rows, cos and sign-folded sin [positions, hd] (fp32, CPU), grown
        # by doubling: each extend slices them instead of computing a dozen small ops
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ vocabulary and head
    def use_head(self, weight: torch.Tensor, draft_ids: torch.Tensor) -> None:
        """weight [draft_vocab, H] (the target's embedding rows draft_ids, or a trained head)."""
        self.lm_head = weight
        self.draft_ids = draft_ids.to(torch.long)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (layer output) -> draft-vocabulary logits [..., draft_vocab]."""
        x = rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        return self.head_linear(x) if self.head_linear is not None else F.linear(x, self.lm_head)

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    # ------------------------------------------------------------------ training (TTT unroll)
    def ttt_forward(self, feats: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The chain at every anchor at once.

        feats [B, T, 3H]: target features f_t; embeds [B, T + steps, H]: embedding of x_{t+1} at
        index t (the caller shifts by one). Returns ``steps`` tensors h^j [B, T, H]: the layer
        output of chain step j at anchor t (predicts x_{t+2+j}). Right padding is safe: the
        attention is causal in t.
        """
        B, T, _ = feats.shape
        layer, hd = self.midlayer, self.cfg.hd
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        pos = torch.arange(T, device=feats.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=feats.device).tril()
        g = self.fc(feats.to(self.fc.weight.dtype))
        keys, vals, outs = [], [], []
        for j in range(steps):
            q, k, v = layer.qkv(g, embeds[:, j:j + T], (pos + j).expand(B, T))
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, nh, T, hd]
            keys.append(k)
            vals.append(v)
            scale = 1.0 / math.sqrt(hd)
            s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, nh, T, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [((q * keys[i]).sum(-1) * scale).unsqueeze(-1) for i in range(1, j + 1)]  # [B, nh, T, 1]
            p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
            attn = p[..., :T] @ vals[0]
            for i in range(1, j + 1):
                attn = attn + p[..., T + i - 1:T + i] * vals[i]
            h = layer.finish(g, attn)
            outs.append(h)
            g = h
        return outs

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def extend(self, cache: DraftCache, g: torch.Tensor, embeds: torch.Tensor, start: int) -> torch.Tensor:
        """Append entries at positions start.. for one sequence and return their outputs.

        g [n, H] (fc(features) for committed entries, or the previous chain output), embeds [n, H];
        the new entries attend to the cache (all of it) and causally to each other. -> h [n, H].
        """
        layer, cfg = self.midlayer, self.cfg
        n, hd, nh, kvh = g.shape[0], cfg.hd, cfg.num_attention_heads, cfg.num_key_value_heads
        ops = decode_ops.load() if decode_ops.usable(g) and hd % 8 == 0 and cfg.intermediate_size % 8 == 0 else None
        if ops is None:
            q, k, v = layer.qkv(g, embeds, torch.arange(start, start + n, device=g.device))  # q [nh, n, hd]
            cache.append(k.transpose(0, 1), v.transpose(0, 1))
            rep = nh // kvh
            K = cache.keys().transpose(0, 1).repeat_interleave(rep, dim=0)  # [nh, L, hd]
            V = cache.values().transpose(0, 1).repeat_interleave(rep, dim=0)
            L = K.shape[-2]
            mask = torch.ones(n, L, dtype=torch.bool, device=g.device).tril(L - n)
            attn = F.scaled_dot_product_attention(q.unsqueeze(0), K.unsqueeze(0), V.unsqueeze(0),
                                                  attn_mask=mask).squeeze(0)
            return layer.finish(g, attn)
        # fp32 on the CPU (kernels/decode_ops): norms, rope and attention one call each, the
        # cache read in place
        eps = cfg.rms_norm_eps
        x = torch.cat([ops.rms_norm(embeds, layer.input_layernorm, eps), ops.rms_norm(g, layer.hidden_norm, eps)], -1)
        qkv = layer.qkv_proj(x)  # [n, (nh + 2 kvh) hd]
        cos, signed = self._rope_rows(start, n)  # [n, hd] each
        qk = ops.rope(qkv[:, : (nh + kvh) * hd].view(n, nh + kvh, hd), cos, signed)  # [n, nh + kvh, hd]
        cache.append(qk[:, nh:], qkv[:, (nh + kvh) * hd:].view(n, kvh, hd))
        L, cap = len(cache), cache.k.shape[0]
        one = torch.zeros(1, 1, dtype=torch.long)
        attn = ops.paged_attention(qk[:, :nh].contiguous(), cache.k.view(1, cap, kvh, hd), cache.v.view(1, cap, kvh, hd),
                                   one, torch.tensor([n]), torch.tensor([L]), hd**-0.5,
                                   quant_linear.avx512_allowed())  # [n, nh, hd]
        h = g + layer.o_proj(attn.view(n, nh * hd))
        gate_up = layer.gate_up_proj(ops.rms_norm(h, layer.post_attention_layernorm, eps))
        return h + layer.down_proj(ops.silu_mul(gate_up))

    def _rope_rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (-sin on the first half: decode_ops.rope's rotate-half form)
        [n, hd] for positions start..start+n-1: slices of a table computed the way rope_cos_sin
        computes them (elementwise, so each row is the same bits)."""
        if self._rope is None or start + n > self._rope[0].shape[0]:
            hd = self.cfg.hd
            size = max(256, start + n, 2 * (0 if self._rope is None else self._rope[0].shape[0]))
            cos, sin = rope_cos_sin(torch.arange(size), hd, self.cfg.rope_theta, torch.float32)
            self._rope = cos, torch.cat([-sin[:, : hd // 2], sin[:, hd // 2:]], -1)
        return self._rope[0][start:start + n], self._rope[1][start:start + n]

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [n, 3H] -> g [n, H]."""
        return self.fc(feats.to(self.fc.weight.dtype))

    # ------------------------------------------------------------------ checkpoint format
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the public EAGLE-3 names (d2t/t2d added by save_eagle3)."""
        m = self.midlayer
        sd = {"fc.weight": self.fc.weight, "norm.weight": self.norm,
              "midlayer.input_layernorm.weight": m.input_layernorm,
              "midlayer.hidden_norm.weight": m.hidden_norm,
              "midlayer.post_attention_layernorm.weight": m.post_attention_layernorm,
              "midlayer.self_attn.o_proj.weight": m.o_proj.weight,
              "midlayer.mlp.down_proj.weight": m.down_proj.weight}
        for name, w in zip(("q_proj", "k_proj", "v_proj"), m.qkv_proj.weight.split(m.split, dim=0)):
            sd[f"midlayer.self_attn.{name}.weight"] = w
        for name, w in zip(("gate_proj", "up_proj"), m.gate_up_proj.weight.chunk(2, dim=0)):
            sd[f"midlayer.mlp.{name}.weight"] = w
        return {k: v.detach() for k, v in sd.items()}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        own = self.hf_state_dict()
        missing = sorted(set(own) - set(sd))
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
        with torch.no_grad():
            for k, dst in own.items():  # views: the fused q/k/v and gate/up rows are written in place
                src = sd[k]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"EAGLE-3 checkpoint tensor {k} has shape {tuple(src.shape)}, "
                                     f"the config implies {tuple(dst.shape)}")
                dst.copy_(src.to(dst.dtype))


def d2t_from_ids(draft_ids: torch.Tensor) -> torch.Tensor:
    """Sorted target ids [Vd] -> the public d2t offsets [Vd] (target = draft + d2t[draft])."""
    return draft_ids.to(torch.long) - torch.arange(draft_ids.numel(), dtype=torch.long)


def t2d_from_ids(draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids.to(torch.long)] = True
    return t2d


def save_eagle3(head: Eagle3Head, out_dir: str | Path, draft_ids: torch.Tensor,
                lm_head: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                extra_json: dict | None = None) -> Path:
    """Write a HF-style EAGLE-3 directory: config.json + model.safetensors (+ d2t, t2d).

    lm_head None: the head is the target's embedding rows at draft_ids (not stored; the config
    says so with ``specsplit_tied_head``), which keeps the shipped file a few MB.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to(dtype).contiguous().cpu() for k, v in head.hf_state_dict().items()}
    sd["d2t"] = d2t_from_ids(draft_ids.cpu())
    sd["t2d"] = t2d_from_ids(draft_ids.cpu(), head.cfg.vocab_size)
    if lm_head is not None:
        sd["lm_head.weight"] = lm_head.to(dtype).contiguous().cpu()
    cfg = head.cfg.to_hf()
    cfg["draft_vocab_size"] = int(draft_ids.numel())
    cfg["specsplit_tied_head"] = lm_head is None
    if extra_json:
        cfg.update(extra_json)
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def load_eagle3(path: str | Path, target_embedding: torch.Tensor | None = None,
                num_target_layers: int | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Head:
    """Read a public-format EAGLE-3 directory (config.json + *.safetensors with d2t/t2d).

    The head is ``lm_head.weight`` when the checkpoint has one, else the target's embedding rows
    at the draft vocabulary (``target_embedding`` [V, H] required then).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path} has no config.json: not an EAGLE-3 checkpoint directory")
    raw = json.loads(cfg_path.read_text())
    cfg = Eagle3Config.from_hf(raw, num_target_layers)
    sd: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors file")
    for f in files:
        sd.update(load_file(str(f)))
    if "d2t" in sd:
        d2t = sd["d2t"].to(torch.long)
        draft_ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t
    elif "t2d" in sd:
        draft_ids = torch.nonzero(sd["t2d"].to(torch.bool)).flatten()
    else:
        draft_ids = torch.arange(cfg.vocab_size, dtype=torch.long)
    if int(draft_ids.numel()) != cfg.draft_vocab_size:
        cfg = Eagle3Config(**{**asdict(cfg), "draft_vocab_size": int(draft_ids.numel())})
    if draft_ids.numel() and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= cfg.vocab_size):
        raise ValueError(f"{path}: d2t maps draft ids outside the target vocabulary ({cfg.vocab_size})")
    head = Eagle3Head(cfg)
    head.load_hf_state_dict(sd)
    head.to(device=device, dtype=dtype)
    if "lm_head.weight" in sd:
        w = sd["lm_head.weight"]
        if w.shape[0] != draft_ids.numel():
            raise ValueError(f"{path}: lm_head has {w.shape[0]} rows, the draft vocabulary {draft_ids.numel()}")
        weight = w
    else:
        if target_embedding is None:
            raise ValueError(f"{path} stores no lm_head: the target's embedding is needed to build it")
        weight = target_embedding[draft_ids.to(target_embedding.device)]
    head.use_head(weight.to(device=device, dtype=dtype), draft_ids.to(device))
    head.requires_grad_(False).eval()
    return head
