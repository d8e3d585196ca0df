#!/usr/bin/env bash
# The NVIDIA backend on the lent H200: install with build.sh, kernel and CUDA-graph tests natively, flash4L benchmarks
# against HF transformers and the measured roofline. One section per device call (each must stay < 10 min; a
# session has 30 min of device time, and a fresh box spends minutes compiling Triton kernels in its first model run):
#
#   install,tests,debug,small $OUT   then   install,idle $OUT (IDLE_MODELS=/tmp/flash4L)   then   install,kernels,v41 $OUT
#
# Sections: install, tests (every NVIDIA kernel test), mhc (a V4.1 sublayer's mHC input: tests, tools/gpu/gpu_mhc.py here and in .prev), humming (the humming-kernels route's tests and gpu_mxfp4.py with it), v41ab
# (v41flash8L with the humming route and without), v41prefillab (V4.1 long prefills with the route and with it off), debug (the open FP8-cache fault), quicktests, roofline,
# kernels (tools/gpu/gpu_kernels.py, tools/gpu/gpu_glue.py), fp8experts (FP8 routed experts: tests, tools/gpu/gpu_fp8_experts.py, flash4Lfp8 decode with and without DeepGEMM), logits (V4.1's head: tools/gpu/gpu_kernels.py --logits and its tests), fp8 (V4.1's FP8 projections at decode sizes: tools/gpu/gpu_fp8_linear.py and their tests; FP8_ARGS, e.g. "--rows 6 192"), mxfp4 (tools/gpu/gpu_mxfp4.py; MXFP4_TESTS narrows its tests; MXFP4_ARGS="--sweep --breakdown" adds tiles, K splits, kernels per call), v41profile (V4.1-Flash's batch-1 step, kernels by device time), flash and flashprev (flash4L decode at FLASH_BATCHES, this tree and .prev's), glue (tools/gpu/gpu_glue.py alone), b1 (batch 1 and 16 against HF only), profile (tools/profiling/profile_decode.py at batch 1 and 16), idle (idle share
# between replayed decode steps, with and without asynchronous scheduling), small (batch 1 and 16 against
# HF, batch 1 eager, batch 1 and 16 with the FP8 cache, batch 1 and 16 without asynchronous scheduling), large
# (batch 64 and 256 and an 8192-token prefill, against HF; p8192 and b256 run those alone), p512 (a 512-token prefill against HF), grouped (the grouped-GEMM experts' tests and
# tools/gpu/gpu_kernels.py --grouped; GROUPED_TESTS, GROUPED_FORMATS narrow them), v41prefill (the V4.1-Flash-shaped fixture's
# prefill at V41_PREFILL_LENS tokens, 8192 and 512), prefill (tools/profiling/profile_prefill.py on flash4L at PREFILL_LENS
# tokens, and FlashMLA's sparse prefill against ours: tools/gpu/gpu_kernels.py --prefill), v41 (the V4.1-Flash-shaped fixture at V41_BATCHES, 1 and 64; V41_TAG names the runs; BENCH_PRELUDE: Python run before a bench of a tree whose plugins are registered by hand),
# policy (tools/profiling/policy_plain_steps.py: the measured policy's booked costs against steady periods, POLICY_BATCHES),
# spec (speculative decoding with DSpark drafts on the embedded model, with and without drafts, overlapped and not;
# SPEC_BATCHES, one bench process each, SPEC_TIMEOUT each; SPEC_MODEL a fixture, SPEC_LAYERS cuts it, SPEC_TAG names the results), specprofile (tools/profiling/profile_speculative.py: a V4.1-shaped speculative step under the profiler, SPEC_BATCH), replay (SWA bounded
# replay: prefill off vs compact), v41route (V4.1 prefill with the FP8 projections' cuBLAS route and without, V41_PREFILL_LENS), serve (`deepinfer bench serve` on the embedded model, SERVE_CONCURRENCY, SERVE_ARGS (e.g. --no-engine-process), SERVE_TAG names its results; offline throughput beside it), SYNC_DEBUG=1 adds to structured and structuredprev the synchronizing calls by call site (tools/profiling/sync_sites.py); vision (the vision-attention tests and `deepinfer bench vision` at V4.1-Flash's vision config, VISION_SIZE), structured (a JSON schema's step cost at batch 32), invariant (batch-invariant mode: one output among random batches, and its cost).
# TESTS narrows `tests` to given files (TESTS_TIMEOUT: its time limit, 420 s); IDLE_MODELS and IDLE_BATCHES narrow `idle` (TOP: kernels listed), IDLE_ASYNC=1 skips its runs without overlap, TRACE=0
# its runs under the profiler, and HOST_PROFILE=1 adds a host profile; SPEC_MODEL replaces the embedded model in `spec`. A previous call's jit-cache.tgz copied to .jit-cache/previous.tgz (and carried)
# saves the compiling. Results come back as results.tgz (every pytest run's whole output included: a failure's message
# is there when the printed tail does not show it).
#
# What travels (the run tool's carry: [".wheels", ".kernels"]): `python3 tools/build/fetch_kernels.py` for .kernels, and
# for .wheels the packages the box lacks, without dependencies (it has torch, numpy, pluggy and pytest):
#   pip download --no-deps -d .wheels jsonschema jsonschema-specifications referencing lark pydantic==2.14.4 \
#       typing-inspection annotated-types fastapi starlette uvicorn h11 httpx httpcore anyio sniffio idna certifi \
#       click typing_extensions annotated-doc opentelemetry-api openai httpx2 httpcore2 truststore tabulate cuda-pathfinder
#   (openai: the test extra's; build.sh stops without it, and the install section then installs the packages alone)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .wheels rpds-py xgrammar \
#       pydantic-core==2.50.5 apache-tvm-ffi jiter httptools uvloop humming-kernels==0.1.19 "cuda-bindings<13.1"
#   The carry limit is 64 MiB with the tree (21 MB): .kernels (30 MB) and every wheel (30 MB) do not fit together; for
#   a section that needs DeepGEMM and humming (v41prefillab), carry .kernels and a .wheels of humming-kernels,
#   cuda-bindings, cuda-pathfinder and tabulate only (12.5 MB; build.sh then installs the packages without the test extra).
set -uo pipefail
sections=",$1,"
# the device tool returns a few files only: results go to one archive, repacked as each section starts
top="${2:-${OUT:-/tmp/gpu-out}}"
out="$top/results"
mkdir -p "$out"
has() { [[ "$sections" == *",$1,"* ]]; }
pack() { tar czf "$top/results.tgz" -C "$out" . ; }
stamp() { pack; echo "== $(date +%T) $*"; }
# DeepGEMM compiles each GEMM shape with NVCC on first use (minutes on a fresh box) and Triton autotunes: both
# caches live in .jit-cache, which comes back as jit-cache.tgz for the next call to carry
export DG_JIT_CACHE_DIR="$PWD/.jit-cache/deep_gemm" TRITON_CACHE_DIR="$PWD/.jit-cache/triton"
# a previous call's caches, carried back as one archive (the run tool carries 64 MiB; the unpacked caches are more)
[[ -f .jit-cache/previous.tgz ]] && tar xzf .jit-cache/previous.tgz && echo "jit caches: $(du -sh .jit-cache | cut -f1) restored"

if has install; then
    stamp install
    # the box is offline: pluggy and the test extra's and structured outputs' packages come along in .wheels
    # (without their dependencies: pip does not see the box's torch as installed)
    python3 -m pip install --quiet --no-deps --no-index .wheels/*.whl 2>&1 | grep -v "root. user" | tail -2; python3 -c "import jsonschema, lark, xgrammar; print(\"test extra packages: ok\")"
    # offline: no index, and the box's own setuptools instead of an isolated build environment; DeepSeek's kernels
    # from .kernels when it came along (tools/build/fetch_kernels.py; the run tool's carry: [".wheels", ".kernels"])
    PIP_NO_INDEX=1 PIP_NO_BUILD_ISOLATION=0 DEEPINFER_ACCELERATOR=nvidia ./build.sh 2>&1 | tee "$out/install.txt" | tail -9
    # build.sh resolves the test extra's dependencies too; when one did not come along (2026-12-05: openai), the
    # packages alone, editable and without dependencies, so that every process (the serve bench's child too) finds
    # the plugins by their entry points
    if ! python3 -c "import deepinfer_nvidia" 2>/dev/null; then
        echo "build.sh did not install; installing the packages without their dependencies"
        # (structured outputs only where xgrammar came along: a plugin that cannot load stops every command)
        features=$(for f in features/*/pyproject.toml; do printf -- "-e %s " "${f%/pyproject.toml}"; done)
        python3 -c "import xgrammar" 2>/dev/null || features="${features/-e features\/structured_outputs /}"
        PIP_NO_INDEX=1 python3 -m pip install --quiet --no-deps --no-build-isolation -e . -e backends/nvidia $features 2>&1 | tail -3
    fi
    if ! python3 -c "import xgrammar" 2>/dev/null; then  # an earlier call's plugin, on a warm box
        python3 -m pip uninstall -y --quiet deepinfer-structured-outputs 2>/dev/null
    fi
    # DeepSeek's kernels on the path as build.sh's prebuilt:.kernels puts them (its step never runs when it stops early)
    [[ -d .kernels ]] && (cd .kernels && pwd) \
        > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/deepinfer_kernels.pth"
    python3 -c 'from deepinfer_nvidia.deepseek_kernels import report; print("DeepSeek kernels:", report())' 2>&1 | tail -1
fi
# the plugins of a tree whose build.sh did not install them (structured outputs only where xgrammar came along)
register_by_hand="from deepinfer.plugins.manager import pm; import deepinfer_nvidia.plugin as p, deepinfer_mtp.plugin as m
pm.register(p, 'nvidia'); pm.register(m, 'mtp')
try:
    import deepinfer_structured_outputs.plugin as s; pm.register(s, 'structured_outputs')
except ImportError as e:
    print('structured outputs not registered:', e)"
if command -v deepinfer >/dev/null && python -c "import deepinfer_nvidia" 2>/dev/null; then
    bench=(deepinfer bench)
else  # build.sh failed: register the plugin by hand
    export PYTHONPATH="$PWD:$PWD/backends/nvidia:$PWD/features/mtp:$PWD/features/structured_outputs"
    bench=(python -c "$register_by_hand
${BENCH_PRELUDE:-}
from deepinfer.cli import main; main()" bench)
    echo "build.sh did not install the plugin; registering it by hand"
fi
export PYTHONPATH="${PYTHONPATH:-}:$PWD/backends/nvidia"
# a script run with the plugin registered by hand when build.sh did not install it (its entry point is missing)
py=(python)
[[ ${bench[0]} == python ]] && py=(python -c "$register_by_hand
import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")

if has tests; then
    stamp tests
    # TESTS narrows the list (a rerun of what failed)
    timeout ${TESTS_TIMEOUT:-420} python -m pytest -q -x ${TESTS:-tests/test_nvidia_attention.py tests/test_nvidia_moe.py tests/test_cuda_graphs.py \
        tests/test_nvidia_fp8_linear.py tests/test_nvidia_mhc.py tests/test_nvidia_deepseek_kernels.py \
        tests/test_fp8_kv_cache.py tests/test_speculative_decoding.py tests/test_dspark.py} 2>&1 | tee "$out/tests.txt" | tail -15
fi
if has debug; then  # the FP8 cache read by Triton's attention faults in padded decode steps: where
    stamp "debug fp8 graph fault"
    CUDA_LAUNCH_BLOCKING=1 timeout 200 python -m pytest -q -x tests/test_fp8_kv_cache.py -k replay 2>&1 \
        | grep -vE "^frame #|^\s*$" | tail -60 > "$out/debug_fp8.txt"
    if command -v compute-sanitizer >/dev/null; then
        timeout 300 compute-sanitizer --tool memcheck --print-limit 5 python -m pytest -q -x tests/test_fp8_kv_cache.py \
            -k replay 2>&1 | head -120 > "$out/sanitizer_fp8.txt"
    fi
fi
if has quicktests; then  # the tests of what changes most often
    stamp quicktests
    timeout 200 python -m pytest -q -x tests/test_nvidia_moe.py tests/test_nvidia_mhc.py tests/test_cuda_graphs.py 2>&1 \
        | tee "$out/quicktests.txt" | tail -4
fi

if has roofline; then
    stamp roofline
    python - <<'PY' | tee "$out/roofline.json"
import json, torch, triton.testing
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
copy_ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=200)
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a)
mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=20, rep=200)
print(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps_read_plus_write": 2 * 2**30 / copy_ms / 1e6,
                  "bf16_matmul_TFLOPS_8192": 2 * 8192**3 / mm_ms / 1e9}))
PY
fi

if has kernels; then
    stamp kernels
    timeout 200 python tools/gpu/gpu_kernels.py 2>&1 | tee "$out/kernels.json" | tail -40
    timeout 100 python tools/gpu/gpu_kernels.py --triton-fp8 2>&1 | tee "$out/kernels_triton_fp8.json" | tail -12
    has glue || timeout 150 python tools/gpu/gpu_glue.py 2>&1 | tee "$out/glue.json" | tail -40
fi
if has logits; then  # V4.1's head: fp32 logits from bf16 weights against cuBLAS on an fp32 copy, and their tests
    stamp logits
    timeout 120 python -m pytest -q -x tests/test_nvidia_logits.py 2>&1 | tee "$out/tests_logits.txt" | tail -2
    timeout 120 python tools/gpu/gpu_kernels.py --logits 2>&1 | tee "$out/kernels_logits.json" | tail -30
fi
if has fp8; then  # V4.1's FP8 projections at decode sizes: their tests, then tools/gpu/gpu_fp8_linear.py (FP8_PEER: a module timed alongside)
    stamp fp8
    timeout 240 python -m pytest -q -x tests/test_nvidia_fp8_linear.py 2>&1 | tee "$out/tests_fp8.txt" | tail -3
    PYTHONPATH="$PYTHONPATH:$PWD/tools/gpu" timeout 300 python tools/gpu/gpu_fp8_linear.py ${FP8_PEER:+--peer $FP8_PEER} ${FP8_ARGS:-} 2>&1 | grep -v INFO \
        | tee "$out/fp8_linear.jsonl" | tail -1
fi
if has mhc; then  # a V4.1 sublayer's mHC input: its tests, then tools/gpu/gpu_mhc.py for this tree and .prev's (when carried)
    stamp mhc
    timeout 200 python -m pytest -q -x tests/test_nvidia_mhc.py 2>&1 | tee "$out/tests_mhc.txt" | tail -2
    PYTHONPATH="$PYTHONPATH:$PWD/tools/gpu" timeout 120 python tools/gpu/gpu_mhc.py 2>&1 | grep -v INFO | tee "$out/mhc.jsonl"
    [[ -d .prev ]] && PYTHONPATH="$PWD/.prev:$PWD/.prev/backends/nvidia:$PWD/tools/gpu" timeout 120 python \
        tools/gpu/gpu_mhc.py 2>&1 | grep -v INFO | tee "$out/mhc_prev.jsonl"
fi
if has mxfp4; then  # the MXFP4 experts' decode strategies against the reference, timed at V4.1-Flash shapes
    stamp mxfp4
    timeout ${TESTS_TIMEOUT:-240} python -m pytest -q -x ${MXFP4_TESTS:-tests/test_nvidia_moe_mxfp4.py tests/test_nvidia_moe.py \
        tests/test_nvidia_moe_grouped.py} 2>&1 | tee "$out/mxfp4_tests.txt" | tail -4
    # the peers (humming-kernels, triton_kernels: tools/gpu/mxfp4_peers.py) come along in .peers (carried), never committed
    [[ "${MXFP4_ARGS:-}" == *--peers* && -d .peers ]] && bash .peers/install.sh 2>&1 | tail -12
    timeout ${MXFP4_TIMEOUT:-360} python tools/gpu/gpu_mxfp4.py ${MXFP4_ARGS:-} 2>&1 | grep -vE "INFO|^ " | tee "$out/mxfp4.txt" | tail -40
fi
if has humming; then  # the humming-kernels route for MXFP4 experts (moe_humming): its tests, then gpu_mxfp4.py with it
    stamp humming
    python3 -c "from deepinfer_nvidia import moe_humming; print('humming route:', moe_humming.load()[1])"
    timeout ${TESTS_TIMEOUT:-240} python -m pytest -q -x ${HUMMING_TESTS:-tests/test_nvidia_moe_humming.py tests/test_nvidia_moe.py} 2>&1 \
        | tee "$out/humming_tests.txt" | tail -6
    MXFP4_BATCHES="${MXFP4_BATCHES:-1 8 16 64 256 2048}" timeout ${MXFP4_TIMEOUT:-360} python tools/gpu/gpu_mxfp4.py \
        ${MXFP4_ARGS:-} 2>&1 | grep -vE "INFO|^ " | tee "$out/humming_mxfp4.txt" | tail -40
fi
if has fp8experts; then  # FP8 routed experts (V4-Flash-Base): tests, Triton against DeepGEMM's masked GEMM per layer, then
    # flash4Lfp8's replayed decode steps (FP8_KERNELS="auto triton" adds a run with Triton only; a fresh box compiles
    # for minutes before the first replay: once, 200 s were not enough)
    stamp fp8experts
    timeout 300 python -m pytest -q tests/test_nvidia_moe_fp8.py tests/test_nvidia_moe.py 2>&1 \
        | tee "$out/tests_fp8experts.txt" | tail -3
    PYTHONPATH="$PYTHONPATH:$PWD/tools/gpu" timeout 200 python tools/gpu/gpu_fp8_experts.py 2>&1 | grep -v INFO \
        | tee "$out/fp8_experts.jsonl"
    python -m deepinfer.testing.flash_fixtures flash4Lfp8 /tmp/flash4Lfp8 >/dev/null
    for kernels in ${FP8_KERNELS:-auto}; do
        for b in ${FP8_BATCHES:-1 64}; do
            stamp "flash4Lfp8 b$b kernels=$kernels"
            DEEPINFER_KERNELS=$kernels timeout 330 "${py[@]}" tools/profiling/profile_decode.py /tmp/flash4Lfp8 --dummy --graphs \
                --steps 48 --top 8 --trace --batch-size $b 2>&1 | grep -v INFO | tail -1 | tee -a "$out/flash4Lfp8.jsonl"
        done
    done
fi
if has glue; then  # the fused decode-step glue against its torch reference only
    stamp glue
    timeout 150 python tools/gpu/gpu_glue.py 2>&1 | tee "$out/glue.json" | tail -40
fi

python -m deepinfer.testing.flash_fixtures flash4L /tmp/flash4L >/dev/null
latency() {  # name, then bench latency arguments (--model defaults to flash4L)
    local name=$1; shift
    stamp "latency $name"
    timeout 400 "${bench[@]}" latency --model "${model:-/tmp/flash4L}" --load-format dummy --dtype bfloat16 --num-iters-warmup 1 \
        --num-iters 3 --output-json "$out/latency_$name.json" "$@" 2>&1 | grep -E "Error|error|Killed|DeepSeek kernels|MXFP4 experts" | tail -6
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: {m: v.get(m) for m in ('avg_latency','prefill_tokens_per_second','decode_tokens_per_second','step_ms')} if isinstance(v, dict) else v for k, v in r.items() if k != 'machine'})" "$out/latency_$name.json" 2>&1
}
if has profile; then  # kernels per eager decode step at batch 1 and 16
    for b in 1 16; do
        stamp "profile b$b"
        "${py[@]}" tools/profiling/profile_decode.py /tmp/flash4L --dummy --batch-size $b 2>&1 | grep -v INFO | head -22
    done
fi
if has idle; then  # device idle share between replayed decode steps, with and without overlap
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    for m in ${IDLE_MODELS:-/tmp/flash4L /tmp/v41flash8L deepinfer-tiny-v4.1}; do
        for b in ${IDLE_BATCHES:-1 64}; do
            for a in ${IDLE_ASYNC:-1 0}; do
                dummy=--dummy; [[ $m == deepinfer-tiny-v4.1 ]] && dummy=
                trace=--trace; [[ ${TRACE:-1} == 0 ]] && trace=
                stamp "idle $m b$b async=$a"
                DEEPINFER_ASYNC_SCHEDULING=$a timeout 330 "${py[@]}" tools/profiling/profile_decode.py $m $dummy --graphs --steps 48 --top ${TOP:-30} \
                    $trace --batch-size $b 2>&1 | grep -v INFO | tail -1 | tee -a "$out/idle.jsonl"
            done
        done
    done
    stamp "host profile flash4L b1"  # where the host's step goes at batch 1
    [[ ${HOST_PROFILE:-0} == 1 ]] && timeout 200 "${py[@]}" tools/profiling/profile_decode.py /tmp/flash4L --dummy --graphs --steps 48 --batch-size 1 --host-profile \
        2>&1 | grep -v INFO > "$out/host_flash4L_b1.txt"
fi
if has small || has b1; then  # b1: the two headline figures only
    latency b1 --batch-size 1 --input-len 512 --output-len 64 --compare-hf
    has small || latency b16 --batch-size 16 --input-len 512 --output-len 64 --compare-hf
fi
if has small; then
    latency b1_eager --batch-size 1 --input-len 512 --output-len 64 --enforce-eager
    latency b16 --batch-size 16 --input-len 512 --output-len 64 --compare-hf
    # the FP8 KV cache: FlashMLA serves its attention when build.sh provisioned it (the log says), Triton otherwise
    latency b1_fp8kv --batch-size 1 --input-len 512 --output-len 64 --kv-cache-dtype fp8
    latency b16_fp8kv --batch-size 16 --input-len 512 --output-len 64 --kv-cache-dtype fp8
    # the same without overlapping host work: the step_ms breakdown says where the time went
    DEEPINFER_ASYNC_SCHEDULING=0 latency b1_sync --batch-size 1 --input-len 512 --output-len 64
    DEEPINFER_ASYNC_SCHEDULING=0 latency b16_sync --batch-size 16 --input-len 512 --output-len 64
fi
if has prefill; then  # where an eager prefill's device time goes, and FlashMLA's sparse prefill against ours
    stamp "prefill kernels"
    timeout 120 python tools/gpu/gpu_kernels.py --prefill 2>&1 | tee "$out/kernels_prefill.json" | tail -24
    for n in ${PREFILL_LENS:-8192}; do
        stamp "profile prefill $n"
        timeout 240 python tools/profiling/profile_prefill.py /tmp/flash4L --dummy --input-len $n 2>&1 | grep -v INFO | tail -1 \
            | tee -a "$out/prefill_profile.jsonl"
    done
fi
if has grouped; then  # long prefills' experts through DeepGEMM's grouped GEMM: its tests, then against Triton's kernel
    stamp "grouped experts"
    timeout ${GROUPED_TESTS_TIMEOUT:-300} python -m pytest -q -x ${GROUPED_TESTS:-tests/test_nvidia_moe_grouped.py tests/test_nvidia_moe.py} 2>&1 \
        | tee "$out/tests_grouped.txt" | tail -4
    timeout 300 python tools/gpu/gpu_kernels.py --grouped 2>&1 | grep -v INFO | tee "$out/kernels_grouped.json" | grep speedup
fi
if has p512; then
    latency p512 --batch-size 1 --input-len 512 --output-len 2 --compare-hf
fi
if has v41prefill; then  # the V4.1-Flash-shaped fixture's prefill (MXFP4 experts)
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    for n in ${V41_PREFILL_LENS:-8192 512}; do
        model=/tmp/v41flash8L latency v41_p$n --batch-size 1 --input-len $n --output-len 2 --max-num-batched-tokens 8192
    done
fi
if has v41route; then  # the cuBLAS route of FP8 projections >= 192 rows, end to end: V4.1 prefill with it and without
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    for n in ${V41_PREFILL_LENS:-8192 512}; do
        model=/tmp/v41flash8L latency v41route_on_p$n --batch-size 1 --input-len $n --output-len 2 --max-num-batched-tokens 8192
        bench_saved=("${bench[@]}")  # the same bench with the route off: the Triton FP8 GEMM at every row count
        bench=(python -c "import deepinfer_nvidia.fp8_linear as f; f.BF16_GEMM_MIN_ROWS = 1 << 62
from deepinfer.cli import main; main()" bench)
        model=/tmp/v41flash8L latency v41route_off_p$n --batch-size 1 --input-len $n --output-len 2 --max-num-batched-tokens 8192
        bench=("${bench_saved[@]}")
    done
fi
if has v41prefillab; then  # V4.1 long prefills with the humming route and with it off (load() patched: Triton's kernels,
    # and DeepGEMM's grouped route from 64 rows per expert where .kernels came along), V41_PREFILL_LENS
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    for n in ${V41_PREFILL_LENS:-8192}; do
        model=/tmp/v41flash8L latency v41prefill_humming_p$n --batch-size 1 --input-len $n --output-len 2 --max-num-batched-tokens 8192
        bench_saved=("${bench[@]}")
        bench=(python -c "import deepinfer_nvidia.moe_humming as h; h.load = lambda: (None, 'humming off for the A/B')
from deepinfer.cli import main; main()" bench)
        model=/tmp/v41flash8L latency v41prefill_off_p$n --batch-size 1 --input-len $n --output-len 2 --max-num-batched-tokens 8192
        bench=("${bench_saved[@]}")
    done
fi
if has large; then
    latency b64 --batch-size 64 --input-len 512 --output-len 64 --compare-hf
fi
if has large || has p8192; then
    latency prefill8192 --batch-size 1 --input-len 8192 --output-len 2 --max-num-batched-tokens 8192 --compare-hf
fi
if has large || has b256; then  # alone first: HF's side may not fit at this batch, and its failure loses both
    latency b256 --batch-size 256 --input-len 512 --output-len 32 --max-num-batched-tokens 8192
    latency b256_hf --batch-size 256 --input-len 512 --output-len 32 --max-num-batched-tokens 8192 --compare-hf
fi
if has invariant; then  # batch-invariant mode on flash4L: one output among random batches, and its cost
    for mode in 1 0; do
        stamp "batch invariance flash4L mode=$mode"
        DEEPINFER_BATCH_INVARIANT=$mode timeout 240 "${py[@]}" tools/validation/batch_invariance.py /tmp/flash4L --load-format dummy \
            --runs ${INVARIANCE_RUNS:-12} 2>&1 | grep -v INFO | tail -2 | tee -a "$out/invariance.jsonl"
    done
    for b in ${INVARIANT_BATCHES:-16 1}; do
        latency b$b --batch-size $b --input-len 512 --output-len 64
        DEEPINFER_BATCH_INVARIANT=1 latency invariant_b$b --batch-size $b --input-len 512 --output-len 64
    done
fi
if has spec; then  # DSpark drafts on the embedded model, verification and draft passes from CUDA graphs
    # SPEC_ARGS: e.g. "--load-format dummy --synthetic-acceptance-length 1.5 2.8" with SPEC_MODEL=/tmp/v41flash6Ldspark
    # (a fixture; SPEC_LAYERS=N cuts it to N layers, its draft stages reading the last three). One bench process per
    # batch (SPEC_TIMEOUT each): a batch that runs out of time or memory keeps the others' results
    [[ ${SPEC_MODEL:-} == /tmp/* ]] && python -m deepinfer.testing.flash_fixtures "${SPEC_MODEL#/tmp/}" "$SPEC_MODEL" \
        ${SPEC_LAYERS:+--dspark-layers $SPEC_LAYERS} >/dev/null
    # the model's name in each result's (two runs in one call, e.g. a fixture's and the embedded model's, keep both)
    spec_model=${SPEC_MODEL:-deepinfer-tiny-v4.1}
    for b in ${SPEC_BATCHES:-1 32}; do
        json="$out/speculative_${spec_model##*/}${SPEC_TAG:-}_b$b.json"
        stamp "speculative ${spec_model##*/} b$b"
        timeout ${SPEC_TIMEOUT:-400} "${bench[@]}" speculative --model $spec_model --dtype bfloat16 --batch-sizes $b \
            --output-len ${SPEC_OUTPUT_LEN:-128} ${SPEC_ARGS:-} --output-json "$json" 2>&1 | grep -E "Error|error|captured a DSpark|still allocated" | head -8
        [[ -f "$json" ]] && python -c "import json, sys; r = json.load(open(sys.argv[1])); [print(b, m, round(v[m]['decode_tokens_per_second']), v[m].get('mean_acceptance_length'), v[m].get('draft_tokens'), v[m]['overlapped_steps'], v[m]['steps'], 'captures', v[m].get('graph_captures'), 'compiles', v[m].get('kernel_compiles'), v[m].get('policy_choices'), v[m].get('policy_costs_ms'), v[m].get('policy_recent_ms'), v[m].get('policy_acceptance'), v[m]['per_step_ms']) for b, v in r.items() if b.startswith('batch') for m in v if isinstance(v[m], dict) and 'decode_tokens_per_second' in v[m]]; [print(b, 'same tokens', v.get('same_tokens'), v.get('same_tokens_requests'), 'speedup', v.get('speedup')) for b, v in r.items() if b.startswith('batch')]" "$json"
    done
fi
if has policy; then  # the measured policy's booked costs against its steps' steady periods (POLICY_BATCHES; issue 42)
    for b in ${POLICY_BATCHES:-32 1}; do
        stamp "policy plain steps b$b"
        timeout ${POLICY_TIMEOUT:-150} "${py[@]}" tools/profiling/policy_plain_steps.py --batch-size $b --output-len 128 \
            --repeats 1 --pattern ${POLICY_PATTERN:-8,4} ${POLICY_ARGS:-} 2>&1 | grep -v "INFO\|Loading" | tail -1 | tee -a "$out/policy_plain_steps.jsonl"
    done
fi
if has replay; then  # SWA bounded replay, prefill off vs compact (V4.1-shaped fixture, embedded model)
    stamp "replay"
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    timeout 240 "${bench[@]}" replay --model /tmp/v41flash8L --load-format dummy --dtype bfloat16 --batch-size 4 --input-len 4096 \
        --output-len 32 --max-num-batched-tokens 16384 --output-json "$out/replay_v41flash8L.json" 2>&1 | grep -E "Error|error" | head -5
    timeout 150 "${bench[@]}" replay --model deepinfer-tiny-v4.1 --dtype bfloat16 --batch-size 4 --input-len 1024 \
        --output-len 64 --text-file README.md --max-num-batched-tokens 8192 --output-json "$out/replay_tiny.json" 2>&1 | grep -E "Error|error" | head -5
    for f in "$out"/replay_*.json; do python -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[1], r['prefill_tokens_per_second'], r['speedup'], r['last_logits_max_deviation_over_max_logit'], r['greedy_tokens_before_first_difference'])" "$f"; done
fi
if has structured; then  # a JSON schema's per-step cost at batch 32, grammar masks filled during the forward pass
    stamp "structured"
    timeout 300 "${bench[@]}" structured --model deepinfer-tiny-v4.1 --dtype bfloat16 --batch-size 32 --output-len 64 \
        --output-json "$out/structured.json" 2>&1 | grep -vE "INFO" | tail -8
    # SYNC_DEBUG=1: the same run again, every call that makes the host wait for the device counted by call site
    # (the open question of the structured steps' host phases: a wait hidden inside one); structuredprev does it too
    [[ ${SYNC_DEBUG:-0} == 1 ]] && timeout 300 "${py[@]}" tools/profiling/sync_sites.py bench structured \
        --model deepinfer-tiny-v4.1 --dtype bfloat16 --batch-size 32 --output-len 64 2>&1 | grep -vE "INFO" | tail -14
fi
if has serve; then  # deepinfer bench serve on loopback (the embedded model, SERVE_CONCURRENCY), offline throughput as the peer
    stamp "serve"
    timeout ${SERVE_TIMEOUT:-300} "${bench[@]}" serve --model deepinfer-tiny-v4.1 --dtype bfloat16 --num-prompts 64 --num-warmups 64 \
        --random-input-len 64 --random-output-len 64 --ignore-eos --max-concurrency ${SERVE_CONCURRENCY:-1 8 32 64} \
        ${SERVE_ARGS:-} --save-result --result-dir "$out/serve${SERVE_TAG:-}" 2>&1 | grep -E "Error|error|Max concurrency|Output token throughput|Mean TTFT|Mean TPOT|Median ITL|Engine steps|CUDA graphs captured|Triton kernels built|warm-up:" | head -40
    timeout 200 "${bench[@]}" throughput --model deepinfer-tiny-v4.1 --dtype bfloat16 --input-len 64 --output-len 64 \
        --num-prompts 64 --output-json "$out/throughput_tiny_64.json" 2>&1 | grep -E "Error|error" | head -4
    python -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: v for k, v in r.items() if k != 'machine'})" "$out/throughput_tiny_64.json"
    # the offline step at the served batch, after a warm-up that captures its graphs: what c = 64 could reach
    model=deepinfer-tiny-v4.1 latency tiny_b64 --batch-size 64 --input-len 64 --output-len 64
fi
if has vision; then  # V4.1-Flash's vision encoder (v41flash8Lvision, dummy weights): its tests, then bench vision
    stamp "vision"
    timeout 200 python -m pytest -q -x tests/test_vision_attention.py 2>&1 | tee "$out/tests_vision.txt" | tail -2
    python -m deepinfer.testing.flash_fixtures v41flash8Lvision /tmp/v41flash8Lvision >/dev/null
    timeout 300 "${bench[@]}" vision --model /tmp/v41flash8Lvision --load-format dummy --dtype bfloat16 \
        --image-size ${VISION_SIZE:-1024 768} --output-json "$out/vision.json" 2>&1 | grep -E "Error|error|vision attention" | head -6
    cat "$out/vision.json"
fi
if has flash; then  # flash4L decode alone (no HF run): this tree, at FLASH_BATCHES
    for b in ${FLASH_BATCHES:-1 16 64}; do
        latency flash_b$b --batch-size $b --input-len 512 --output-len 64
    done
fi
prev_latency() {  # name, model, batches: bench latency from the previous commit's tree in .prev (git archive; carried)
    local name=$1 model=$2 b; shift 2
    for b in "$@"; do
        stamp "latency ${name}_b$b (previous commit)"
        (cd .prev && PYTHONPATH="$PWD:$PWD/backends/nvidia" timeout 400 python -c "import sys; from deepinfer.plugins.manager import pm; import deepinfer_nvidia.plugin as p; pm.register(p, 'nvidia'); from deepinfer.cli import main; main()" \
            bench latency --model $model --load-format dummy --dtype bfloat16 --num-iters-warmup 1 --num-iters 3 \
            --batch-size $b --input-len 512 --output-len 64 --output-json "$out/latency_${name}_b$b.json" 2>&1 | grep -E "Error|error|Killed" | tail -4)
        python -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: {m: v.get(m) for m in ('avg_latency','decode_tokens_per_second','step_ms')} if isinstance(v, dict) else v for k, v in r.items() if k != 'machine'})" "$out/latency_${name}_b$b.json" 2>&1
    done
}
prev_run() {  # a command of the previous commit's tree in .prev (git archive; carried), its plugins registered by hand
    (cd .prev && PYTHONPATH="$PWD:$PWD/backends/nvidia:$PWD/features/mtp:$PWD/features/structured_outputs" "$@")
}
prev_bench=(python -c "$register_by_hand
from deepinfer.cli import main; main()" bench)
prev_py=(python -c "import runpy, sys; from deepinfer.plugins.manager import pm; import deepinfer_nvidia.plugin as p; pm.register(p, 'nvidia'); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
if has specprev; then  # `spec` (embedded model) from the previous commit's tree
    stamp "speculative (previous commit)"
    prev_run timeout ${SPEC_TIMEOUT:-400} "${prev_bench[@]}" speculative --model deepinfer-tiny-v4.1 --dtype bfloat16 \
        --batch-sizes ${SPEC_BATCHES:-1 32} --output-len ${SPEC_OUTPUT_LEN:-128} --output-json "$out/speculative_prev.json" 2>&1 \
        | grep -E "Error|error" | head -8
    python -c "import json, sys; r = json.load(open(sys.argv[1])); [print(b, m, round(v[m]['decode_tokens_per_second']), v[m].get('mean_acceptance_length'), v[m]['per_step_ms']) for b, v in r.items() if b.startswith('batch') for m in v if isinstance(v[m], dict) and 'decode_tokens_per_second' in v[m]]" "$out/speculative_prev.json"
fi
if has structuredprev; then  # `structured` from the previous commit's tree
    stamp "structured (previous commit)"
    prev_run timeout 300 "${prev_bench[@]}" structured --model deepinfer-tiny-v4.1 --dtype bfloat16 --batch-size 32 \
        --output-len 64 --output-json "$out/structured_prev.json" 2>&1 | grep -vE "INFO" | tail -8
    [[ ${SYNC_DEBUG:-0} == 1 ]] && prev_run timeout 300 "${prev_py[@]}" "$PWD/tools/profiling/sync_sites.py" bench \
        structured --model deepinfer-tiny-v4.1 --dtype bfloat16 --batch-size 32 --output-len 64 2>&1 | grep -vE "INFO" | tail -14
fi
if has idleprev; then  # `idle`'s replayed steps (IDLE_MODELS, IDLE_BATCHES, async on) from the previous commit's tree
    for m in ${IDLE_MODELS:-/tmp/flash4L}; do
        for b in ${IDLE_BATCHES:-1 64}; do
            stamp "idle $m b$b (previous commit)"
            prev_run timeout 330 "${prev_py[@]}" tools/profile_decode.py $m --dummy --graphs --steps 48 --top ${TOP:-30} \
                --batch-size $b 2>&1 | grep -v INFO | tail -1 | tee -a "$out/idle_prev.jsonl"
        done
    done
fi
if has hostphases; then  # the host's phases of a step when nothing overlaps them: flash4L at HOST_BATCHES, both trees
    for b in ${HOST_BATCHES:-64}; do
        DEEPINFER_ASYNC_SCHEDULING=0 latency sync_b$b --batch-size $b --input-len 512 --output-len 64
    done
    DEEPINFER_ASYNC_SCHEDULING=0 prev_latency sync_prev /tmp/flash4L ${HOST_BATCHES:-64}
fi
if has flashprev; then  # the same from the previous commit's tree, as the peer
    prev_latency flashprev /tmp/flash4L ${FLASH_BATCHES:-1 16 64}
fi
if has v41; then  # V4.1-Flash's first 8 layers, FP8 + MXFP4 as released (no HF peer: HF has no V4.1)
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    for b in ${V41_BATCHES:-1 64}; do
        model=/tmp/v41flash8L latency v41${V41_TAG:-}_b$b --batch-size $b --input-len 512 --output-len 64
    done
fi
if has v41ab; then  # v41flash8L with the humming route, then with humming uninstalled (Triton's swap-AB kernel), one call
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    for b in ${V41_BATCHES:-1 64}; do
        model=/tmp/v41flash8L latency v41humming_b$b --batch-size $b --input-len 512 --output-len 64
    done
    python3 -m pip uninstall -y -q humming-kernels 2>&1 | tail -1
    for b in ${V41_BATCHES:-1 64}; do
        model=/tmp/v41flash8L latency v41triton_b$b --batch-size $b --input-len 512 --output-len 64
    done
fi
if has v41prev; then  # the same two runs from the previous commit's tree, as the peer
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    prev_latency v41prev /tmp/v41flash8L ${V41_BATCHES:-1 64}
fi
if has v41profile; then  # where V4.1's batch-1 decode step spends its device time: replayed graphs, kernels by device time
    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L >/dev/null
    stamp "profile v41flash8L b1"
    # dependent launch off unless V41_PROFILE_PDL=1: with it, each kernel's traced time holds part of the one before
    DEEPINFER_DEPENDENT_LAUNCH=${V41_PROFILE_PDL:-0} timeout 300 "${py[@]}" tools/profiling/profile_decode.py \
        /tmp/v41flash8L --dummy --graphs --steps 48 --top ${TOP:-40} --trace \
        --batch-size 1 2>&1 | grep -v INFO | tail -1 | tee "$out/v41_profile_b1.json"
fi
if has specprofile; then  # one batch's speculative steps at V4.1-Flash shapes under the profiler (SPEC_BATCH, SPEC_PROFILE_ARGS)
    python -m deepinfer.testing.flash_fixtures v41flash8Ldspark /tmp/v41flash8Ldspark >/dev/null
    stamp "speculative profile v41flash8Ldspark b${SPEC_BATCH:-32}"
    timeout ${SPEC_TIMEOUT:-400} "${py[@]}" tools/profiling/profile_speculative.py /tmp/v41flash8Ldspark --dummy \
        --batch-size ${SPEC_BATCH:-32} ${SPEC_PROFILE_ARGS:-} 2>&1 | grep -E "^\{|Error|error|captured" | tee "$out/spec_profile.jsonl" | cut -c1-5000
fi
stamp done
# JIT_PACK=0: a call that runs this script several times packs the caches once, or never
[[ ${JIT_PACK:-1} == 1 ]] && du -sh .jit-cache/* && tar czf "$top/jit-cache.tgz" --exclude=previous.tgz .jit-cache
