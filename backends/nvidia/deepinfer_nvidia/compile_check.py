"""Compile every Triton kernel of this plugin for the H200 (SM90) to a cubin, on any machine (no GPU needed):
Triton's interpreter, which runs the kernel tests on a CPU, accepts code the compiler rejects (dtype rules, loops,
casts). ``python -m deepinfer_nvidia.compile_check`` prints one line per kernel and exits 1 if any fails. Run it
without ``TRITON_INTERPRET``: under the interpreter, ``@triton.jit`` makes no compilable kernels.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deepinfer_nvidia import (activation, cache_formats, compress_pool, dependent_launch, fp8_bf16_gemm, fp8_gemv,
                              fp8_linear, fp8_rounding, kv_store, logits, mhc, mhc_weights, moe, moe_blocks,
                              moe_fp4_bytes, moe_fp8, moe_grouped, moe_humming, moe_mxfp4, norm, rope, routing, sampling,
                              slots, split_k)
from deepinfer_nvidia import sparse_attention as attention

SM90 = GPUTarget("cuda", 90, 32)
ATTENTION_POINTERS = {"q_ptr": "*bf16", "ia_ptr": "*i64", "ib_ptr": "*i64", "sink_ptr": "*fp32", "out_ptr": "*bf16",
                      "part_ptr": "*fp32", "stat_ptr": "*fp32"}
EXPERT_POINTERS = {"a_rows_ptr": "*i32", "out_ptr": "*fp32", "out_rows_ptr": "*i32", "block_expert_ptr": "*i32",
                   "block_start_ptr": "*i32", "block_rows_ptr": "*i32"}

GEMV_POINTERS = {"x_ptr": "*i64", "w_ptr": "*i32", "sw_ptr": "*fp32", "y_ptr": "*bf16", "partial_ptr": "*fp32",
                 "arrivals_ptr": "*i32"}
GEMV_CONSTEXPRS = {"NUM_BLOCKS": 160, "CHUNKS_PER_SPLIT": 5, "SPLITS": 4, "W_ROW_TILE": 32, "BK": 32,
                   "NATIVE_FP8": True, "BN": fp8_gemv.GEMV_TILES["BN"], "KB": fp8_gemv.GEMV_TILES["KB"],
                   "AHEAD": fp8_gemv.GEMV_AHEAD, "ROUND_X": True}

ROUNDING = {"ROWS": 1, "SEGMENTS": 32, "NATIVE_FP8": True, "ROUND_TRIP": False, "PAIRS_APART": False, "SWIGLU": False}

CASES = {
    "fp8 gemm": (fp8_linear._fp8_gemm_kernel, {"q_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                                                "sw_ptr": "*fp32", "y_ptr": "*bf16"},
                 {"NUM_BLOCKS": 32, "W_ROW_TILE": 128, "BK": 128, "NATIVE_FP8": True, "BM": 16, "BN": 64}),
    "fp8 gemm, few rows, split K": (fp8_linear._fp8_gemm_few_rows_kernel,
                                    {"q_ptr": "*bf16", "sx_ptr": "*bf16", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32",
                                     "y_ptr": "*bf16", "partial_ptr": "*fp32", "arrivals_ptr": "*i32"},
                                    {"NUM_BLOCKS": 160, "BLOCKS_PER_SPLIT": 12, "SPLITS": 14, "W_ROW_TILE": 32,
                                     "BK": 32, "NATIVE_FP8": True, "BN": 64, "BM": 8, "QUANTIZE": True,
                                     "SUM_HERE": True, "UNROUNDED": False}),
    "fp8 gemm, few rows, unrounded (grouped wo_a)": (fp8_linear._fp8_gemm_few_rows_kernel,
                                                     {"q_ptr": "*bf16", "sx_ptr": "*bf16", "w_ptr": "*fp8e4nv",
                                                      "sw_ptr": "*fp32", "y_ptr": "*bf16", "partial_ptr": "*fp32",
                                                      "arrivals_ptr": "*i32"},
                                                     {"NUM_BLOCKS": 128, "BLOCKS_PER_SPLIT": 8, "SPLITS": 16,
                                                      "W_ROW_TILE": 32, "BK": 32, "NATIVE_FP8": True, "BN": 64,
                                                      "BM": 8, "QUANTIZE": False, "SUM_HERE": True,
                                                      "UNROUNDED": True}),
    "fp8 gemm, few rows, rounded first": (fp8_linear._fp8_gemm_few_rows_kernel,
                                          {"q_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                                           "sw_ptr": "*fp32", "y_ptr": "*bf16", "partial_ptr": "*bf16",
                                           "arrivals_ptr": "*i32"},
                                          {"NUM_BLOCKS": 40, "BLOCKS_PER_SPLIT": 20, "SPLITS": 2, "W_ROW_TILE": 128,
                                           "BK": 128, "NATIVE_FP8": True, "BN": 128, "BM": 64, "QUANTIZE": False,
                                           "SUM_HERE": False, "UNROUNDED": False}),
    "fp8 gemv, one row": (fp8_gemv._fp8_gemv_kernel, GEMV_POINTERS, GEMV_CONSTEXPRS),
    "fp8 gemv, one row, one chunk ahead": (fp8_gemv._fp8_gemv_kernel, GEMV_POINTERS, GEMV_CONSTEXPRS | {"AHEAD": 1}),
    "fp8 gemv, one row, grouped, unrounded activations": (fp8_gemv._fp8_gemv_kernel, GEMV_POINTERS,
                                                          GEMV_CONSTEXPRS | {"ROUND_X": False}),
    "fp8 weight expanded to bf16": (fp8_bf16_gemm._expand_kernel, {"w_ptr": "*fp8e4nv", "sw_ptr": "*fp32",
                                                                   "out_ptr": "*bf16"},
                                    {"W_ROW_TILE": 32, "W_COL_TILE": 32, "BN": 32, "BK": 128}),
    "fp8 split sum": (split_k.sum_splits_kernel, {"partial_ptr": "*fp32", "y_ptr": "*bf16"},
                      {"SPLITS": 6, "BLOCK": 1024}),
    "activation quant": (fp8_rounding._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                         ROUNDING | {"BLOCK": 32, "ROWS": 8, "SEGMENTS": 16}),
    "activation fp8 round trip": (fp8_rounding._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*bf16",
                                                                 "s_ptr": "*bf16"},
                                  ROUNDING | {"BLOCK": 128, "ROUND_TRIP": True}),
    "swiglu, fp8 round trip": (fp8_rounding._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*bf16", "s_ptr": "*bf16",
                                                              "up_ptr": "*bf16"},
                               ROUNDING | {"BLOCK": 32, "ROWS": 4, "SEGMENTS": 4, "ROUND_TRIP": True, "SWIGLU": True}),
    "activation quant, pairs apart": (fp8_rounding._act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp16",
                                                                     "s_ptr": "*fp32"},
                                      ROUNDING | {"BLOCK": 32, "PAIRS_APART": True}),
    "fp32 logits from a bf16 head": (logits._bf16_logits_kernel, {"x_ptr": "*fp32", "w_ptr": "*bf16",
                                                                   "y_ptr": "*fp32"},
                                     {"BM": 16, "BN": 128, "BK": 64, "NATIVE": True}),
    "attention bf16": (attention._attention_kernel,
                       {**ATTENTION_POINTERS, "a_ptr": "*bf16", "a_bytes_ptr": "*bf16", "b_ptr": "*bf16",
                        "b_bytes_ptr": "*bf16"},
                       {"D": 512, "BLOCK_H": 32, "BLOCK_N": 32, "HAS_B": True, "FINAL": True, "NATIVE": True,
                        "PRECISION": "tf32", "FP8": False}),
    "attention fp8 cache": (attention._attention_kernel,
                            {**ATTENTION_POINTERS, "a_ptr": "*fp8e4nv", "a_bytes_ptr": "*u8", "b_ptr": "*fp8e4nv",
                             "b_bytes_ptr": "*u8"},
                            {"D": 512, "BLOCK_H": 32, "BLOCK_N": 32, "HAS_B": True, "FINAL": False, "NATIVE": True,
                             "PRECISION": "tf32", "FP8": True}),
    "split merge": (attention._merge_kernel, {"part_ptr": "*fp32", "stat_ptr": "*fp32", "sinks_ptr": "*fp32",
                                              "out_ptr": "*bf16"}, {"D": 512, "SPLITS": 8}),
    "flashmla prefill merge": (attention._merge_normalized_kernel,
                               {"a_ptr": "*bf16", "lse_a_ptr": "*fp32", "b_ptr": "*bf16", "lse_b_ptr": "*fp32",
                                "sinks_ptr": "*fp32", "out_ptr": "*bf16"}, {"D": 512}),
    "indexer": (attention._indexer_kernel, {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": "*bf16", "c_ptr": "*i64",
                                            "out_ptr": "*fp32"},
                {"D": 128, "BLOCK_H": 64, "BLOCK_C": 64, "TILES": 4, "NATIVE": True, "PRECISION": "tf32"}),
    "fp8 cache store": (kv_store._fp8_store_kernel, {"rows_ptr": "*bf16", "slots_ptr": "*i64", "fp8_ptr": "*fp8e4nv",
                                                    "bytes_ptr": "*u8"}, {}),
    **{f"mxfp4 experts, {name}": (
        moe_fp4_bytes._fp4_experts_kernel,
        {**EXPERT_POINTERS, "a_ptr": "*fp16", "sa_ptr": "*fp32", "w_ptr": "*i8", "v_ptr": "*i8",
         "sw_ptr": "*i32" if words else "*u8", "sv_ptr": "*i32" if words else "*u8"},
        {"K": 4096, "ACT_BLOCK": 128, "BLOCK_M": rows, "BN": 64, "BK": 128, "SWIGLU": True, "NATIVE": True,
         "PACKED": packed, "WORD_SCALES": words})
        for name, packed, rows, words in (("int16 decode", False, 16, False), ("packed decode", True, 16, False),
                                          ("scale words", True, 16, True), ("64-row blocks", True, 64, True))},
    **{f"mxfp4 swap-AB experts, {rows}-row blocks, K in {splits}, {unroll} chunks a step": (
        moe_mxfp4._experts_kernel,
        {**EXPERT_POINTERS, "a_ptr": "*bf16", "w_ptr": "*i8", "v_ptr": "*i8", "sw_ptr": "*i16", "sv_ptr": "*i16"},
        {"K": 5120, "BLOCK_M": rows, "BN": bn, "SWIGLU": True, "SPLITS": splits, "UNROLL": unroll, "NATIVE": True,
         "EVEN_N": True})
        for rows, bn, splits, unroll in ((16, 64, 1, 4), (16, 64, 4, 2), (64, 128, 1, 1))},
    "mxfp4 split-K sums": (moe_mxfp4._reduce_splits, {"parts_ptr": "*fp32", "out_ptr": "*fp32"},
                           {"SPLITS": 4, "SWIGLU": True, "BLOCK": 1024}),
    "mxfp4 repacked dequantization": (moe_mxfp4._dequant_kernel,
                                      {"w_ptr": "*i8", "s_ptr": "*i16", "out_ptr": "*bf16"},
                                      {"K": 2304, "ROWS": 16}),
    "float experts": (moe._float_experts_kernel, {**EXPERT_POINTERS, "a_ptr": "*bf16", "w_ptr": "*bf16",
                                                  "v_ptr": "*bf16"},
                      {"K": 4096, "BLOCK_M": 64, "BN": 64, "BK": 64, "SWIGLU": True, "NATIVE": True}),
    **{f"fp8 experts, {rows}-row blocks, {chunk}-column chunks": (
        moe_fp8._fp8_experts_kernel,
        {**EXPERT_POINTERS, "a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "w_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv",
         "sw_ptr": "*u8", "sv_ptr": "*u8"},
        {"K": 4096, "ACT_BLOCK": 128, "ROW_TILE": chunk, "COL_TILE": chunk, "BLOCK_M": rows, "BN": 64, "BK": chunk,
         "SWIGLU": True, "NATIVE_FP8": True})
        for rows, chunk in ((16, 128), (64, 128), (16, 32))},
    "expert blocks": (moe_blocks._blocks_kernel, {"ids_ptr": "*i64", **{f"{n}_ptr": "*i32" for n in (
                          "order", "token_of", "sorted_rows", "expert", "start", "rows")}},
                      {"TOP_K": 6, "BM": 16, "E_PAD": 256, "CHUNK": 16}),
    "humming's indexed tables": (moe_humming._indexed_kernel, {f"{n}_ptr": "*i32" for n in (
                                      "order", "rows", "start", "sorted", "padded")},
                                  {"BLOCK": 48, "SLOTS": 64, "COUNT_CHUNK": 1024}),
    "mxfp4 dequantization": (moe_grouped._dequant_fp4_kernel, {"codes_ptr": "*i8", "scales_ptr": "*u8",
                                                               "out_ptr": "*i32"},
                             {"HALF_K": 2048, "ROWS": 8, "BLOCK": 256}),
    "expert combine": (moe_blocks._combine_kernel, {"down_ptr": "*fp32", "weights_ptr": "*fp32", "out_ptr": "*bf16"},
                       {"TOP_K": 6, "BLOCK_D": 1024}),
    "compressor rows": (compress_pool._compressor_rows_kernel, {"kv_ptr": "*bf16", "score_ptr": "*bf16",
                                                                "bias_ptr": "*fp32", "positions_ptr": "*i64",
                                                                "slots_ptr": "*i64", "state_ptr": "*fp32"},
                        {"BLOCK_C": 1024}),
    "shared expert swiglu": (activation._swiglu_kernel, {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16"},
                             {"BLOCK": 1024}),
    "rms norm": (norm._rms_norm_kernel, {"x_ptr": "*bf16", "weight_ptr": "*fp32", "out_ptr": "*bf16"},
                 {"BLOCK_D": 1024, "WEIGHTED": True}),
    "window slots": (slots._window_kernel, {"positions_ptr": "*i64", "owner_ptr": "*i64", "table_ptr": "*i64",
                                            "window_ptr": "*i64", "written_ptr": "*i64"},
                     {"BLOCK_SIZE": 128, "W_PAD": 128}),
    "compressed slots": (slots._compressed_kernel, {**{f"{n}_ptr": "*i64" for n in (
                             "positions", "owner", "comp", "state", "candidates", "close_rows", "state_slots",
                             "close_slots", "close_positions")}},
                         {"RATIO": 4, "OVERLAP": 2, "BLOCK_SIZE": 128, "BLOCK_C": 256, "STATE_PAD": 8}),
    "router logits": (routing._logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "logits_ptr": "*fp32"},
                      {"H_PAD": 4096, "BLOCK_T": routing.BLOCK_T, "BLOCK_E": 2}),
    "router select": (routing._select_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "token_ids_ptr": "*i64",
                                               "tid2eid_ptr": "*i64", "ids_ptr": "*i64", "weights_ptr": "*fp32",
                                               "route_scale": "fp32"},
                      {"TOP_K": 6, "K_PAD": 8, "E_PAD": 256, "SCORE": 0, "HASH": False, "NORMALIZE": True}),
    "rope": (rope._rotate_kernel, {"x_ptr": "*bf16", "phases_ptr": "*fp32", "out_ptr": "*bf16"},
             {"INVERSE": False, "BLOCK_PAIRS": 256}),
    "compressor pool": (compress_pool._compress_pool_kernel, {"state_ptr": "*fp32", "rows_ptr": "*i64",
                                                              "weight_ptr": "*fp32", "out_ptr": "*fp32"},
                        {"RATIO": 4, "OVERLAP": 2, "D": 512}),
    "mhc collapse": (mhc._collapse_kernel, {"streams_ptr": "*bf16", "pre_ptr": "*fp32", "weight_ptr": "*fp32",
                                            "out_ptr": "*bf16"}, {"N": 4, "BLOCK_D": 1024, "NORM": True, "ONE_PASS": False}),
    "mhc collapse, one pass": (mhc._collapse_kernel, {"streams_ptr": "*bf16", "pre_ptr": "*fp32",
                                                      "weight_ptr": "*fp32", "out_ptr": "*bf16"},
                               {"N": 4, "BLOCK_D": 8192, "NORM": True, "ONE_PASS": True}),
    "engram gate": (mhc._engram_gate_kernel, {"streams_ptr": "*bf16", "key_ptr": "*bf16", "value_ptr": "*bf16",
                                              "q_weight_ptr": "*bf16", "k_weight_ptr": "*bf16", "out_ptr": "*bf16"},
                    {"D": 5120, "BLOCK_D": 8192}),
    "mhc expand": (mhc._expand_kernel, {"streams_ptr": "*bf16", "output_ptr": "*bf16", "post_ptr": "*fp32",
                                        "comb_ptr": "*fp32", "out_ptr": "*bf16"}, {"N": 4, "BLOCK_D": 1024}),
    "mhc mix partials": (mhc_weights._mix_partials_kernel, {"streams_ptr": "*bf16", "fn_ptr": "*fp32",
                                                            "dots_ptr": "*fp32", "squares_ptr": "*fp32"},
                         {"M": 24, "M_PAD": 32, "BLOCK_T": 16, "BLOCK_K": 128, "BLOCKS_PER_SPLIT": 2}),
    "mhc mix tiles": (mhc_weights._mix_tiles_kernel, {"streams_ptr": "*bf16", "fn_ptr": "*fp32", "dots_ptr": "*fp32",
                                                      "squares_ptr": "*fp32"},
                      {"M": 24, "M_PAD": 32, "TILE_T": 64, "BLOCK_K": 128, "BLOCKS_PER_SPLIT": 64}),
    "mhc weights": (mhc_weights._mhc_weights_kernel, {"dots_ptr": "*fp32", "squares_ptr": "*fp32",
                                                      "base_ptr": "*fp32", "scale_ptr": "*fp32", "pre_ptr": "*fp32",
                                                      "post_ptr": "*fp32", "comb_ptr": "*fp32", "norm_eps": "fp32"},
                    {"N": 4, "ITERS": 20, "SPLITS_PAD": 64}),
    **{f"mhc sublayer input{', single pass' if single else ''}": (
        mhc._sublayer_input_kernel, {"dots_ptr": "*fp32", "squares_ptr": "*fp32", "base_ptr": "*fp32",
                                     "scale_ptr": "*fp32", "streams_ptr": "*bf16", "weight_ptr": "*fp32",
                                     "out_ptr": "*bf16", "pre_ptr": "*fp32", "previous_pre_ptr": "*fp32",
                                     "post_ptr": "*fp32", "comb_ptr": "*fp32", "norm_eps": "fp32", "hc_eps": "fp32"},
        {"N": 4, "ITERS": 20, "SPLITS_PAD": 64, "BLOCK_D": 8192, "NORM": True, "ONE_PASS": True,
         "SINGLE_PASS": single}) for single in (False, True)},
    "mhc sublayer input, single pass, one launch": (
        mhc._single_pass_input_kernel, {"streams_ptr": "*bf16", "flat_ptr": "*bf16", "fn_ptr": "*fp32",
                                        "dots_ptr": "*fp32", "squares_ptr": "*fp32", "arrivals_ptr": "*i32",
                                        "base_ptr": "*fp32", "scale_ptr": "*fp32", "weight_ptr": "*fp32",
                                        "out_ptr": "*bf16", "pre_ptr": "*fp32", "previous_pre_ptr": "*fp32",
                                        "post_ptr": "*fp32", "comb_ptr": "*fp32", "norm_eps": "fp32", "hc_eps": "fp32"},
        {"N": 4, "M": 24, "M_PAD": 32, "ITERS": 20, "MAX_T": 2, "BLOCK_K": 128, "BLOCKS_PER_SPLIT": 3, "SPLITS": 54,
         "SPLITS_PAD": 64, "BLOCK_D": 8192, "NORM": True, "ONE_PASS": True}),
    "greedy tokens, chunks": (sampling._chunk_argmax_kernel, {"logits_ptr": "*fp32", "best_ptr": "*fp32",
                                                               "at_ptr": "*i32", "nan_ptr": "*i32"},
                              {"CHUNK": sampling.CHUNK}),
    "greedy tokens, rows": (sampling._argmax_kernel, {"best_ptr": "*fp32", "at_ptr": "*i32", "nan_ptr": "*i32",
                                                      "out_ptr": "*i64"}, {"CHUNKS_PAD": 32}),
    **{f"{fmt} cache rounding": (cache_formats._round_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"},
                                 {"GROUP": group, "GROUPS": cache_formats.GROUPS_PER_PROGRAM, "FORMAT": code})
       for fmt, (group, code) in cache_formats.FORMATS.items()},
    "mhc": (mhc_weights._mhc_kernel, {"logits_ptr": "*fp32", "pre_ptr": "*fp32", "post_ptr": "*fp32",
                                      "comb_ptr": "*fp32"},
            {"N": 4, "ITERS": 20, "BLOCK_T": 16}),
}
FLOAT_SCALARS = {"limit", "qk_scale", "sink_scale", "eps"}


def compile_case(name: str) -> None:
    fn, pointers, constexprs = CASES[name]
    signature = {}
    for param in fn.params:
        signature[param.name] = ("constexpr" if param.is_constexpr else pointers.get(param.name)
                                 or ("fp32" if param.name in FLOAT_SCALARS else "i32"))
    missing = sorted(n for n, t in signature.items() if t == "constexpr" and n not in constexprs)
    if missing:
        raise ValueError(f"{name}: give the constexprs {missing}")
    asm = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=SM90).asm
    if not asm["cubin"]:
        raise RuntimeError(f"{name}: no cubin")
    if dependent_launch.ENABLED and "griddepcontrol.wait" not in asm["ptx"]:
        raise RuntimeError(f"{name}: launched with dependent launch, but never waits for its inputs")


def main() -> int:
    failed = 0
    for name in sorted(CASES):
        try:
            compile_case(name)
            print(f"ok      {name}")
        except Exception as exc:  # noqa: BLE001 (every kernel is tried and each failure printed)
            failed += 1
            print(f"FAILED  {name}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
