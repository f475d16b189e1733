// The W8A8 / LLM.int8 kernel's parts that need no ATen: the prepared weight layout
// (Args, row tiling), the per-token activation quantizer (scalar and AVX2, the same
// bytes) and the scalar tiles. w8a8_kernel.cpp adds the AVX2 and AVX-512 VNNI tiles
// (w8a8_tile_avx2.inc, w8a8_tile_vnni.inc), the entry point and the thread split;
// csrc/cpu/tests/isa_emulation.cpp includes this to run the same tiles under SIMDe.
// Method and layout: w8a8_kernel.cpp and csrc/cpu/README.md.
#pragma once

#include <cstring>

#include "cpu/simd_common.h"

namespace compress_cpu {
namespace w8 {

constexpr int64_t kPad = 64;  // activation rows are zero-padded to a multiple of this
constexpr int64_t kTileRows = 4, kTileChunk = 64;
// How far ahead an M = 1 tile prefetches a tiled weight stream.
constexpr int64_t kPrefetchBytes = 2048;

struct Args {
  int64_t M, N, K, Kp;
  int64_t N4;        // rows [0, N4) tiled by 4 (see above), the rest row-major
  const int8_t* w;   // [N, K] bytes
  const void* ws;    // weight scale [N]
  ScaleType wst;
  const int8_t* qx;  // [M, Kp] quantized activations
  const uint8_t* ax; // [M, Kp] |qx|
  const float* sx;   // [M]
  // fused outliers (C == 0: none)
  int64_t C;
  const float* xo;   // [M, C] outlier activations
  const void* ow;    // [N, C] outlier weights
  ScaleType owt;
  float* y;          // [M, N] fp32
};

// Start of row n's chunk 0, and the distance between its consecutive 64-byte chunks:
// weight (n, k) is at w8_row(n) + (k / 64) * w8_chunk_stride(n) + k % 64.
inline const int8_t* w8_row(const Args& a, int64_t n) {
  return n < a.N4 ? a.w + (n & ~(kTileRows - 1)) * a.K + (n & (kTileRows - 1)) * kTileChunk : a.w + n * a.K;
}
inline int64_t w8_chunk_stride(const Args& a, int64_t n) { return n < a.N4 ? kTileRows * kTileChunk : kTileChunk; }
inline const int8_t* w8_at(const int8_t* row, int64_t cs, int64_t k) { return row + (k / kTileChunk) * cs + k % kTileChunk; }

// q = clamp(round_half_even(v / s), +-127) and |q| for n values; AVX2 below gives the
// same bytes (IEEE division and round-to-nearest-even are exact operations).
inline void quantize_span_scalar(const float* v, float s, int64_t n, int8_t* q, uint8_t* a) {
  for (int64_t j = 0; j < n; ++j) {
    const float r = std::min(127.f, std::max(-127.f, round_half_even(v[j] / s)));
    q[j] = static_cast<int8_t>(r);
    a[j] = static_cast<uint8_t>(std::fabs(r));
  }
}

COMPRESS_TARGET("avx2,fma") inline int64_t quantize_span_avx2(const float* v, float s, int64_t n, int8_t* q, uint8_t* a) {
  const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m256i r[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 x = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + j + 8 * i), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, x)));
    }
    const __m256i b = pack_32_epi8(r[0], r[1], r[2], r[3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + j), _mm256_abs_epi8(b));
  }
  return j;
}

// x16[k] = q[k] for the n bytes of one quantized row (n % 16 == 0): the activations of
// the int16 GEMM (w8a8_i16_avx2.inc), which runs on AVX2 only.
COMPRESS_TARGET("avx2") inline void widen_row_i16(const int8_t* q, int64_t n, int16_t* x16) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + i),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
}

// One row of per-token quantization, identical to reference.quantize_per_token_int8
// (division, round half to even, clamp +-127): `row` (K fp32 values, modified) has its
// outlier columns (idx, C of them) gathered to xo and zeroed before the absmax, as in
// reference.w8a8_outlier_gemm; q and a (|q|) are zero-padded to Kp bytes. Returns the
// row's scale; `amax` (when given) receives the row's absmax outside the outlier columns
// (the LLM.int8 spike guard's test, w8a8_kernel.cpp).
inline float quantize_row(float* row, int64_t K, const int64_t* idx, int64_t C, int64_t Kp, bool avx2,
                          int8_t* q, uint8_t* a, float* xo, float* amax_out = nullptr) {
  for (int64_t c = 0; c < C; ++c) xo[c] = row[idx[c]];
  for (int64_t c = 0; c < C; ++c) row[idx[c]] = 0.f;
  float amax = 0.f;
  if (avx2) {
    amax = absmax_avx2(row, K);
  } else {
    for (int64_t j = 0; j < K; ++j) amax = std::max(amax, std::fabs(row[j]));
  }
  if (amax_out) *amax_out = amax;
  const float s = std::max(amax, 1e-10f) / 127.f;
  const int64_t done = avx2 ? quantize_span_avx2(row, s, K, q, a) : 0;
  quantize_span_scalar(row + done, s, K - done, q + done, a + done);
  std::memset(q + K, 0, Kp - K);
  std::memset(a + K, 0, Kp - K);
  return s;
}

inline float outlier_dot_scalar(const Args& a, int64_t m, int64_t n) {
  float s = 0.f;
  for (int64_t c = 0; c < a.C; ++c) s += a.xo[m * a.C + c] * load_scale(a.ow, a.owt, n * a.C + c);
  return s;
}

// The fused outliers at M > 1: y[m, n] += sum_c xo[m, c] * ow[n, c] for rows [m0, m1)
// and outputs [n0, n1), after the tiles of that block (which run with C = 0). One pass
// over those rows of the [N, C] outlier weights, read in their own dtype; the sum runs over c
// in order from 0 and is then added to y (outlier_products_avx2 rounds the same way, with
// FMAs).
inline void outlier_products_scalar(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m) {
      float s = 0.f;
      for (int64_t c = 0; c < a.C; ++c) s += a.xo[m * a.C + c] * load_scale(a.ow, a.owt, n * a.C + c);
      a.y[m * a.N + n] += s;
    }
}

// ---- scalar -------------------------------------------------------------------------
inline void block_scalar(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* q = a.qx + m * a.Kp;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = w8_row(a, n);
      const int64_t cs = w8_chunk_stride(a, n);
      int32_t acc = 0;
      for (int64_t k = 0; k < a.K; ++k) acc += static_cast<int32_t>(q[k]) * static_cast<int32_t>(*w8_at(w, cs, k));
      float y = static_cast<float>(acc) * a.sx[m] * load_scale(a.ws, a.wst, n);
      if (a.C) y += outlier_dot_scalar(a, m, n);
      a.y[m * a.N + n] = y;
    }
  }
}

}  // namespace w8
}  // namespace compress_cpu
