"""kernels/layer_stack.py: the compiled stack's build is keyed by the files it includes too
(kernels/cpu_build.py build_name), so a change to decode_ops.cpp or quant_linear.cpp alone never
loads a stale stack; and the stack refuses what it cannot run with a message. Its output against
the per-layer path: tests/unit/models/test_lean_layer.py."""
from __future__ import annotations

import pytest
import torch

from specsplit.kernels import layer_stack
from specsplit.kernels.cpu_build import build_name


def test_the_build_name_follows_the_included_files(tmp_path):
    source, header = tmp_path / "stack.cpp", tmp_path / "ops.cpp"
    source.write_text('#include "ops.cpp"\n')
    header.write_text("int f() { return 1; }\n")
    flags = ["-O3"]
    first = build_name("x", source, flags, (header,))
    assert build_name("x", source, flags, (header,)) == first  # stable
    header.write_text("int f() { return 2; }\n")
    assert build_name("x", source, flags, (header,)) != first  # an included file changed: a new build
    assert build_name("x", source, ["-O2"], (header,)) != build_name("x", source, flags, (header,))


def test_the_stack_includes_both_extensions_sources():
    text = layer_stack.SOURCE.read_text()
    for f in layer_stack.INCLUDES:
        assert f'#include "{f.name}"' in text and f.exists()


def test_bad_layer_ranges_and_kv_shapes_are_refused():
    m = layer_stack.load()
    if m is None:
        pytest.skip("no layer stack extension here (no AVX2/FMA/F16C or no compiler)")
    stack = m.LayerStack(2, 1, 8, 0.35)
    assert len(stack) == 0
    x, cs = torch.zeros(1, 16), torch.zeros(1, 1, 8)
    ids = torch.zeros(1, dtype=torch.int64)
    kv = torch.zeros(1, 2, 4, 16, 1, 8)
    with pytest.raises(RuntimeError, match=r"layers \[0, 1\) of 0"):
        stack.run(x, cs, cs, ids, ids.view(1, 1), ids, ids, kv, 0, 1)
    assert stack.run(x, cs, cs, ids, ids.view(1, 1), ids, ids, kv, 0, 0) is not None  # no layers: x back
    with pytest.raises(RuntimeError, match="heads"):
        m.LayerStack(3, 2, 8, 0.35)
