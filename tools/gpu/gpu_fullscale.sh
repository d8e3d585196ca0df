#!/usr/bin/env bash
# The full-scale run on a lent machine of 4 or 8 H200s, in one device call: install, the full-size V4.1-Flash fixture
# (40 layers, MXFP4 experts, FP8 projections; random weights), its per-GPU decode roofline, then
# `deepinfer bench fullscale` (data-parallel attention, expert-parallel experts) with each GPU's memory from
# nvidia-smi once the model is loaded.
#   bash tools/gpu/gpu_fullscale.sh $OUT          (run tool: kind nvidia-h200-x8 or -x4, carry [".wheels", ".kernels"])
# RANKS (default: every GPU), BATCHES (per GPU, default "1 64 256"), PREFILL_LEN (8192) narrow it.
set -uo pipefail
top="${1:-${OUT:-/tmp/gpu-out}}"
out="$top/results"; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # NVLink multicast stays off on the lent machines
bash tools/gpu/gpu_flash4l.sh install "$top" | tail -3
export PYTHONPATH="${PYTHONPATH:-}:$PWD/backends/nvidia"
ranks=${RANKS:-$(nvidia-smi -L | wc -l)}
python -m deepinfer.testing.flash_fixtures v41flash /tmp/v41flash >/dev/null
echo "== $(date +%T) roofline, $ranks ranks"
python tools/profiling/decode_roofline.py /tmp/v41flash --expert-parallel "$ranks" --batch-sizes ${BATCHES:-1 64 256} 2>&1 \
    | grep -v INFO | tee "$out/roofline.jsonl"
# each GPU's memory while the bench runs (the first sample after the load is the weights' figure)
(while sleep 20; do nvidia-smi --query-gpu=index,memory.used --format=csv,noheader; echo; done) > "$out/memory.txt" &
sampler=$!
echo "== $(date +%T) bench fullscale"
timeout 540 deepinfer bench fullscale --model /tmp/v41flash --load-format dummy --dtype bfloat16 --ranks "$ranks" \
    --batch-sizes ${BATCHES:-1 64 256} --prefill-len ${PREFILL_LEN:-8192} --max-num-batched-tokens 8192 \
    --output-json "$out/fullscale.json" 2>&1 | grep -vE "INFO|Loading weights" | tail -40
kill $sampler
tail -20 "$out/memory.txt"
tar czf "$top/fullscale.tgz" -C "$out" .
