"""Weights arms for the decode benchmarks (tools/gguf_decode_bench.py, tools/verify_cost.py): a
weights mode (native, fp32, bf16) with suffixes that switch one load-time choice off, to compare
a choice against its absence in one process, interleaved:

    native-rows     the rows layout even where the AMX tiles loop runs (SPECSPLIT_QUANT_AMX=0)
    native-4k       the blocks left in 4 KB pages (SPECSPLIT_HUGE_PAGES=0; a KV cache made after
                    the load, as the tools make theirs, is in huge pages in every arm)
    native-rows-4k  both
    native-layers   one Python call per layer instead of the compiled stack of all of them
                    (SPECSPLIT_LAYER_STACK=0; kernels/layer_stack.py)

The switches are read while the model loads; the loaded model keeps what was chosen."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from specsplit.kernels import layer_stack, quant_linear
from specsplit.kv import huge_pages

# suffix -> env set to "0"
SWITCHES = {"rows": quant_linear.ENV_AMX, "4k": huge_pages.ENV_SWITCH, "layers": layer_stack.ENV_SWITCH}


@contextmanager
def loading(arm: str) -> Iterator[str]:
    """`with loading("native-rows") as weights: load_model(..., weights=weights)`: the switches
    the suffixes name are off inside, restored after."""
    weights, *off = arm.split("-")
    unknown = [o for o in off if o not in SWITCHES]
    if unknown:
        raise ValueError(f"weights arm {arm!r}: unknown suffix {unknown[0]!r} (known: {', '.join(SWITCHES)})")
    saved = {SWITCHES[o]: os.environ.get(SWITCHES[o]) for o in off}
    os.environ.update({name: "0" for name in saved})
    try:
        yield weights
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
