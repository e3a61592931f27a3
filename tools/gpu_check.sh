#!/usr/bin/env bash
# The GPU check (under 8 minutes on one GPU): what CI, which never has a GPU, cannot run.
#   1. the CUDA-dependent tests: Triton kernels compiled for real (tests/kernels run in Triton's
#      interpreter on a CPU), kernel dispatch, the greedy-equality and sampling suites on CUDA;
#   2. a short `specsplit bench` on CUDA: target-only, the K policy, fixed K, interleaved.
# Usage (on the GPU machine, from the repository root, with a CUDA build of torch 2.13.0 and the
# project installed):   bash tools/gpu_check.sh [OUT_DIR]
# Results: OUT_DIR/pytest.txt, OUT_DIR/bench/bench.json and .png, OUT_DIR/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python

"$PY" - <<'PY' | tee "$OUT/summary.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for the GPU machine"
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2

# 1. tests that take the CUDA path when a GPU is present (5 minutes at most)
timeout 300 "$PY" -m pytest -q -x tests/kernels tests/unit/test_spec_greedy_equality.py \
    tests/unit/sampling tests/unit/test_k_policy.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -3
tests_rc=${PIPESTATUS[0]}

# 2. a short benchmark on CUDA (2 minutes at most): batch-1 arms interleaved, no HF, no split
timeout 150 "$PY" -m specsplit.cli bench spec --device cuda --dtype bf16 --num-prompts 2 \
    --new-tokens 48 --repeats 1 --ks 2,4 --no-split --no-hf --concurrency 4 --no-progress --out "$OUT/bench" \
    2>&1 | tail -25 | tee -a "$OUT/summary.txt"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc" | tee -a "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
