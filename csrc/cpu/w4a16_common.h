// The W4A16 kernel's parts that need no ATen: the prepared weight layout (W4Args, row
// tiling), the activation quantizer (scalar and AVX2, the same bytes) and the scalar
// tile of the int8-activation kernel (compress::w4a8_gemm). w4a8_gemm.cpp adds the AVX2 /
// AVX-512 VNNI tiles (w4a16_tile.inc), the op entry
// points and the thread split; csrc/cpu/tests/isa_emulation.cpp includes this to run the
// same tiles under SIMDe. Method and layout: w4a8_gemm.cpp and csrc/cpu/README.md. The
// float-activation kernel (w4a16_gemm.cpp) shares the layout (W4Args, w4_row).
#pragma once

#include "cpu/simd_common.h"

namespace compress_cpu {
namespace w4 {

constexpr int64_t kBlock = 32;  // activation quantization block along K
constexpr int64_t kChunk = 64;  // K per inner step (32 bytes of packed weights)

// Row tiling of the prepared weights (reference.w4a16_tile_cpu): when K % 64 == 0 the
// first N4 = N - N % 4 rows are stored in tiles of 4 rows with their 32-byte chunks
// interleaved (tile t, chunk c, row r at byte (4t * K/2) + 128c + 32r), so the four
// rows an M = 1 tile reads form one sequential stream; the last N % 4 rows, and every
// row when K % 64 != 0, stay row-major. The canonical op passes N4 = 0.
constexpr int64_t kTileRows = 4;
// How far ahead an M = 1 tile prefetches a tiled weight stream. 1-8 KiB measured alike
// (2 KiB ~3% ahead, inside the noise) on a 24-layer chain of decode shapes, 2 threads.
constexpr int64_t kPrefetchBytes = 2048;
// And how far ahead it also prefetches the same stream into L2 (`prefetcht1`), so the
// line is on its way from DRAM well before the 2 KiB `prefetcht0` asks L2 for it. On the
// Xeon (2 threads, cold weights, separate processes, 5 shapes): +8-28% at M = 1 against
// the `prefetcht0` alone; 8 / 16 / 32 / 64 KiB and `prefetcht2` measured alike. Only the
// VNNI M = 1 tiles take it: the AVX2 tiles read 0.83-1.0x with it on the same CPU, the
// four-row tiles (M = 4) 0.87-1.25x, and the W8 GEMV was unchanged.
constexpr int64_t kPrefetchL2Bytes = 16384;

// Fewest rows for which the avx512_vnni level takes the AMX-BF16 tiles (w4a16_amx.inc)
// where the CPU and OS allow them (default kW4AmxMinRows; fewer rows: the int8 tiles, see
// csrc/cpu/README.md); set_amx_min_rows returns the previous value (w4a8_gemm.cpp).
constexpr int64_t kW4AmxMinRows = 16;
int64_t set_amx_min_rows(int64_t rows);
int64_t amx_min_rows();

// Fewest rows for which the avx512_vnni level (without AMX, or below the AMX threshold)
// takes the panel GEMM of w4a8_panel.inc instead of the four-row tiles (default
// kW4PanelMinRows); the same integer dots, fp32 sums in another order.
constexpr int64_t kW4PanelMinRows = 12;
int64_t set_panel_min_rows(int64_t rows);
int64_t panel_min_rows();

struct W4Args {
  int64_t M, N, K, G, KC, NG;  // KC: 64-chunks (ceil), NG: groups
  int64_t N4;                  // rows [0, N4) tiled by 4 (see above), the rest row-major
  const uint8_t* w;            // qweight bytes, K / 2 per row
  const float* s;              // scales fp32 [N, NG]
  const uint8_t* z;            // zero points, uint8 [N, NG]
  const int8_t* xq;  // [M, KC * 64] permuted int8 activations
  const float* xs;   // [M, KC * 8] lane scales: 4 x sx(block 2c), 4 x sx(block 2c + 1)
  const float* xg;   // [M, NG] X_g
  float* y;          // [M, N]
};

// Start of row n's chunk 0, and the distance between its consecutive 32-byte chunks.
inline const uint8_t* w4_row(const W4Args& a, int64_t n) {
  return n < a.N4 ? a.w + (n & ~(kTileRows - 1)) * (a.K / 2) + (n & (kTileRows - 1)) * 32 : a.w + n * (a.K / 2);
}
inline int64_t w4_chunk_stride(const W4Args& a, int64_t n) { return n < a.N4 ? kTileRows * 32 : 32; }

// ---- activation quantization (the same numbers on every ISA) ------------------------
// Block b of row v (32 values) -> int8 at its permuted chunk positions; returns sum(q).
inline int32_t quantize_block_scalar(const float* v, float inv, int64_t b, int8_t* q) {
  const int64_t c = b / 2, half = b % 2;
  int32_t qsum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int32_t qi = static_cast<int32_t>(round_half_even(v[j] * inv));
    qsum += qi;
    // position of k = 64c + 32 half + j inside the chunk: even k -> low half
    const int64_t kk = half * kBlock + j;
    q[c * kChunk + (kk & 1) * 32 + (kk >> 1)] = static_cast<int8_t>(qi);
  }
  return qsum;
}

inline float block_absmax(const float* v) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
  return amax;
}

// Blocks 2c and 2c + 1 (one 64-value chunk) on AVX2: the even / odd split is done on the
// floats (shuffle_ps + a 64-bit permute), then 4 x 8 int32 pack to 32 bytes in order
// (pack_32_epi8).
// v * inv and round-to-nearest-even are the scalar code's operations, so the bytes agree.
COMPRESS_TARGET("avx2,fma") inline void quantize_chunk_avx2(const float* v, float inv_a, float inv_b, int8_t* q, int32_t* qsum_a,
                                int32_t* qsum_b) {
  __m256i ev[4], od[4];
  for (int i = 0; i < 4; ++i) {  // floats 16i .. 16i + 15
    const __m256 inv = _mm256_set1_ps(i < 2 ? inv_a : inv_b);
    const __m256 x0 = _mm256_loadu_ps(v + 16 * i), x1 = _mm256_loadu_ps(v + 16 * i + 8);
    const __m256 e = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(2, 0, 2, 0))), _MM_SHUFFLE(3, 1, 2, 0)));
    const __m256 o = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 1, 3, 1))), _MM_SHUFFLE(3, 1, 2, 0)));
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    ev[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(e, inv), kRound));
    od[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(o, inv), kRound));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), pack_32_epi8(ev[0], ev[1], ev[2], ev[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), pack_32_epi8(od[0], od[1], od[2], od[3]));
  *qsum_a = hsum256_epi32(_mm256_add_epi32(_mm256_add_epi32(ev[0], ev[1]), _mm256_add_epi32(od[0], od[1])));
  *qsum_b = hsum256_epi32(_mm256_add_epi32(_mm256_add_epi32(ev[2], ev[3]), _mm256_add_epi32(od[2], od[3])));
}


// One row: int8 blocks of 32 (symmetric, round half to even) at the permuted positions,
// the lane scales and the per-group sums X_g. Blocks past K (a half chunk) stay zero.
inline void quantize_row(const float* row, int64_t K, int64_t G, int64_t KC, bool avx2, int8_t* q, float* lane,
                  float* gsum) {
  const int64_t NG = K / G, blocks = K / kBlock;
  std::fill(gsum, gsum + NG, 0.f);
  std::fill(lane, lane + KC * 8, 0.f);
  if (K % kChunk) std::fill(q + (KC - 1) * kChunk, q + KC * kChunk, int8_t(0));
  auto scale_of = [](float amax, float* inv) {
    *inv = amax > 0.f ? 127.f / amax : 0.f;
    return amax / 127.f;
  };
  int64_t b = 0;
  if (avx2) {
    for (; b + 2 <= blocks; b += 2) {
      float inv_a, inv_b;
      const float sa = scale_of(absmax_avx2(row + b * kBlock, kBlock), &inv_a);
      const float sb = scale_of(absmax_avx2(row + (b + 1) * kBlock, kBlock), &inv_b);
      int32_t qa, qb;
      quantize_chunk_avx2(row + b * kBlock, inv_a, inv_b, q + (b / 2) * kChunk, &qa, &qb);
      for (int l = 0; l < 4; ++l) lane[(b / 2) * 8 + l] = sa, lane[(b / 2) * 8 + 4 + l] = sb;
      gsum[(b * kBlock) / G] += sa * static_cast<float>(qa);
      gsum[((b + 1) * kBlock) / G] += sb * static_cast<float>(qb);
    }
  }
  for (; b < blocks; ++b) {
    float inv;
    const float sx = scale_of(block_absmax(row + b * kBlock), &inv);
    const int32_t qsum = quantize_block_scalar(row + b * kBlock, inv, b, q);
    for (int l = 0; l < 4; ++l) lane[(b / 2) * 8 + (b % 2) * 4 + l] = sx;
    gsum[(b * kBlock) / G] += sx * static_cast<float>(qsum);
  }
}

// ---- scalar -------------------------------------------------------------------------
inline void w4_scalar(const W4Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t blocks_per_group = a.G / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* q = a.xq + m * a.KC * kChunk;
    const float* lane = a.xs + m * a.KC * 8;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = w4_row(a, n);
      const int64_t cs = w4_chunk_stride(a, n);
      float acc = 0.f, corr = 0.f;
      for (int64_t g = 0; g < a.NG; ++g) {
        float accg = 0.f;
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          const int64_t c = b / 2, half = b % 2;
          const uint8_t* wb = w + c * cs + half * 16;
          const int8_t* lo = q + c * kChunk + half * 16;
          const int8_t* hi = lo + 32;
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j) dot += (wb[j] & 0xF) * lo[j] + (wb[j] >> 4) * hi[j];
          accg += static_cast<float>(dot) * lane[c * 8 + half * 4];
        }
        acc += a.s[n * a.NG + g] * accg;
        corr += a.s[n * a.NG + g] * static_cast<float>(a.z[n * a.NG + g]) * a.xg[m * a.NG + g];
      }
      a.y[m * a.N + n] = acc - corr;
    }
  }
}

}  // namespace w4
}  // namespace compress_cpu
