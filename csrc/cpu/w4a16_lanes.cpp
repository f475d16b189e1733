// compress::w4a16_gemm_lanes on CPU: w4a16_gemm (int4 weights x float activations, the
// scheme's own numbers) on the weight-row-lane layout of w4a8_lanes.cpp
// (reference.w4a8_prepare_lanes: per 16-row tile and 64-k chunk, word j of the 16 rows side
// by side; fp32 scales and uint8 zero points [tiles, K/G, 16]). Reference:
// compress/ops/reference.py::w4a16_gemm_lanes.
//
// A zmm's lanes are 16 weight rows. One 64-byte load holds word j (8 nibbles, k = 8w ..
// 8w + 7) of the tile's rows; per nibble a shift, an `and`, the subtraction of the rows'
// zero points (int32) and a conversion give the exact integers u - z of 16 rows at one k
// as fp32, and each activation row adds them times its x[k] (broadcast) with one FMA. As
// the row-tiled float tiles do, a group's products are summed unscaled and multiplied by
// the rows' scales once per group: y = sum_g s_g * sum_{k in g} x_k (u_k - z_g).
// Every row keeps four partial sums per group (k mod 4), added as (0 + 1) + (2 + 3), in
// the same order whatever rows share the call, so a row's result does not depend on its
// batch mates, the thread count or the ISA level (the AVX2 form runs the same operations
// on 8 lanes, the scalar form one lane at a time).
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"
#include "cpu/w4_lanes.h"

namespace compress_cpu {
namespace {

using lanes::kLaneRows;
using lanes::kPrefetchAhead;
using lanes::kTileChunkBytes;
constexpr int64_t kMaxRows = 4;  // activation rows a tile call (4 x 4 partial sums + 4 sums)

struct FloatLaneArgs {
  int64_t M, N, K, G, NG, T;
  const uint8_t* w;   // [T][K / 64][8][16] words
  const float* s;     // [T][NG][16]
  const uint8_t* z;   // [T][NG][16]
  const float* x;     // [M][K] fp32
  float* y;           // [M][N]
};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
template <int MT>
void float_lanes_tile(const FloatLaneArgs& a, int64_t t, int64_t m0) {
  const __m512i nib = _mm512_set1_epi32(0x0F);
  const uint8_t* wt = a.w + t * (a.K / 64) * kTileChunkBytes;
  const int64_t n0 = t * kLaneRows, cols = std::min<int64_t>(kLaneRows, a.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const float* xr = a.x + m0 * a.K;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t words = a.G / 8;
  for (int64_t g = 0; g < a.NG; ++g) {
    const __m512i zv = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, a.z + (t * a.NG + g) * kLaneRows));
    __m512 ag[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < 4; ++h) ag[m][h] = _mm512_setzero_ps();
    for (int64_t w = g * words; w < (g + 1) * words; ++w) {
      const uint8_t* wp = wt + (w >> 3) * kTileChunkBytes + (w & 7) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchAhead), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(wp);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m512i u = _mm512_and_si512(i == 0 ? raw : _mm512_srli_epi32(raw, 4 * i), nib);
        const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(u, zv));
        const int64_t k = 8 * w + i;
        for (int m = 0; m < MT; ++m) ag[m][i & 3] = _mm512_fmadd_ps(d, _mm512_set1_ps(xr[m * a.K + k]), ag[m][i & 3]);
      }
    }
    const __m512 sv = _mm512_maskz_loadu_ps(mask, a.s + (t * a.NG + g) * kLaneRows);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(ag[m][0], ag[m][1]), _mm512_add_ps(ag[m][2], ag[m][3])), sv,
                               acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(a.y + (m0 + m) * a.N + n0, mask, acc[m]);
}

void float_lanes_avx512(const FloatLaneArgs& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    if (t + 1 < a.T) lanes::prefetch_tile_metadata(a.s, a.z, a.NG, t + 1);
    int64_t m = 0;
    for (; m + kMaxRows <= a.M; m += kMaxRows) float_lanes_tile<kMaxRows>(a, t, m);
    switch (a.M - m) {
      case 3: float_lanes_tile<3>(a, t, m); break;
      case 2: float_lanes_tile<2>(a, t, m); break;
      case 1: float_lanes_tile<1>(a, t, m); break;
      default: break;
    }
  }
}
#pragma GCC pop_options

// AVX2 + FMA: the same operations on a tile's rows 0-7, then 8-15 (a ymm holds 8 lanes:
// half of each 64-byte word line), up to 2 activation rows at once (16 ymm registers).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <int MT>
void float_lanes_half_avx2(const FloatLaneArgs& a, int64_t t, int64_t half, int64_t m0) {
  const __m256i nib = _mm256_set1_epi32(0x0F);
  const uint8_t* wt = a.w + t * (a.K / 64) * kTileChunkBytes + half * 32;
  const int64_t n0 = t * kLaneRows + half * 8, cols = std::min<int64_t>(8, a.N - n0);
  if (cols <= 0) return;
  const float* xr = a.x + m0 * a.K;
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t words = a.G / 8;
  for (int64_t g = 0; g < a.NG; ++g) {
    const __m256i zv = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.z + (t * a.NG + g) * kLaneRows + half * 8)));
    __m256 ag[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < 4; ++h) ag[m][h] = _mm256_setzero_ps();
    for (int64_t w = g * words; w < (g + 1) * words; ++w) {
      const uint8_t* wp = wt + (w >> 3) * kTileChunkBytes + (w & 7) * 64;
      if (half == 0) _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchAhead), _MM_HINT_T0);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i u = _mm256_and_si256(i == 0 ? raw : _mm256_srli_epi32(raw, 4 * i), nib);
        const __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(u, zv));
        const int64_t k = 8 * w + i;
        for (int m = 0; m < MT; ++m) ag[m][i & 3] = _mm256_fmadd_ps(d, _mm256_broadcast_ss(xr + m * a.K + k), ag[m][i & 3]);
      }
    }
    const __m256 sv = _mm256_loadu_ps(a.s + (t * a.NG + g) * kLaneRows + half * 8);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(ag[m][0], ag[m][1]), _mm256_add_ps(ag[m][2], ag[m][3])), sv,
                               acc[m]);
  }
  for (int m = 0; m < MT; ++m) lanes::store_half_tile(a.y + (m0 + m) * a.N + n0, acc[m], cols);
}

void float_lanes_avx2(const FloatLaneArgs& a, int64_t t0, int64_t t1) {
  lanes::for_half_tiles(a.T, a.M, a.s, a.z, a.NG, t0, t1, [&](int64_t t, int64_t half, int64_t m, bool pair) {
    if (pair) float_lanes_half_avx2<2>(a, t, half, m);
    else float_lanes_half_avx2<1>(a, t, half, m);
  });
}
#pragma GCC pop_options

// Below AVX2: the same operations in the same order, one lane at a time.
void float_lanes_scalar(const FloatLaneArgs& a, int64_t t0, int64_t t1) {
  const int64_t words = a.G / 8;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = a.w + t * (a.K / 64) * kTileChunkBytes;
    const int64_t n0 = t * kLaneRows, cols = std::min<int64_t>(kLaneRows, a.N - n0);
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t r = 0; r < cols; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < a.NG; ++g) {
          const int32_t z = a.z[(t * a.NG + g) * kLaneRows + r];
          float ag[4] = {0.f, 0.f, 0.f, 0.f};
          for (int64_t w = g * words; w < (g + 1) * words; ++w) {
            uint32_t word;
            std::memcpy(&word, wt + (w >> 3) * kTileChunkBytes + (w & 7) * 64 + r * 4, 4);
            for (int i = 0; i < 8; ++i) {
              const float d = static_cast<float>(static_cast<int32_t>((word >> (4 * i)) & 0x0F) - z);
              ag[i & 3] = std::fma(d, a.x[m * a.K + 8 * w + i], ag[i & 3]);
            }
          }
          acc = std::fma((ag[0] + ag[1]) + (ag[2] + ag[3]), a.s[(t * a.NG + g) * kLaneRows + r], acc);
        }
        a.y[m * a.N + n0 + r] = acc;
      }
  }
}

at::Tensor float_lanes_run(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scale,
                           const at::Tensor& zeros, int64_t G, int64_t n, at::Tensor* out) {
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = n;
  at::Tensor y = out ? *out : at::empty({M, N}, x.options());
  if (M == 0) return out ? y : float_to_activation_dtype(y, x_in.scalar_type());
  FloatLaneArgs a{M, N, K, G, K / G, qweight.size(0), reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()),
                  scale.data_ptr<float>(), zeros.data_ptr<uint8_t>(), x.data_ptr<float>(), y.data_ptr<float>()};
  const Isa isa = active_isa();
  lanes::for_passes(M, 4 * K, kMaxRows, a.T, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
    FloatLaneArgs b = a;
    b.M = rows, b.x = a.x + m0 * K, b.y = a.y + m0 * N;
    if (isa == Isa::Avx512Vnni) float_lanes_avx512(b, t0, t1);
    else if (isa == Isa::Avx2) float_lanes_avx2(b, t0, t1);
    else float_lanes_scalar(b, t0, t1);
  });
  return out ? y : float_to_activation_dtype(y, x_in.scalar_type());
}

}  // namespace

at::Tensor w4a16_gemm_lanes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const at::Tensor& zeros, int64_t group_size, int64_t n) {
  lanes::check_args("w4a16_gemm_lanes", x, qweight, scale, zeros, group_size, n, lanes::Groups::kWords);
  return float_lanes_run(x, qweight, scale, zeros, group_size, n, nullptr);
}

at::Tensor& w4a16_gemm_lanes_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                  const at::Tensor& zeros, int64_t group_size, int64_t n, at::Tensor& out) {
  lanes::check_args("w4a16_gemm_lanes_into", x, qweight, scale, zeros, group_size, n, lanes::Groups::kWords);
  check_float_out("w4a16_gemm_lanes_into", x, n, out);
  float_lanes_run(x, qweight, scale, zeros, group_size, n, &out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("w4a16_gemm_lanes", &compress_cpu::w4a16_gemm_lanes); }
