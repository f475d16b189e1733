// What the two int4 ops on CPU share: w4a16_gemm.cpp (float activations, the numbers the
// w4a16 scheme promises) and w4a8_gemm.cpp (activations quantized to int8 per block of
// 32, the opt-in fast path). Both take the same weights: canonical or, from the
// *_prepared entry points, in the load-time row tiling (reference.w4a16_prepare_cpu).
#pragma once

#include <algorithm>
#include <vector>

#include "cpu/kernel_common.h"

namespace compress_cpu {
namespace w4 {

// The driver both panel GEMMs share (w4a8_panel.inc, w4a16_panel.inc). `build(mb, act)`
// writes m-block mb of the call's transposed activations into `act` (act_bytes in all, the
// calling thread's buffer, kept from call to call: a decode step makes ~100 of these
// calls), one m-block per task; then, per m-chunk of `chunk` m-blocks (their activations
// stay in L2), the threads take the `panels` weight panels 4 at a time (adjacent panels
// on two threads had written the same cache lines of y) and run `run(act, mb0, mb1, p0,
// p1)`.
template <typename Build, typename Run>
void run_panel_gemm(int64_t MB, int64_t act_bytes, int64_t chunk, int64_t panels, const Build& build,
                    const Run& run) {
  thread_local std::vector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < act_bytes) buffer = std::vector<uint8_t>(act_bytes);
  uint8_t* act = buffer.data();
  at::parallel_for(0, MB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t mb = b0; mb < b1; ++mb) build(mb, act);
  });
  for (int64_t mb0 = 0; mb0 < MB; mb0 += chunk) {
    const int64_t mb1 = std::min(MB, mb0 + chunk);
    parallel_grabs(panels, 4, [&](const auto& take) {
      for (int64_t p0, p1; take(p0, p1);) run(act, mb0, mb1, p0, p1);
    });
  }
}

// x [M, K] (any float dtype) quantized for the int8-activation ops (w4a8_gemm.cpp,
// w4a8_lanes.cpp): w4::quantize_row per row, in parallel, into one thread-local workspace
// (a decode step makes ~100 of these calls): xq int8 [M, KC * 64] (permuted chunks), the
// lane scales xs fp32 [M, KC * 8] and the group sums xg fp32 [M, K / G].
struct QuantizedActivations {
  QuantizedActivations(const at::Tensor& x, int64_t G, int64_t KC);
  Scratch work;
  int8_t* xq;
  float* xs;
  float* xg;
};

// Argument checks shared by the int4 entry points; errors name `op`.
void check_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const at::Tensor& zeros, int64_t G);
// The prepared entry points take the load-time fp32 scales and uint8 zero points.
void check_prepared_metadata(const char* op, const at::Tensor& scale, const at::Tensor& zeros);

// y = x dequant(W)^T with float activations (w4a16_gemm.cpp): w = (u - z) * s in fp32, as
// reference.w4a16_gemm; fp32 FMAs. `scale` fp32 and `zeros` uint8, both [N, K / G];
// `tiled`: qweight in the prepared row tiling, else canonical; `out`: where to write y
// (fp32 x only), else a new tensor of x's dtype.
at::Tensor run_float(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, const at::Tensor& zeros,
                     int64_t G, bool tiled, at::Tensor* out = nullptr);

// Fewest rows for which the float path dequantizes weight blocks to fp32 and multiplies
// them with at::mm instead of running its register tiles (kFloatMmMinRows by default);
// returns the previous value. Both compute the same weights in fp32 (the sums in
// another order). Both are fp32-FMA bound at many rows; past ~32 rows at::mm is faster
// (Zen 4, one thread, 3 shapes: 0.95-1.04x the tiles at M = 32, 0.78-0.85x at M = 128;
// 1.1-3.1x slower at M = 4-16, where dequantizing whole rows does not pay).
constexpr int64_t kFloatMmMinRows = 32;
int64_t set_float_mm_min_rows(int64_t rows);
int64_t float_mm_min_rows();

// Fewest rows for which the float path takes its AVX-512 panel GEMM (w4a16_panel.inc,
// K % 64 == 0) before the at::mm and register-tile paths; returns the previous value. The
// same weights in fp32, each output summed in K order.
constexpr int64_t kFloatPanelMinRows = 32;
int64_t set_float_panel_min_rows(int64_t rows);
int64_t float_panel_min_rows();

}  // namespace w4
}  // namespace compress_cpu
