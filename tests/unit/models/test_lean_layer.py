"""models/lean_layer: the GGUF target's decode and verify steps as direct kernel calls give the
modules' results bit for bit (the same calls with the same arguments), and so does the compiled
stack of them (kernels/layer_stack.py: all the layers in one call, or one call per stretch up to
each captured layer), draft trees included; prefill still runs the modules, and the lean step is only
chosen where every piece runs on the CPU kernels (not with dense fp32 weights, not after
--deterministic swaps the attention)."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from specsplit.kernels import decode_ops, layer_stack
from specsplit.models import cpu_linear
from specsplit.models.deterministic import make_deterministic
from specsplit.models.lean_layer import LeanLayer
from specsplit.models.llama import LEAN_ANY_ROWS
from specsplit.models.loader import load_model
from specsplit.models.runner import ForwardItem, ModelRunner
from tests.helpers.gguf import NEEDS_GGUF, NEEDS_QUANT_KERNEL

pytestmark = [NEEDS_GGUF, NEEDS_QUANT_KERNEL,
              pytest.mark.skipif(decode_ops.load() is None, reason="no AVX2/FMA CPU or no C++ compiler: no decode ops")]


@pytest.fixture(scope="module")
def native():
    mp = pytest.MonkeyPatch()
    mp.setenv(cpu_linear.ENV_POLICY, "static")  # no timing: deterministic tables, a fast load
    try:
        return load_model("smollm2-135m", show_progress=False).model
    finally:
        mp.undo()


class _CountingStack:
    """The model's LayerStack, recording the rows and layer ranges of each run."""

    def __init__(self, stack, seen: list):
        self.stack, self.seen = stack, seen

    def run(self, x, *args):  # args: ..., begin, end, tree_mask
        self.seen.append((x.shape[0], args[-3], args[-2]))
        return self.stack.run(x, *args)


@contextmanager
def _lean(model, on: bool | str):
    """Rows of every lean step run in the block (a list filled as they run), with the lean layers
    on (True: through the compiled stack where it was built; "layers": one LeanLayer call each) or
    off (the modules); the model's own lean_layers and stack are put back afterwards."""
    kept, stack, seen = model.lean_layers, model.lean_stack, []
    original = LeanLayer.__call__

    def counting(self, *a, **k):
        seen.append(a[0].shape[0])
        return original(self, *a, **k)

    if not on:
        model.lean_layers = None
    if on is True and stack is not None:
        stack_seen: list = []
        model.lean_stack = _CountingStack(stack, stack_seen)
    else:
        stack_seen, model.lean_stack = None, None
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LeanLayer, "__call__", counting)
            yield seen
    finally:
        model.lean_layers, model.lean_stack = kept, stack
        if stack_seen is not None:  # each stack run stands for its layers' LeanLayer calls
            seen.extend(rows for rows, begin, end in stack_seen for _ in range(begin, end))


def _steps(model, prompt: list[int], decode: list[int], verify: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill, one-token decodes, then a (len(verify))-row verify."""
    runner = ModelRunner(model, num_blocks=16, block_size=16, max_model_len=256)
    out = [runner.forward([ForwardItem("s", 0, prompt, num_logits=1)])[0]]
    pos = len(prompt)
    for t in decode:
        out.append(runner.forward([ForwardItem("s", pos, [t], num_logits=1)])[0])
        pos += 1
    out.append(runner.forward([ForwardItem("s", pos, verify, num_logits=len(verify))])[0])
    return out


def _assert_equal(lean: list[torch.Tensor], plain: list[torch.Tensor]) -> None:
    assert len(lean) == len(plain)
    for a, b in zip(lean, plain):
        assert torch.equal(a, b)


def _tiles(model) -> bool:
    return model.layers[0].qkv_proj.quant.layout == "tiles"


def test_native_target_gets_a_lean_step_for_the_quantized_rows(native):
    lean = native.lean_layers
    assert lean is not None and len(lean) == len(native.layers)
    assert all(isinstance(layer, LeanLayer) for layer in lean)
    # the static table runs the quantized kernel at 1-16 rows (weights in AMX tiles: at any row
    # count), so does the lean step
    assert lean[0].rows == (LEAN_ANY_ROWS if _tiles(native) else cpu_linear.QUANT_ROWS)


def test_lean_rows_follow_the_kernel_tables(native):
    """The lean step serves the row counts at which every linear of every layer runs the quantized
    kernel: all of them where the tables say quant throughout, else up to the first other kernel."""
    linears = [m for layer in native.layers for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    kept = [m.kernels for m in linears]
    Q, D = cpu_linear.QUANT, cpu_linear.DEQUANT
    try:
        for tables, rows in [
            ([cpu_linear.RowKernels.single(Q)] * len(linears), LEAN_ANY_ROWS),
            ([cpu_linear.RowKernels((16,), (Q,), D)] * len(linears), 16),
            ([cpu_linear.RowKernels((16,), (Q,), D)] * (len(linears) - 1) + [cpu_linear.RowKernels((8,), (Q,), D)], 8),
        ]:
            for m, table in zip(linears, tables):
                m.kernels = table
            assert native._lean_layers()[0].rows == rows
    finally:
        for m, table in zip(linears, kept):
            m.kernels = table


def test_native_target_gets_the_compiled_stack_where_it_builds(native):
    if layer_stack.load() is None:
        assert native.lean_stack is None
        pytest.skip("no layer stack extension here: the lean layers run one call each")
    assert len(native.lean_stack) == len(native.layers)


@pytest.mark.parametrize("lean_mode", [True, "layers"], ids=["stack", "layers"])
def test_lean_steps_equal_the_modules_bit_for_bit(native, lean_mode):
    prompt = [1, 504, 3458, 282, 4054, 314, 253, 1345, 30, 1204, 2]  # an 11-row prefill
    decode = [585, 17, 4991, 42]
    verify = [28, 906, 2012, 15, 389]  # a 5-row verify step
    with _lean(native, lean_mode) as seen:
        lean = _steps(native, prompt, decode, verify)
    with _lean(native, False) as none:
        plain = _steps(native, prompt, decode, verify)
    assert set(seen) == {11, 1, 5} and not none  # every step of up to 16 rows ran the lean layers
    assert len(seen) == len(native.layers) * (1 + len(decode) + 1)  # every layer of every step
    _assert_equal(lean, plain)


def test_captured_layers_equal_through_the_stack(native):
    """A feature drafter's capture (three layers' outputs) splits the stack's run at each: the
    captured outputs and the logits are the per-layer path's bit for bit."""
    if native.lean_stack is None:
        pytest.skip("no layer stack extension here")
    layers = (1, 14, len(native.layers) - 1)  # the last one ends the last run

    def run():
        runner = ModelRunner(native, num_blocks=16, block_size=16, max_model_len=256)
        feats: list = []
        runner.forward([ForwardItem("s", 0, [1, 504, 3458, 282, 4054], num_logits=1)])
        out = runner.forward([ForwardItem("s", 5, [314, 253, 1345], num_logits=3)], features=layers, out_features=feats)
        return out + feats

    with _lean(native, True) as seen:
        stack = run()
    with _lean(native, "layers"):
        per_layer = run()
    assert seen.count(3) == len(native.layers)
    _assert_equal(stack, per_layer)


def test_a_batch_of_sequences_with_mixed_rows_equals_the_modules(native):
    """Three sequences in one forward, as a batched verify step: one decode row, a 4-row verify
    and a 2-row verify (7 rows); then a verify of a draft tree beside a decode row, which runs the
    lean step too (the C++ attention reads the tree's ancestor bits): the modules' logits bit for
    bit, and each tree node's the logits of its path verified as a chain (bit for bit with the
    weights in AMX tiles; within fp32 rounding in the rows layout)."""
    prompts = {"a": [1, 504, 3458, 282], "b": [1, 9690, 198, 2683, 359, 253], "c": [1, 28, 906]}
    tree = (-1, 0, 0, 1, -1)  # b's drafts 7, 8, 9, 10, 11: 8 and 9 children of 7, 10 of 8, 11 of the root

    def run() -> list[torch.Tensor]:
        runner = ModelRunner(native, num_blocks=16, block_size=16, max_model_len=256)
        runner.forward([ForwardItem(s, 0, p, num_logits=1) for s, p in prompts.items()])
        out = runner.forward([ForwardItem("a", 4, [585], num_logits=1),
                              ForwardItem("b", 6, [17, 4991, 42, 28], num_logits=4),
                              ForwardItem("c", 3, [2012, 15], num_logits=2)])
        # b's next verify: its last token, then the tree; a decodes one token beside it
        out += runner.forward([ForwardItem("a", 5, [906], num_logits=1),
                               ForwardItem("b", 10, [389, 7, 8, 9, 10, 11], num_logits=6, tree=tree)])
        # each node's path as a chain, on a copy of b's context
        for node, path in enumerate([[7], [7, 8], [7, 9], [7, 8, 10], [11]]):
            seq = f"path{node}"
            runner.forward([ForwardItem(seq, 0, prompts["b"] + [17, 4991, 42, 28], num_logits=1)])
            out.append(runner.forward([ForwardItem(seq, 10, [389, *path], num_logits=1)])[0])
        return out

    with _lean(native, True) as seen:
        lean = run()
    with _lean(native, False):
        plain = run()
    assert seen.count(7) == 2 * len(native.layers)  # the 7-row verify batch, and the 7-row tree step
    _assert_equal(lean, plain)
    tree_logits, paths = lean[4], lean[5:]  # out: the verify's a, b, c; the tree step's a, b; the chains
    assert tree_logits.shape[0] == 6 and len(paths) == len(tree)
    for node, chain in enumerate(paths):  # row 0: the root; row 1 + i: node i
        if _tiles(native):  # the AMX loop gives a row the same bits at any row count
            assert torch.equal(tree_logits[1 + node], chain[0]), node
        else:  # the rows layout's loops sum a 7-row call's rows in another order than a 2-4-row one's
            torch.testing.assert_close(tree_logits[1 + node], chain[0], rtol=1e-5, atol=1e-4)


def test_more_rows_than_the_quantized_kernel_serves_run_the_modules(native):
    """A 40-row prefill: past the static table's 16 quantized rows the modules run (a dequantized
    GEMM); with the weights in AMX tiles the quantized kernel serves every row count, and so does
    the lean step. Either way the modules' logits, bit for bit."""
    prompt = list(range(100, 140))
    with _lean(native, True) as seen:
        lean = _steps(native, prompt, [7], [8, 9])
    with _lean(native, False):
        plain = _steps(native, prompt, [7], [8, 9])
    assert set(seen) == ({40, 1, 2} if _tiles(native) else {1, 2})
    _assert_equal(lean, plain)


def test_no_lean_step_with_dense_weights_or_batch_invariant_attention(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_POLICY, "static")
    dense = load_model("smollm2-135m", show_progress=False, weights="fp32").model
    assert dense.lean_layers is None  # fp32 linears: MKL / oneDNN, not the quantized kernel
    native = load_model("smollm2-135m", show_progress=False).model
    assert native.lean_layers is not None
    make_deterministic(native)  # row-wise linears and the batch-invariant attention
    assert native.lean_layers is None and native.lean_stack is None
