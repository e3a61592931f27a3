"""Host side of kernels/cpu/layer_stack.cpp: a GGUF model's decode or verify step through all its
layers in one compiled call, where models/lean_layer.py makes one Python call per layer (each
about fifteen Python-level operations around the kernels).

The C++ file includes decode_ops.cpp and quant_linear.cpp and is compiled with their flags, so it
runs those extensions' functions with the same arguments in the same order: a step's output
equals the LeanLayer path's bit for bit. `load()` returns None where it cannot be had (either
extension missing, no compiler, a failed build), and `stack_of` None also with
SPECSPLIT_LAYER_STACK=0 (read at each model's kernel choice); the model then runs its LeanLayers
one call each, as before.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from specsplit.kernels import decode_ops, quant_linear
from specsplit.kernels.cpu_build import build

SOURCE = Path(__file__).resolve().parent / "cpu" / "layer_stack.cpp"
INCLUDES = (decode_ops.SOURCE, quant_linear.SOURCE)
ENV_SWITCH = "SPECSPLIT_LAYER_STACK"  # "0": never build or use it (the per-layer Python path runs)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]  # quant_linear's (decode_ops' plus F16C)


def enabled() -> bool:
    """SPECSPLIT_LAYER_STACK not "0", read whenever a model chooses its kernels (the bench's
    `native-layers` weights arm switches it off for one load)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled extension, or None (logged once) where it cannot be had."""
    if decode_ops.load() is None or quant_linear.load() is None:
        return None
    return build("specsplit_layer_stack", SOURCE, CFLAGS, "CPU layer stack", "each layer's step is a Python call",
                 includes=INCLUDES)


def stack_of(lean_layers) -> object | None:
    """A LayerStack holding the weights the LeanLayers bound (the same tensors, not copies), or
    None without the extension. The layers must share their attention shape and scale."""
    if not lean_layers or not enabled():
        return None
    m = load()
    if m is None:
        return None
    first = lean_layers[0]
    shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scale)
    if any((l.num_heads, l.num_kv_heads, l.head_dim, l.scale) != shape for l in lean_layers):
        return None
    stack = m.LayerStack(*shape)
    for layer in lean_layers:
        args = []
        for w, bias in layer.weights:
            args += [w.blocks, quant_linear.TYPES[w.qtype][0], bias, w.layout == "tiles"]
        stack.add(*args, layer.avx512, *layer.input_norm, *layer.post_attn_norm)
    return stack
