// Shared core of compress::w8a8_gemm and compress::w8a8_outlier_gemm (CPU); the
// implementation and its notes are in w8a8_kernel.cpp.
#pragma once

#include "cpu/kernel_common.h"

namespace compress_cpu {
namespace w8 {

// Quantizes x per token (outlier columns gathered and zeroed when outlier_idx is given),
// runs the int8 tiles over the intra-op pool, adds the fp32 outlier products in the
// same pass, and returns [M, N] in x's dtype. `tiled`: qweight is in the load-time row
// tiling (reference.w8a8_tile_cpu), else canonical [N, K]. `threshold` (with outliers):
// the LLM.int8 spike guard of reference.w8a8_outlier_gemm_guarded; a column outside
// outlier_idx whose |x| reaches it in any row joins the outliers for this call, with its
// dequantized int8 weights (q * weight_scale).
at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
               const at::Tensor* outlier_idx, const at::Tensor* outlier_weight, bool tiled, const char* op,
               at::Tensor* out = nullptr, c10::optional<double> threshold = c10::nullopt);

// Per-token quantization of every row of x [M, K] (w8a8_common.h: quantize_row) into qx /
// ax [M, Kp] (|qx|) and sx [M], rows in parallel; outlier columns idx [C] gathered into xo
// [M, C] and zeroed (C = 0: none); with `x16`, each row also widened to int16 while it is
// in cache (the int16 GEMM's activations); with `amax`, each row's absmax outside the
// outlier columns. Used by run() and by the lanes op (w8a8_lanes.cpp).
void quantize_rows(const at::Tensor& x, const int64_t* idx, int64_t C, int64_t Kp, int8_t* qx, uint8_t* ax,
                   float* sx, float* xo, int16_t* x16, float* amax);

// Fewest rows for which the AVX2 path takes the int16 GEMM (w8a8_i16_avx2.inc) instead
// of the byte tiles (default kI16MinRows); returns the previous value. A tuning knob:
// both give the same bits, and csrc/cpu/lab/ab_many_rows.py times one against the other.
int64_t set_int16_min_rows(int64_t rows);
int64_t int16_min_rows();  // the current value

// Fewest rows for which the AVX-512 VNNI level takes the AMX-INT8 tiles (w8a8_amx.inc)
// where the CPU and the OS allow them (amx_int8_available); the same bits as the VNNI tiles.
// Returns the previous value; csrc/cpu/lab/ab_many_rows.py --path amx times one against
// the other.
int64_t set_amx_min_rows(int64_t rows);
int64_t amx_min_rows();

}  // namespace w8
}  // namespace compress_cpu
