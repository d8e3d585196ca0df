#!/usr/bin/env bash
# Parallelism on two lent H200s, in one device call: install, the 2-GPU parallelism tests, then `deepinfer bench
# parallel` (one GPU against data parallelism, expert parallelism and EPLB) on the embedded model and on flash4L.
#   bash tools/gpu/gpu_parallel.sh $OUT        (run tool: kind nvidia-h200-x2, carry [".wheels", ".kernels"])
set -uo pipefail
top="${1:-${OUT:-/tmp/gpu-out}}"
out="$top/results"; mkdir -p "$out"
# NVLink multicast stays off on the lent machines (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
bash tools/gpu/gpu_flash4l.sh install "$top" | tail -4
export PYTHONPATH="${PYTHONPATH:-}:$PWD/backends/nvidia"
pack() { tar czf "$top/parallel.tgz" -C "$out" . ; }
echo "== $(date +%T) tests"; pack
timeout 300 python -m pytest -q -x tests/test_parallel.py -k "${TESTS_K:-gpus}" 2>&1 | tee "$out/tests.txt" | tail -6
bench() {  # name, then bench parallel arguments
    local name=$1; shift
    echo "== $(date +%T) bench $name"; pack
    timeout 420 deepinfer bench parallel --dtype bfloat16 --output-json "$out/$name.json" "$@" 2>&1 \
        | grep -E "Error|error|EPLB" | head -8
    python -c "import json,sys; r=json.load(open(sys.argv[1])); [print(k, round(v['output_tokens_per_second']), round(v['ratio_to_one_rank'], 3), v.get('exchange_share_of_time_rank0'), v.get('eplb_windows_max_over_mean_rank_load', '')) for k, v in r.items() if k != 'machine']" "$out/$name.json"
}
[[ -z "${SKIP_TINY:-}" ]] && bench tiny --model deepinfer-tiny-v4.1 --num-prompts 64 --input-len 128 --output-len 64 --skewed \
    --num-redundant-experts 2 --eplb-step-interval 16
python -m deepinfer.testing.flash_fixtures flash4L /tmp/flash4L >/dev/null
bench flash4L --model /tmp/flash4L --load-format dummy --num-prompts 64 --input-len 512 --output-len 64 --skewed \
    --num-redundant-experts 32 --eplb-step-interval 16
echo "== $(date +%T) done"; pack
