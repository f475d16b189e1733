// compress::w4a16_gemm on CPU: x [M, K] (fp32 / bf16 / fp16) @ dequant(int4 W [N, K])^T.
// Reference: compress/ops/reference.py::w4a16_gemm. Layout notes: csrc/cpu/README.md.
//
// Method (as llama.cpp does for Q4 x Q8): activations are quantized to int8 per block
// of 32 along K (symmetric, round-half-even), the dot products run in integers
// (u8 nibble x s8 activation -> int32 per block), and per block the int32 sum is scaled
// by (activation block scale x weight group scale). The zero point is folded out:
//   y = sum_g s_g * (sum_{b in g} sx_b * dot_b  -  z_g * X_g),  X_g = sum_{b in g} sx_b * sum(q_b)
// The canonical packing (8 nibbles per int32, k ascending from the low bits) already
// gives the kernel what it wants: in a 32-byte run covering k0..k0+63, the low nibbles
// are the even k and the high nibbles the odd k. So the weights are used in place
// (no repack) and the activations are permuted instead, once per call:
// chunk c of row m holds [q(k0+0), q(k0+2), ..., q(k0+62) | q(k0+1), ..., q(k0+63)].
// Group sizes that are not a multiple of 32 take an exact fp32 dequantize path.
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"

namespace compress_cpu {
namespace {

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

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// Blocks 2c and 2c + 1 (one 64-value chunk) on AVX2: the even / odd split is done on the
// floats (shuffle_ps + a 64-bit permute), then 4 x 8 int32 pack to 32 bytes in order
// (pack_32_epi8).
// v * inv and round-to-nearest-even are the scalar code's operations, so the bytes agree.
inline void quantize_chunk_avx2(const float* v, float inv_a, float inv_b, int8_t* q, int32_t* qsum_a,
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

#pragma GCC pop_options

// One row: int8 blocks of 32 (symmetric, round half to even) at the permuted positions,
// the lane scales and the per-group sums X_g. Blocks past K (a half chunk) stay zero.
void quantize_row(const float* row, int64_t K, int64_t G, int64_t KC, bool avx2, int8_t* q, float* lane,
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

void quantize_activations(const at::Tensor& x, int64_t G, int64_t KC, int8_t* xq, float* xs, float* xg) {
  const int64_t M = x.size(0), K = x.size(1), NG = K / G;
  const bool avx2 = active_isa() >= Isa::Avx2;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(x.scalar_type() == at::kFloat ? 0 : K);
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x.scalar_type() == at::kFloat ? x.data_ptr<float>() + m * K : buf.data();
      if (!buf.empty()) row_to_float(x, m, buf.data());
      quantize_row(row, K, G, KC, avx2, xq + m * KC * kChunk, xs + m * KC * 8, xg + m * NG);
    }
  });
}

// ---- scalar -------------------------------------------------------------------------
void w4_scalar(const W4Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
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

// ---- AVX2 ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace avx2 {
#define W4_VNNI 0
#include "cpu/w4a16_tile.inc"
#undef W4_VNNI
}  // namespace avx2

void w4_avx2(const W4Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if (a.G == 32) avx2::w4_block_avx<true>(a, m0, m1, n0, n1);
  else avx2::w4_block_avx<false>(a, m0, m1, n0, n1);
}
#pragma GCC pop_options

// ---- AVX-512 VNNI (256-bit vpdpbusd: same tiles, one instruction per half-chunk) ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define W4_VNNI 1
#include "cpu/w4a16_tile.inc"
#undef W4_VNNI
}  // namespace vnni

void w4_avx512vnni(const W4Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if (a.G == 32) vnni::w4_block_avx<true>(a, m0, m1, n0, n1);
  else vnni::w4_block_avx<false>(a, m0, m1, n0, n1);
}
#pragma GCC pop_options

// Exact fallback for group sizes that are not a multiple of 32: dequantize n-blocks to
// fp32 (w = u * s - s * z) and multiply with at::mm.
at::Tensor w4_dequant_mm(const at::Tensor& x, const at::Tensor& qweight, const float* s, const uint8_t* z,
                         int64_t G, int64_t N4) {
  const int64_t N = qweight.size(0), K = x.size(1), NG = K / G;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor out = at::empty({x.size(0), N}, xf.options());
  W4Args rows{};
  rows.K = K, rows.N4 = N4, rows.w = reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>());
  const int64_t nb = std::max<int64_t>(1, (4 << 20) / (K * 4));
  at::Tensor wf = at::empty({std::min(nb, N), K}, xf.options());
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t n1 = std::min(N, n0 + nb);
    float* dst = wf.data_ptr<float>();
    at::parallel_for(n0, n1, 1, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        const uint8_t* w = w4_row(rows, n);
        const int64_t cs = w4_chunk_stride(rows, n);
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t byte = w[(k / kChunk) * cs + (k % kChunk) / 2];
          const int u = (k & 1) ? (byte >> 4) : (byte & 0xF);
          const int64_t g = n * NG + k / G;
          dst[(n - n0) * K + k] = static_cast<float>(u) * s[g] - s[g] * static_cast<float>(z[g]);
        }
      }
    });
    out.narrow(1, n0, n1 - n0).copy_(at::mm(xf, wf.narrow(0, 0, n1 - n0).t()));
  }
  return out;
}

// The shared body of both entry points; `scale` is fp32 and `zeros` uint8, both [N, NG].
// `tiled`: qweight is in the prepared row tiling (w4a16_gemm_prepared), else canonical.
at::Tensor w4a16_run(const at::Tensor& x_in, const at::Tensor& qweight_in,
                     const at::Tensor& scale, const at::Tensor& zeros, int64_t G, bool tiled) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0), NG = K / G;
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous();
  if (M == 0 || N == 0) return at::zeros({M, N}, x.options());
  const float* s = scale.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  const int64_t N4 = tiled && K % kChunk == 0 ? N - N % kTileRows : 0;
  if (G % kBlock != 0) return w4_dequant_mm(x, qweight, s, z, G, N4).to(x.scalar_type());

  const int64_t KC = ceil_div(K, kChunk);
  // One workspace for the quantized activations (int8 [M, KC*64]), their lane scales
  // (fp32 [M, KC*8]) and group sums (fp32 [M, NG]): a decode step makes ~100 of these calls.
  const int64_t xq_bytes = M * KC * kChunk, xs_floats = M * KC * 8;
  at::Tensor work = at::empty({xq_bytes + 4 * (xs_floats + M * NG)}, x.options().dtype(at::kByte));
  int8_t* xq = reinterpret_cast<int8_t*>(work.data_ptr<uint8_t>());
  float* xs = reinterpret_cast<float*>(work.data_ptr<uint8_t>() + xq_bytes);  // xq_bytes % 64 == 0
  float* xg = xs + xs_floats;
  quantize_activations(x, G, KC, xq, xs, xg);

  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  W4Args a{M, N, K, G, KC, NG, N4, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()), s, z,
           xq, xs, xg, y.data_ptr<float>()};
  void (*kernel)(const W4Args&, int64_t, int64_t, int64_t, int64_t) = w4_scalar;
  switch (active_isa()) {
    case Isa::Avx512Vnni: kernel = w4_avx512vnni; break;
    case Isa::Avx2: kernel = w4_avx2; break;
    default: break;
  }
  // n-blocks of ~128 KiB of packed weights (L2), m-blocks of 64 rows.
  const int64_t nb = std::max<int64_t>(8, ((128 << 10) / std::max<int64_t>(1, K / 2)) / 8 * 8);
  parallel_tiles(M, N, 64, nb, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) { kernel(a, m0, m1, n0, n1); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

void check_w4_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const at::Tensor& zeros, int64_t G) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt, op, ": qweight must be int32 [N, K/8]");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * 8 == K, op, ": qweight [N, K/8] does not match K=", K);
  TORCH_CHECK(G > 0 && K % G == 0, op, ": group_size ", G, " must divide K=", K);
  TORCH_CHECK(scales.numel() == N * (K / G) && zeros.numel() == N * (K / G), op,
              ": scales/zeros must be [N, K/group_size]");
}

}  // namespace

// Canonical checkpoint tensors (scales fp32/fp16/bf16, zeros uint8): converted to the
// kernel's fp32 (scale, scale * zero) per call. The runtime prepares once at load time
// (reference.w4a16_prepare_cpu: row-tiled qweight, fp32 scales) and calls
// w4a16_gemm_prepared instead.
at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size) {
  check_w4_args("w4a16_gemm", x, qweight, scales, zeros, group_size);
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  return w4a16_run(x, qweight, sf, zeros.to(at::kByte).contiguous(), group_size, /*tiled=*/false);
}

at::Tensor w4a16_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const at::Tensor& zeros, int64_t group_size) {
  check_w4_args("w4a16_gemm_prepared", x, qweight, scale, zeros, group_size);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && zeros.scalar_type() == at::kByte && scale.is_contiguous() &&
                  zeros.is_contiguous(),
              "w4a16_gemm_prepared: scale must be contiguous float32 and zeros contiguous uint8 "
              "(see w4a16_prepare_cpu), got ", scale.scalar_type(), " and ", zeros.scalar_type());
  return w4a16_run(x, qweight, scale, zeros, group_size, /*tiled=*/true);
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w4a16_gemm", &compress_cpu::w4a16_gemm);
  m.impl("w4a16_gemm_prepared", &compress_cpu::w4a16_gemm_prepared);
}
