// Shared core (compiled once) of compress::w8a8_gemm and compress::w8a8_outlier_gemm (CPU): per-token
// int8 activation quantization (bit-identical to the reference), int8 x int8 -> int32
// tiles for scalar / AVX2 / AVX-512 VNNI, and the fp32 outlier epilogue that the
// fused LLM.int8() op adds in the same pass over the weights.
//
// Signed x signed bytes: AVX2 vpmaddubsw and VNNI vpdpbusd take one unsigned operand,
// so the kernels use |x| (unsigned) and w * sign(x) (signed): vpsignb on AVX2, a masked
// byte negate on AVX-512. Weights are therefore expected in [-127, 127] (symmetric
// quantization never produces -128).
//
// Weights come canonical ([N, K] row-major) or, from the *_prepared ops, row-tiled
// (reference.w8a8_tile_cpu): when K % 64 == 0 the first N4 = N - N % 4 rows are stored
// in tiles of 4 rows with their 64-byte chunks interleaved (tile t, chunk c, row r at
// byte 4t * K + 256c + 64r), so the four rows an M = 1 tile reads are one sequential
// stream; the other rows stay row-major.

#include "cpu/w8a8_kernel.h"
#include "cpu/amx_common.h"
#include "cpu/w8a8_common.h"

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>


namespace compress_cpu {
namespace w8 {

void quantize_rows(const at::Tensor& x, const int64_t* idx, int64_t C, int64_t Kp, int8_t* qx, uint8_t* ax,
                   float* sx, float* xo, int16_t* x16, float* amax) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool avx2 = active_isa() >= Isa::Avx2;
  // fp32 rows without outlier columns are read in place (quantize_row writes to its row
  // only to zero the outlier columns); the others are copied to fp32 first.
  const bool in_place = x.scalar_type() == at::kFloat && C == 0;
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(in_place ? 0 : K);
    for (int64_t m = m0; m < m1; ++m) {
      float* row = in_place ? x.data_ptr<float>() + m * K : buf.data();
      if (!in_place) row_to_float(x, m, buf.data());
      sx[m] = quantize_row(row, K, idx, C, Kp, avx2, qx + m * Kp, ax + m * Kp, xo + m * C, amax ? amax + m : nullptr);
      if (x16) widen_row_i16(qx + m * Kp, Kp, x16 + m * Kp);
    }
  });
}

// ---- AVX2 ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "cpu/w8a8_tile_avx2.inc"
#include "cpu/w8a8_i16_avx2.inc"
#pragma GCC pop_options

// ---- AVX-512 VNNI -------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include "cpu/w8a8_tile_vnni.inc"
#pragma GCC pop_options

// ---- AMX-INT8 (on top of the AVX-512 VNNI level) ------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#include "cpu/w8a8_amx.inc"
#pragma GCC pop_options

namespace {
std::atomic<int64_t> int16_rows{kI16MinRows};
std::atomic<int64_t> amx_rows{kAmxMinRows};
}  // namespace

int64_t set_int16_min_rows(int64_t rows) { return int16_rows.exchange(rows); }
int64_t int16_min_rows() { return int16_rows.load(std::memory_order_relaxed); }
int64_t set_amx_min_rows(int64_t rows) { return amx_rows.exchange(rows); }
int64_t amx_min_rows() { return amx_rows.load(std::memory_order_relaxed); }

namespace {

// The spike guard's columns: those outside `idx` where |x| reaches `threshold` in some
// row, ascending (reference.w8a8_outlier_gemm_guarded: col_max >= threshold).
std::vector<int64_t> spike_columns(const at::Tensor& x, const std::vector<int64_t>& idx, double threshold) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<uint8_t> calibrated(K, 0);
  for (int64_t c : idx) calibrated[c] = 1;
  std::vector<float> col_max(K, 0.f), row(K);
  for (int64_t m = 0; m < M; ++m) {
    row_to_float(x, m, row.data());
    for (int64_t k = 0; k < K; ++k) col_max[k] = std::max(col_max[k], std::fabs(row[k]));
  }
  std::vector<int64_t> extra;
  for (int64_t k = 0; k < K; ++k)
    if (!calibrated[k] && static_cast<double>(col_max[k]) >= threshold) extra.push_back(k);
  return extra;
}

// The call again with the spike columns `extra` among the outliers: outlier_idx + extra,
// and outlier weights [N, C + E] in fp32, the static ones widened and the spike columns'
// int8 weights dequantized (q * weight_scale in fp32, as the reference's w_extra).
at::Tensor run_with_spikes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wscale,
                           const std::vector<int64_t>& idx, const at::Tensor& ow, const std::vector<int64_t>& extra,
                           bool tiled, const char* op, at::Tensor* out) {
  const int64_t N = qweight.size(0), K = qweight.size(1), C = static_cast<int64_t>(idx.size());
  const int64_t E = static_cast<int64_t>(extra.size());
  at::Tensor idx2 = at::empty({C + E}, at::kLong);
  std::copy(idx.begin(), idx.end(), idx2.data_ptr<int64_t>());
  std::copy(extra.begin(), extra.end(), idx2.data_ptr<int64_t>() + C);
  at::Tensor ow2 = at::empty({N, C + E}, x.options().dtype(at::kFloat));
  if (C) ow2.narrow(1, 0, C).copy_(ow);
  Args layout{};
  layout.K = K, layout.N4 = tiled && K % kTileChunk == 0 ? N - N % kTileRows : 0, layout.w = qweight.data_ptr<int8_t>();
  const void* ws = wscale.data_ptr();
  const ScaleType wst = scale_type_of(wscale);
  float* dst = ow2.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = w8_row(layout, n);
      const int64_t cs = w8_chunk_stride(layout, n);
      const float s = load_scale(ws, wst, n);
      for (int64_t e = 0; e < E; ++e) dst[n * (C + E) + C + e] = static_cast<float>(*w8_at(w, cs, extra[e])) * s;
    }
  });
  return run(x, qweight, wscale, &idx2, &ow2, tiled, op, out);
}

}  // namespace

// Runs the whole op: quantize, tiles over the intra-op pool, cast to x's dtype.
at::Tensor run(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& wscale_in,
               const at::Tensor* outlier_idx, const at::Tensor* outlier_weight, bool tiled, const char* op,
               at::Tensor* out, c10::optional<double> threshold) {
  TORCH_CHECK(x_in.dim() == 2, op, ": x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(qweight_in.dim() == 2 && qweight_in.scalar_type() == at::kChar, op, ": qweight must be int8 [N, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0);
  TORCH_CHECK(qweight_in.size(1) == K, op, ": qweight is ", qweight_in.sizes(), " but x has K=", K);
  TORCH_CHECK(wscale_in.numel() == N, op, ": weight_scale must have N=", N, " elements");
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous(), wscale = wscale_in.contiguous();
  at::Tensor ow;
  std::vector<int64_t> idx;  // outlier columns, negatives wrapped (plain C++: ATen ops cost ~8 us each here)
  int64_t C = 0;
  if (outlier_idx != nullptr) {
    // (no ATen call where the tensors already fit: a dispatch costs ~1 us of a ~7 us decode GEMV)
    const at::Tensor idx_t =
        outlier_idx->scalar_type() == at::kLong ? outlier_idx->contiguous() : outlier_idx->to(at::kLong).contiguous();
    C = idx_t.numel();
    ow = outlier_weight->contiguous();
    TORCH_CHECK(ow.dim() == 2 && ow.size(0) == N && ow.size(1) == C, op, ": outlier_weight must be [N, C]=[", N, ", ", C, "]");
    const int64_t* ip = idx_t.data_ptr<int64_t>();
    idx.resize(C);
    for (int64_t c = 0; c < C; ++c) {
      TORCH_CHECK(ip[c] >= -K && ip[c] < K, op, ": outlier index ", ip[c], " out of range");
      idx[c] = ip[c] < 0 ? ip[c] + K : ip[c];
    }
  }
  if (out) check_float_out(op, x, N, *out);
  if (M == 0 || N == 0) return out ? out->zero_() : at::zeros({M, N}, x.options());
  const int64_t Kp = ceil_div(std::max<int64_t>(K, 1), kPad) * kPad;
  // One workspace (a decode step makes ~100 of these calls): int8 activations and their
  // |values| [M, Kp] each (Kp % 64 == 0), per-row scales [M], gathered outliers [M, C].
  // Many rows on AVX2 without VNNI: the int16 GEMM (w8a8_i16_avx2.inc), which also needs
  // the activations widened to int16 [M, Kp] (x16, after the rest).
  // Many rows on CPUs with AMX-INT8: tile matrix multiplies (w8a8_amx.inc), which need
  // the activations rearranged into tdpbssd's B layout (xb, in the same place). Never
  // one row: its fused outliers go in the VNNI tiles' epilogue (below).
  const bool i16 = active_isa() == Isa::Avx2 && M >= int16_min_rows();
  const bool amx = active_isa() == Isa::Avx512Vnni && M >= std::max<int64_t>(2, amx_min_rows()) && amx_int8_available();
  const int64_t x16_offset = ceil_div(2 * M * Kp + 4 * M * (1 + C), 64) * 64;
  const int64_t xot_offset = x16_offset + (amx ? amx_activation_bytes(M, Kp) : 0);
  const Scratch work(Scratch::kW8, x16_offset + (i16 ? 2 * M * Kp : amx ? amx_activation_bytes(M, Kp) + amx_outlier_bytes(M, C) : 0));
  int8_t* qx = reinterpret_cast<int8_t*>(work.data());
  uint8_t* ax = work.data() + M * Kp;
  float* sx = reinterpret_cast<float*>(work.data() + 2 * M * Kp);
  float* xo = sx + M;
  int16_t* x16 = i16 ? reinterpret_cast<int16_t*>(work.data() + x16_offset) : nullptr;
  // The spike guard. One row (decode): a comparison, quantize_row takes the row's absmax
  // outside the outlier columns anyway, and a spike (rare) reruns the call with the spike
  // columns among the outliers. Many rows (prefill; a spike somewhere in a long prompt is
  // common): the columns are checked first, a pass over x, and the call runs once.
  const bool guarded = threshold.has_value() && outlier_idx != nullptr;
  if (guarded && M > 1) {
    const std::vector<int64_t> extra = spike_columns(x, idx, *threshold);
    if (!extra.empty()) return run_with_spikes(x, qweight, wscale, idx, ow, extra, tiled, op, out);
  }
  float row_amax = 0.f;
  quantize_rows(x, C ? idx.data() : nullptr, C, Kp, qx, ax, sx, xo, x16, guarded && M == 1 ? &row_amax : nullptr);
  if (guarded && M == 1 && row_amax >= *threshold) {
    const std::vector<int64_t> extra = spike_columns(x, idx, *threshold);
    if (!extra.empty()) return run_with_spikes(x, qweight, wscale, idx, ow, extra, tiled, op, out);
  }
  // Fused outliers. M = 1 (decode), and the AMX tiles at any M: the tile epilogue adds
  // each output's C-long dot product, reading the outlier weights in their own dtype
  // (AMX: the same FMA chain as outlier_products_avx2, bit for bit). Else: one pass over
  // the [N, C] outlier weights after the tiles (outlier_products_*), also in their own
  // dtype. It replaced a y.addmm_(xo, ow.float().t()): with cold caches that fp32 copy
  // of ow and MKL's dispatch cost ~0.2 ms a call, ~15% of an M = 4 call on 4096 x 4096.
  // With the AMX tiles the fused outliers go in their epilogue too, at any M: the
  // separate pass re-read and re-wrote all of y, ~1.3x the W8A8 time at M = 256. On the
  // register tiles that pass runs per work block, right after the block's tiles (its y
  // still in cache, no second parallel region); the int16 GEMM's panels are grabbed
  // from a counter, so its pass still follows all of them.
  const bool epilogue_outliers = C != 0 && (M == 1 || amx);
  at::Tensor y = out ? *out : at::empty({M, N}, x.options().dtype(at::kFloat));
  const int64_t N4 = tiled && K % kTileChunk == 0 ? N - N % kTileRows : 0;
  Args a{M, N, K, Kp, N4, qweight.data_ptr<int8_t>(), wscale.data_ptr(), scale_type_of(wscale),
         qx, ax, sx, epilogue_outliers ? C : 0, xo, epilogue_outliers ? ow.data_ptr() : nullptr,
         epilogue_outliers ? scale_type_of(ow) : ScaleType::F32, y.data_ptr<float>()};
  void (*kernel)(const Args&, int64_t, int64_t, int64_t, int64_t) = block_scalar;
  switch (active_isa()) {
    case Isa::Avx512Vnni: kernel = block_vnni; break;
    case Isa::Avx2: kernel = block_avx2; break;
    default: break;
  }
  // The M > 1 outlier products outside the AMX epilogue (see above), for a block of
  // rows and outputs.
  Args b = a;
  b.C = C, b.ow = C ? ow.data_ptr() : nullptr, b.owt = C ? scale_type_of(ow) : ScaleType::F32;
  auto outlier_products = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (active_isa() == Isa::Scalar) return outlier_products_scalar(b, m0, m1, n0, n1);
    const Scratch panel(Scratch::kW8Panel, 16 * C * static_cast<int64_t>(sizeof(float)));
    outlier_products_avx2(b, m0, m1, n0, n1, reinterpret_cast<float*>(panel.data()));
  };
  if (amx) {
    int8_t* xb = reinterpret_cast<int8_t*>(work.data() + x16_offset);
    float* xot = reinterpret_cast<float*>(work.data() + xot_offset);
    if (a.C) build_amx_outliers(a, xot);
    at::parallel_for(0, amx_padded_rows(M) / 16, 1, [&](int64_t b0, int64_t b1) { build_amx_activations(a, b0, b1, xb); });
    // 32-column panels from a shared counter, as the int16 GEMM's (below).
    parallel_grabs(ceil_div(N, kAmxCols), kAmxPanelsPerGrab, [&](const auto& take) {
      const Scratch mine(Scratch::kW8Panel, amx_thread_bytes(Kp, a.C));
      amx_load_config_16x64();
      for (int64_t p0, p1; take(p0, p1);) block_amx(a, xb, xot, p0, p1, mine.data());
      amx_release();
    });
  } else if (i16) {
    // Panels are handed out kI16PanelsPerGrab at a time from a shared counter: the
    // two vCPUs of the development VMs run at different speeds from call to call, and
    // a static half each left the faster one idle (same-process A/B, M = 256, 5
    // shapes: 1.00-1.23x the static split; M = 64: 1.04-1.25x).
    parallel_grabs(ceil_div(N, kI16Cols), kI16PanelsPerGrab, [&](const auto& take) {
      const Scratch mine(Scratch::kW8Panel, i16_thread_bytes(M));
      for (int64_t p0, p1; take(p0, p1);) block_i16_avx2(a, x16, p0 * kI16Cols, std::min(N, p1 * kI16Cols), mine.data());
    });
    if (C)  // after all panels (each thread's panel workspace is free again)
      at::parallel_for(0, ceil_div(N, 8), 16, [&](int64_t b0, int64_t b1) { outlier_products(0, M, b0 * 8, std::min(N, b1 * 8)); });
  } else {
    const int64_t nb = std::max<int64_t>(8, ((128 << 10) / std::max<int64_t>(1, K)) / 8 * 8);
    parallel_tiles(M, N, 64, nb, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
      kernel(a, m0, m1, n0, n1);
      if (C && !epilogue_outliers) outlier_products(m0, m1, n0, n1);
    });
  }
  return float_to_activation_dtype(y, x.scalar_type());
}

}  // namespace w8
}  // namespace compress_cpu
