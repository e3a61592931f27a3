"""Load weights into the native model: Hugging Face directories, GGUF files, the shipped draft.

GGUF files are dequantized once by transformers and cached as a Hugging Face directory under
$SPECSPLIT_CACHE (default ~/.cache/specsplit), so later start-ups read safetensors directly; it
holds the config, the tokenizer and every tensor. With `weights="native"` (the default; models/
gguf_native.py) the linear layers and the embedding of a GGUF model keep the file's Q4_0/Q4_1/Q8_0
blocks instead, read from the .gguf itself, and only the rest (norms, other block types) comes
from the dequantized directory.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specsplit.config import ModelConfig
from specsplit.kv.meters import trim_host_memory
from specsplit.kernels import quant_linear
from specsplit.models import gguf_native
from specsplit.models.gguf_native import WEIGHT_MODES
from specsplit.models.llama import LlamaForCausalLM
from specsplit.models.registry import DRAFT_ALIAS, TARGET_ALIAS, resolve_model_path

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
DRAFT_MANIFEST = "specsplit_draft.json"


def cache_root() -> Path:
    return Path(os.environ.get("SPECSPLIT_CACHE", Path.home() / ".cache" / "specsplit"))


def model_config_from_hf(raw: dict) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(raw.get("model_type", ""))
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')}: specsplit runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or rope or None
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    num_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


class TensorSource:
    """Reads named tensors from one or more safetensors files (sharded index supported)."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: directory / f for name, f in weight_map.items()}
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {directory}")
            self._where = {}
            for f in files:
                with safe_open(f, framework="pt") as h:
                    for name in h.keys():
                        self._where[name] = f
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint")
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt")
        return self._handles[f].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    hf_dir: Path  # directory holding config.json and the tokenizer (for the draft: its base's)
    name: str
    weights: str = "fp32"  # how the weights are held: "fp32", "bf16", "native Q4_1 x210, Q8_0 x1 (88.1 MB)"


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, the config expects {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def _load_weights(model: LlamaForCausalLM, sources: list[TensorSource], show_progress: bool) -> None:
    def get(name: str) -> torch.Tensor:
        for s in sources:
            if name in s.names():
                return s.get(name)
        raise KeyError(f"tensor {name!r} is missing from the checkpoint")

    cfg = model.cfg
    # weights already attached as GGUF blocks (gguf_native.attach) are not read again
    if getattr(model.embed_tokens, "quant", None) is None:
        _copy(model.embed_tokens.weight, get("model.embed_tokens.weight"), "model.embed_tokens.weight")
    _copy(model.norm.weight, get("model.norm.weight"), "model.norm.weight")
    if model.lm_head is not None and model.lm_head.quant is None:
        _copy(model.lm_head.weight, get("lm_head.weight"), "lm_head.weight")
    layers = tqdm(range(cfg.num_layers), desc="loading layers", disable=not show_progress, leave=False)
    for i in layers:
        p = f"model.layers.{i}."
        layer = model.layers[i]
        if layer.qkv_proj.quant is None:
            qkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            _copy(layer.qkv_proj.weight, qkv, p + "self_attn.qkv")
        if cfg.attention_bias:
            bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            _copy(layer.qkv_proj.bias, bias, p + "self_attn.qkv.bias")
        if layer.o_proj.quant is None:
            _copy(layer.o_proj.weight, get(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
        if layer.gate_up_proj.quant is None:
            gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0)
            _copy(layer.gate_up_proj.weight, gate_up, p + "mlp.gate_up")
        if layer.down_proj.quant is None:
            _copy(layer.down_proj.weight, get(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
        _copy(layer.input_norm.weight, get(p + "input_layernorm.weight"), p + "input_layernorm.weight")
        _copy(layer.post_attn_norm.weight, get(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm")


def gguf_to_hf_dir(gguf_path: Path, show_progress: bool = True) -> Path:
    """Dequantize a GGUF file once (via transformers) into a cached Hugging Face directory."""
    stat = gguf_path.stat()
    out = cache_root() / "gguf" / f"{gguf_path.stem}-{stat.st_size}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face directory in %s (first use only)", gguf_path.name, out)
    if show_progress:
        print(f"specsplit: dequantizing {gguf_path.name} once into {out} ...", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A private temp dir, renamed into place: concurrent converters (containers sharing a
    # volume may even share PIDs) never write the same directory.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tied = bool(config.get("tie_word_embeddings"))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    del hf, state
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when another process finished first
    return out


def hf_dir_for(name: str, show_progress: bool = True) -> Path:
    """The Hugging Face directory (config, tokenizer, weights) behind a model argument."""
    path = resolve_model_path(name)
    if path.is_file():
        return gguf_to_hf_dir(path, show_progress)
    return path


def load_model(
    name: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    show_progress: bool = True,
    weights: str = "native",
) -> LoadedModel:
    """Build the native model for a model argument and load its weights onto the device.

    weights: "native" keeps a GGUF file's quantized blocks where a kernel runs them (CPU, fp32,
    the compiled kernel; else it falls back to dense, logged); "fp32" dequantizes as before (to
    `dtype`); "bf16" holds dense bf16 weights (the model runs in bf16). No effect on a Hugging
    Face directory other than bf16's dtype."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights {weights!r}: choose one of {', '.join(WEIGHT_MODES)}")
    if weights == "bf16":
        dtype = torch.bfloat16
    directory = hf_dir_for(name, show_progress)
    raw = json.loads((directory / "config.json").read_text())
    cfg = model_config_from_hf(raw)
    manifest_path = directory / DRAFT_MANIFEST
    sources = [TensorSource(directory)]
    tokenizer_dir = directory
    subset = None
    if manifest_path.exists():
        # A shipped draft: its own layers here, shared tensors (embedding) from its base model.
        manifest = json.loads(manifest_path.read_text())
        base_dir = hf_dir_for(manifest["base_model"], show_progress)
        sources.append(TensorSource(base_dir))
        tokenizer_dir = base_dir
        if manifest.get("vocab_subset"):
            with safe_open(directory / manifest["vocab_subset"], framework="pt") as h:
                subset = h.get_tensor("token_ids")
        base_cfg = model_config_from_hf(json.loads((base_dir / "config.json").read_text()))
        cfg = _with_eos(cfg, base_cfg.eos_token_ids)
    model = LlamaForCausalLM(cfg, dtype, device, max_positions=max_positions)
    held = str(dtype).replace("torch.", "").replace("float32", "fp32").replace("bfloat16", "bf16").replace("float16", "fp16")
    gguf_file = resolve_model_path(name)  # the .gguf itself, or a directory
    if weights == "native" and gguf_file.is_file():
        why = native_unavailable(model.device, dtype)
        if why:
            log.info("weights: %s held as dense %s (native GGUF weights need %s)", gguf_file.name, held, why)
        else:
            held = gguf_native.attach(model, gguf_file)
    _load_weights(model, sources, show_progress)
    for s in sources:
        s.close()
    if subset is not None:
        model.set_vocab_subset(subset)
    if model.select_kernels():  # CPU: kernel by row count, prepacked weights (models/cpu_linear.py)
        # Hand the freed dense copies back to the OS now: the KV cache is sized from what the
        # process holds after the load, so freed heap kept by malloc would be counted twice.
        gc.collect()
        trim_host_memory()
    model.eval()
    return LoadedModel(model=model, config=cfg, hf_dir=tokenizer_dir, name=name, weights=held)


def native_unavailable(device: torch.device, dtype: torch.dtype) -> str:
    """Why GGUF blocks cannot be kept on this device and dtype ('' when they can)."""
    if device.type != "cpu":
        return "the CPU"
    if dtype != torch.float32:
        return "--dtype fp32"
    if quant_linear.load() is None:
        return "the compiled quantized kernel (AVX2/FMA/F16C and a C++ compiler)"
    return ""


def _with_eos(cfg: ModelConfig, eos: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, eos_token_ids=cfg.eos_token_ids or eos)


def load_tokenizer(hf_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


__all__ = ["load_model", "load_tokenizer", "hf_dir_for", "model_config_from_hf", "TARGET_ALIAS", "DRAFT_ALIAS"]
