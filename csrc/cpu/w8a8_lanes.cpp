// compress::w8a8_gemm_lanes on CPU: W8A8 (per-channel int8 weights, per-token dynamic int8
// activations) on the weight-row-lane layout (reference.w8a8_prepare_lanes), whose zmm
// lanes are 16 weight rows. Reference: compress/ops/reference.py::w8a8_gemm_lanes.
//
// Why another layout. The row-tiled W8A8 tiles (w8a8_tile_vnni.inc) put k in the lanes:
// per vpdpbusd a masked byte negate moves the activation's sign onto the weight, and every
// output ends in a horizontal sum; at 16 rows they ran ~300 GMAC/s on two Zen5 threads
// (the 345M model's int8 lm_head: 1.9 ms of a 17 ms batch-16 decode step). Here:
// - layout: per tile of 16 weight rows, per 4-k quad j, the 16 rows' 4 bytes side by side
//   (64 bytes: one load); rows past N and k past K are zero; per tile the 16 rows' fp32
//   scales and int32 row sums;
// - activations are quantized per row as the other W8A8 kernels do (w8::quantize_rows,
//   the same bytes) and stored as q + 128 (unsigned), so one vpdpbusd per
//   quad dots them with the signed weights, no sign fix-up; 128 x the row sum comes off the
//   int32 sum at the end (exact: K <= 65536 keeps (q + 128) . w inside int32);
// - outputs: float(sum) x the row's scale x the weight row's scale, the row-tiled
//   kernels' operations in their order, so the same bits as w8a8_gemm_prepared.
// Rows are computed independently, so a row's result does not depend on its batch mates or
// the thread count. AVX-512 VNNI; below it a scalar form with the same integer sums (the
// runtime prepares this layout only on AVX-512 VNNI CPUs without AMX).
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"
#include "cpu/w4_lanes.h"
#include "cpu/w8a8_common.h"
#include "cpu/w8a8_kernel.h"

namespace compress_cpu {
namespace {

using lanes::kLaneRows;
constexpr int64_t kQuadBytes = 64;       // one 4-k quad of a tile: 16 rows x 4 bytes
constexpr int64_t kMaxK = 65536;         // reference.W8_LANES_MAX_K

struct W8LaneArgs {
  int64_t M, N, K, Q, T;   // Q: quads a row (ceil(K / 4)), T: tiles
  const int8_t* w;         // [T][Q][16][4]
  const float* s;          // [T][16]
  const int32_t* rowsum;   // [T][16]
  const uint8_t* xu;       // [M][4Q]: q + 128
  const float* sx;         // [M]
  float* y;                // [M][N]
};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// acc += the u8 x s8 dot products of x and w, as asm: with the intrinsic, GCC 12 kept 16
// accumulators in zmm16-31 and copied each to zmm0-15 and back around its vpdpbusd (a
// register-only lab loop of 16 rows ran at 295 against 505 GMAC/s a core, the peak 524).
inline void dpbusd(__m512i& acc, __m512i x, __m512i w) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w)); }

// Rows [m0, m0 + MT) against tiles t .. t + NT - 1. With few sums in flight (MT x NT <= 4,
// decode) each is split over even and odd quads (two chains; integer sums: the same).
// w8_lanes_vnni calls NT = 1 only; the same body written for one tile (scalar pointers, a
// 2-D accumulator array) had GCC 12 keep the 16 accumulators on the stack (M = 16 at 1.42x
// the row-tiled op instead of 2.43x), so the NT form stays.
template <int MT, int NT>
void w8_lanes_tile(const W8LaneArgs& a, int64_t t, int64_t m0) {
  constexpr int kChains = MT * NT <= 4 ? 2 : 1;
  const int64_t tile_bytes = a.Q * kQuadBytes, xrow = a.Q * 4;
  const int8_t* wt[NT];
  for (int u = 0; u < NT; ++u) wt[u] = a.w + (t + u) * tile_bytes;
  __m512i acc[kChains][NT][MT];
  for (int c = 0; c < kChains; ++c)
    for (int u = 0; u < NT; ++u)
      for (int m = 0; m < MT; ++m) acc[c][u][m] = _mm512_setzero_si512();
  // quad jj into chain c (a plain loop body: as a lambda over the accumulator array GCC
  // moved every accumulator between registers each quad)
#define COMPRESS_W8_QUAD(c, jj)                                                                          \
  do {                                                                                                   \
    __m512i w[NT];                                                                                       \
    for (int u = 0; u < NT; ++u) {                                                                       \
      const int64_t at = (jj) * kQuadBytes + w8::kPrefetchBytes;                                           \
      _mm_prefetch(reinterpret_cast<const char*>(wt[u] + (at < tile_bytes ? at : at + (NT - 1) * tile_bytes)), \
                   _MM_HINT_T0);                                                                         \
      w[u] = _mm512_loadu_si512(wt[u] + (jj) * kQuadBytes);                                              \
    }                                                                                                    \
    for (int m = 0; m < MT; ++m) {                                                                       \
      int32_t xq;                                                                                        \
      std::memcpy(&xq, a.xu + (m0 + m) * xrow + 4 * (jj), 4);                                            \
      const __m512i xb = _mm512_set1_epi32(xq);                                                          \
      for (int u = 0; u < NT; ++u) dpbusd(acc[c][u][m], xb, w[u]);                                     \
    }                                                                                                    \
  } while (0)
  int64_t j = 0;
  if constexpr (kChains == 2) {
    for (; j + 2 <= a.Q; j += 2) {
      COMPRESS_W8_QUAD(0, j);
      COMPRESS_W8_QUAD(1, j + 1);
    }
  }
  for (; j < a.Q; ++j) COMPRESS_W8_QUAD(0, j);
#undef COMPRESS_W8_QUAD
  for (int u = 0; u < NT; ++u) {
    const int64_t n0 = (t + u) * kLaneRows, cols = std::min<int64_t>(kLaneRows, a.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(a.rowsum + (t + u) * kLaneRows), 7);
    const __m512 sw = _mm512_loadu_ps(a.s + (t + u) * kLaneRows);
    for (int m = 0; m < MT; ++m) {
      __m512i sum = acc[0][u][m];
      if constexpr (kChains == 2) sum = _mm512_add_epi32(sum, acc[1][u][m]);
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, corr)),
                                                   _mm512_set1_ps(a.sx[m0 + m])), sw);
      _mm512_mask_storeu_ps(a.y + (m0 + m) * a.N + n0, mask, v);
    }
  }
}

template <int NT, int... Rows>
void w8_lanes_rest(const W8LaneArgs& a, int64_t t, int64_t m0, int64_t rows, std::integer_sequence<int, Rows...>) {
  ((rows == Rows + 1 ? w8_lanes_tile<Rows + 1, NT>(a, t, m0) : void()), ...);
}

// Tiles t0 .. t1 - 1, one at a time (one weight stream a thread), up to 16 rows a call
// (16 accumulators: 97% of the vpdpbusd peak in L1; two tiles of 4 or 8 rows a call ran
// slower, 481 / 231 GMAC/s).
void w8_lanes_vnni(const W8LaneArgs& a, int64_t t0, int64_t t1) {
  constexpr int kRows = 16;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;
    for (; m + kRows <= a.M; m += kRows) w8_lanes_tile<kRows, 1>(a, t, m);
    if (m < a.M) w8_lanes_rest<1>(a, t, m, a.M - m, std::make_integer_sequence<int, kRows - 1>{});
  }
}
#pragma GCC pop_options

// Below AVX-512 VNNI (a forced ISA): the same integer sums, then the same float operations.
void w8_lanes_scalar(const W8LaneArgs& a, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.Q * kQuadBytes, xrow = a.Q * 4;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kLaneRows, cols = std::min<int64_t>(kLaneRows, a.N - n0);
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t r = 0; r < cols; ++r) {
        int32_t acc = 0;
        for (int64_t j = 0; j < a.Q; ++j)
          for (int i = 0; i < 4; ++i)
            acc += static_cast<int32_t>(a.xu[m * xrow + 4 * j + i]) *
                   static_cast<int32_t>(a.w[t * tile_bytes + j * kQuadBytes + 4 * r + i]);
        acc -= a.rowsum[t * kLaneRows + r] * 128;
        a.y[m * a.N + n0 + r] = static_cast<float>(acc) * a.sx[m] * a.s[t * kLaneRows + r];
      }
  }
}

void check_lanes_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const at::Tensor& rowsum, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a 2-D CPU tensor, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t K = x.size(1);
  TORCH_CHECK(K >= 1 && K <= kMaxK, op, ": K must be 1..", kMaxK, " (the int32 sums of the lanes layout), got ", K);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(), op,
              ": qweight must be the contiguous int8 [tiles, ceil(K / 4) * 64] of reference.w8a8_prepare_lanes, got ",
              qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(qweight.size(1) == ceil_div(K, 4) * kQuadBytes, op, ": qweight holds ", qweight.size(1) / kQuadBytes,
              " quads of k a row, x has K = ", K, " (", ceil_div(K, 4), " quads)");
  const int64_t tiles = qweight.size(0);
  TORCH_CHECK(n > 0 && ceil_div(n, kLaneRows) == tiles, op, ": n = ", n, " output features do not make the ", tiles,
              " tiles of 16 rows qweight holds");
  TORCH_CHECK(scale.sizes() == at::IntArrayRef({tiles, kLaneRows}) && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(),
              op, ": scale must be the contiguous float32 [tiles, 16] = [", tiles, ", 16], got ", scale.scalar_type(),
              " ", scale.sizes());
  TORCH_CHECK(rowsum.sizes() == scale.sizes() && rowsum.scalar_type() == at::kInt && rowsum.is_contiguous(), op,
              ": rowsum must be the contiguous int32 [tiles, 16] = [", tiles, ", 16], got ", rowsum.scalar_type(), " ",
              rowsum.sizes());
  TORCH_CHECK(qweight.device().is_cpu() && scale.device().is_cpu() && rowsum.device().is_cpu(), op,
              ": all tensors must be on the CPU");
}

at::Tensor w8_lanes_run(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scale,
                        const at::Tensor& rowsum, int64_t n, at::Tensor* out) {
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), Q = ceil_div(K, 4), Kp = Q * 4;
  at::Tensor y = out ? *out : at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return out ? y : float_to_activation_dtype(y, x.scalar_type());
  // the rows quantized as the other W8A8 ops do ([M, Kp] bytes, |q| beside them, scales
  // [M]), then q + 128 in place: the unsigned bytes vpdpbusd takes (q ^ 0x80 as a byte)
  const Scratch work(Scratch::kW8, 2 * M * Kp + M * static_cast<int64_t>(sizeof(float)));
  uint8_t* xu = work.data();
  float* sx = reinterpret_cast<float*>(work.data() + 2 * M * Kp);   // Kp % 4 == 0: aligned
  w8::quantize_rows(x, nullptr, 0, Kp, reinterpret_cast<int8_t*>(xu), xu + M * Kp, sx, nullptr, nullptr, nullptr);
  at::parallel_for(0, M * Kp, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) xu[i] ^= 0x80;
  });
  const W8LaneArgs a{M, n, K, Q, qweight.size(0), qweight.data_ptr<int8_t>(), scale.data_ptr<float>(),
                     rowsum.data_ptr<int32_t>(), xu, sx, y.data_ptr<float>()};
  const bool vnni = active_isa() == Isa::Avx512Vnni;
  lanes::for_passes(M, Kp, 16, a.T, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
    W8LaneArgs b = a;
    b.M = rows, b.xu = a.xu + m0 * Kp, b.sx = a.sx + m0, b.y = a.y + m0 * n;
    if (vnni) w8_lanes_vnni(b, t0, t1);
    else w8_lanes_scalar(b, t0, t1);
  });
  return out ? y : float_to_activation_dtype(y, x.scalar_type());
}

}  // namespace

at::Tensor w8a8_gemm_lanes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const at::Tensor& rowsum, int64_t n) {
  check_lanes_args("w8a8_gemm_lanes", x, qweight, scale, rowsum, n);
  return w8_lanes_run(x, qweight, scale, rowsum, n, nullptr);
}

at::Tensor& w8a8_gemm_lanes_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                 const at::Tensor& rowsum, int64_t n, at::Tensor& out) {
  check_lanes_args("w8a8_gemm_lanes_into", x, qweight, scale, rowsum, n);
  check_float_out("w8a8_gemm_lanes_into", x, n, out);
  w8_lanes_run(x, qweight, scale, rowsum, n, &out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("w8a8_gemm_lanes", &compress_cpu::w8a8_gemm_lanes); }
