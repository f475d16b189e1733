// compress::w4a8_gemm_lanes on CPU: w4a8_gemm (int4 weights x int8 activation blocks of
// 32) on the weight-row-lane layout (reference.w4a8_prepare_lanes), whose zmm lanes are
// 16 weight rows. Reference: compress/ops/reference.py::w4a8_gemm_lanes.
//
// Why another layout. The row-tiled kernels (w4a8_gemm.cpp) put k or activation rows in
// the vector lanes: the four-row tiles dot one activation row with four weight rows and
// fold lanes with hadds per 64 k and row (140-190 GMAC/s at 2-11 rows on two Zen5
// threads), the panel GEMM's lanes are 16 activation rows (idle below 16 rows). Here a
// lane is a weight row, so no count of activation rows leaves lanes idle and nothing is
// folded:
// - layout: per tile of 16 weight rows, per 64-k chunk c, per word j (0-7) of a row's
//   chunk, the 16 rows' words side by side (64 bytes). A word holds 8 nibbles: its low
//   nibbles are k = 64c + 8j + {0, 2, 4, 6}, its high nibbles k + 1. Rows past N are zero.
// - activations are quantized and permuted per chunk as for w4a8_gemm (evens, then odds),
//   so the low-nibble quad of word j meets activation word j and the high quad word 8 + j;
// - one zmm load + and / shift / and gives two u8 weight vectors (16 rows x 4 k each),
//   each dotted with every activation row's 4 bytes broadcast (s8): one vpdpbusd per 64
//   multiply-accumulates; words 0-3 are the chunk's first block of 32, 4-7 the second;
// - per block and activation row one conversion and one FMA with the row's block scale;
//   per group one FMA with the 16 rows' scales and one with their scale x zero point times
//   the row's X_g (the zero point folded out as in the other tiles);
// - 16 outputs of a row are one store (masked past N).
// Rows are computed independently in a fixed order, so a row's result does not depend on
// its batch mates or on the thread count.
// From lanes::amx_min_rows() rows on CPUs with AMX-INT8 the same sums run on tdpbsud tiles
// (w4a8_lanes_amx.inc), with the same bits.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "cpu/amx_common.h"
#include "cpu/kernel_common.h"
#include "cpu/ops.h"
#include "cpu/w4a16_common.h"
#include "cpu/w4a16_kernel.h"
#include "cpu/w4_lanes.h"

namespace compress_cpu {

namespace {
std::atomic<int64_t> g_pair_min_rows{12};
std::atomic<int64_t> g_amx_min_rows{lanes::kAmxMinRows};
}
int64_t lanes::set_pair_min_rows(int64_t rows) { return g_pair_min_rows.exchange(rows); }
int64_t lanes::pair_min_rows() { return g_pair_min_rows.load(std::memory_order_relaxed); }
int64_t lanes::set_amx_min_rows(int64_t rows) { return g_amx_min_rows.exchange(rows); }
int64_t lanes::amx_min_rows() { return g_amx_min_rows.load(std::memory_order_relaxed); }

namespace {

using namespace w4;
using lanes::kLaneRows;
using lanes::kPrefetchAhead;
using lanes::kTileChunkBytes;
constexpr int64_t kMaxRows = 8;  // activation rows a tile call (16 zmm of sums)

struct LaneArgs {
  int64_t M, N, K, G, KC, NG, T;
  const uint8_t* w;   // [T][KC][8][16] words
  const float* s;     // [T][NG][16]: the rows' group scales
  const uint8_t* z;   // [T][NG][16]: zero points
  const int8_t* xq;   // [M][KC * 64], permuted chunks
  const float* xs;    // [M][KC * 8]: lane scales, block A x4 then block B x4 per chunk
  const float* xg;    // [M][NG]: X_g
  float* y;           // [M][N]
};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// Activation rows [m0, m0 + MT) against tiles t .. t + NT - 1 over the whole K; outputs
// into y. Two tiles a call (NT = 2) use each activation broadcast twice: at 4 rows x 2
// tiles a core ran 1.2x the 8 rows x 1 tile of NT = 1 in L1 (Zen5: the block's float
// FMAs share the multiply pipes with vpdpbusd, which caps the loop near 84% of its peak).
// Each output's operations are the same whatever MT and NT: the choice moves no bit.
template <int MT, int NT>
void lanes_tile(const LaneArgs& a, int64_t t, int64_t m0) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t bpg = a.G / kBlock, xrow = a.KC * kChunk, lrow = a.KC * 8;
  const int64_t tile_bytes = a.KC * kTileChunkBytes;
  const uint8_t* wt[NT];
  __mmask16 mask[NT];
  for (int u = 0; u < NT; ++u) {
    wt[u] = a.w + (t + u) * a.KC * kTileChunkBytes;
    const int64_t cols = std::min<int64_t>(kLaneRows, a.N - (t + u) * kLaneRows);
    mask[u] = static_cast<__mmask16>((1u << cols) - 1u);
  }
  __m512 acc[NT][MT];
  for (int u = 0; u < NT; ++u)
    for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.NG; ++g) {
    __m512 ag[NT][MT];
    for (int u = 0; u < NT; ++u)
      for (int m = 0; m < MT; ++m) ag[u][m] = _mm512_setzero_ps();
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const int64_t c = b >> 1, half = b & 1;
      __m512i d[NT][MT];
      // each tile's stream kPrefetchAhead on; past the tile's end that is where the next
      // call's tile u starts (tiles are contiguous, tile_bytes each)
      const int64_t at = c * kTileChunkBytes + half * 256 + kPrefetchAhead;
      const int64_t ahead = at < tile_bytes ? at : at + (NT - 1) * tile_bytes;
      for (int u = 0; u < NT; ++u) {
        for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(wt[u] + ahead + 64 * l), _MM_HINT_T0);
        for (int m = 0; m < MT; ++m) d[u][m] = _mm512_setzero_si512();
      }
#pragma GCC unroll 4
      for (int jj = 0; jj < 4; ++jj) {
        __m512i lo[NT], hi[NT];
        for (int u = 0; u < NT; ++u) {
          const __m512i raw = _mm512_loadu_si512(wt[u] + c * kTileChunkBytes + half * 256 + 64 * jj);
          lo[u] = _mm512_and_si512(raw, nib);
          hi[u] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
        }
        const int64_t j = 4 * half + jj;
        for (int m = 0; m < MT; ++m) {
          const int8_t* xp = a.xq + (m0 + m) * xrow + c * kChunk;
          int32_t even, odd;
          std::memcpy(&even, xp + 4 * j, 4);
          std::memcpy(&odd, xp + 32 + 4 * j, 4);
          const __m512i xe = _mm512_set1_epi32(even), xo = _mm512_set1_epi32(odd);
          for (int u = 0; u < NT; ++u) {
            d[u][m] = _mm512_dpbusd_epi32(d[u][m], lo[u], xe);
            d[u][m] = _mm512_dpbusd_epi32(d[u][m], hi[u], xo);
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m512 xs = _mm512_set1_ps(a.xs[(m0 + m) * lrow + c * 8 + half * 4]);
        for (int u = 0; u < NT; ++u) ag[u][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[u][m]), xs, ag[u][m]);
      }
    }
    for (int u = 0; u < NT; ++u) {
      const int64_t meta = ((t + u) * a.NG + g) * kLaneRows;
      const __m512 sv = _mm512_maskz_loadu_ps(mask[u], a.s + meta);
      // scale x zero point rounded to fp32, as the reference's product
      const __m512 szv = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask[u], a.z + meta))));
      for (int m = 0; m < MT; ++m) {
        acc[u][m] = _mm512_fmadd_ps(ag[u][m], sv, acc[u][m]);
        acc[u][m] = _mm512_fnmadd_ps(szv, _mm512_set1_ps(a.xg[(m0 + m) * a.NG + g]), acc[u][m]);
      }
    }
  }
  for (int u = 0; u < NT; ++u)
    for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(a.y + (m0 + m) * a.N + (t + u) * kLaneRows, mask[u], acc[u][m]);
}

// Rows m0 .. m0 + rows - 1 (rows < unit) against tiles t .. t + NT - 1.
template <int NT, int... Rows>
void lanes_rest(const LaneArgs& a, int64_t t, int64_t m0, int64_t rows, std::integer_sequence<int, Rows...>) {
  ((rows == Rows + 1 ? lanes_tile<Rows + 1, NT>(a, t, m0) : void()), ...);
}

// Tiles t0 .. t1 - 1: from lanes::pair_min_rows() rows (12), pairs of tiles in 4-row calls
// (a last odd tile alone, 8 rows a call); below, a tile at a time with all its rows. Decode
// of the 345M model from DRAM (2 threads, Zen5) with pairs from 2 rows: batch 2 / 4 0.86x /
// 0.90x (two weight streams a thread where one is the bound), 8 0.99x, 12 1.045x, 16 1.04x;
// prefill-sized calls 1.2x.
void lanes_vnni(const LaneArgs& a, int64_t t0, int64_t t1) {
  constexpr int kPairRows = 4;
  const bool pairs = a.M >= lanes::pair_min_rows();
  for (int64_t t = t0; t < t1;) {
    const int nt = pairs && t + 1 < t1 ? 2 : 1;
    for (int u = 0; u < nt; ++u)
      if (t + nt + u < a.T) lanes::prefetch_tile_metadata(a.s, a.z, a.NG, t + nt + u);
    int64_t m = 0;
    if (nt == 2) {
      for (; m + kPairRows <= a.M; m += kPairRows) lanes_tile<kPairRows, 2>(a, t, m);
      if (m < a.M) lanes_rest<2>(a, t, m, a.M - m, std::make_integer_sequence<int, kPairRows - 1>{});
    } else {
      for (; m + kMaxRows <= a.M; m += kMaxRows) lanes_tile<kMaxRows, 1>(a, t, m);
      if (m < a.M) lanes_rest<1>(a, t, m, a.M - m, std::make_integer_sequence<int, kMaxRows - 1>{});
    }
    t += nt;
  }
}
#pragma GCC pop_options

// AVX2: a tile's rows 0-7, then 8-15 (a ymm holds 8 lanes, half of each 64-byte word
// line), up to 2 activation rows at once. vpmaddubsw + vpmaddwd give each lane the
// integer dot vpdpbusd gives (4 x u4 x s8: no saturation), then the same float operations.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <int MT>
void lanes_half_avx2(const LaneArgs& a, int64_t t, int64_t hf, int64_t m0) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t bpg = a.G / kBlock, xrow = a.KC * kChunk, lrow = a.KC * 8;
  const uint8_t* wt = a.w + t * a.KC * kTileChunkBytes + hf * 32;
  const int64_t n0 = t * kLaneRows + hf * 8, cols = std::min<int64_t>(8, a.N - n0);
  if (cols <= 0) return;
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.NG; ++g) {
    __m256 ag[MT];
    for (int m = 0; m < MT; ++m) ag[m] = _mm256_setzero_ps();
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const int64_t c = b >> 1, half = b & 1;
      const uint8_t* wb = wt + c * kTileChunkBytes + half * 256;  // words 4 half .. 4 half + 3
      if (hf == 0)
        for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchAhead + 64 * l), _MM_HINT_T0);
      __m256i d[MT];
      for (int m = 0; m < MT; ++m) d[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int jj = 0; jj < 4; ++jj) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * jj));
        const __m256i lo = _mm256_and_si256(raw, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
        const int64_t j = 4 * half + jj;
        for (int m = 0; m < MT; ++m) {
          const int8_t* xp = a.xq + (m0 + m) * xrow + c * kChunk;
          int32_t even, odd;
          std::memcpy(&even, xp + 4 * j, 4);
          std::memcpy(&odd, xp + 32 + 4 * j, 4);
          const __m256i pe = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(even));
          const __m256i po = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd));
          d[m] = _mm256_add_epi32(d[m], _mm256_madd_epi16(_mm256_add_epi16(pe, po), ones));
        }
      }
      for (int m = 0; m < MT; ++m)
        ag[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[m]), _mm256_set1_ps(a.xs[(m0 + m) * lrow + c * 8 + half * 4]),
                                ag[m]);
    }
    const __m256 sv = _mm256_loadu_ps(a.s + (t * a.NG + g) * kLaneRows + hf * 8);
    // scale x zero point rounded to fp32, as the reference's product
    const __m256 szv = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.z + (t * a.NG + g) * kLaneRows + hf * 8)))));
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm256_fmadd_ps(ag[m], sv, acc[m]);
      acc[m] = _mm256_fnmadd_ps(szv, _mm256_set1_ps(a.xg[(m0 + m) * a.NG + g]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) lanes::store_half_tile(a.y + (m0 + m) * a.N + n0, acc[m], cols);
}

void lanes_avx2(const LaneArgs& a, int64_t t0, int64_t t1) {
  lanes::for_half_tiles(a.T, a.M, a.s, a.z, a.NG, t0, t1, [&](int64_t t, int64_t half, int64_t m, bool pair) {
    if (pair) lanes_half_avx2<2>(a, t, half, m);
    else lanes_half_avx2<1>(a, t, half, m);
  });
}
#pragma GCC pop_options

// Below AVX2 (a forced ISA, or a CPU the runtime would not prepare this layout for): the
// same sums in the same order, one lane at a time.
void lanes_scalar(const LaneArgs& a, int64_t t0, int64_t t1) {
  const int64_t bpg = a.G / kBlock, xrow = a.KC * kChunk, lrow = a.KC * 8;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = a.w + t * a.KC * kTileChunkBytes;
    const int64_t n0 = t * kLaneRows, cols = std::min<int64_t>(kLaneRows, a.N - n0);
    for (int64_t m = 0; m < a.M; ++m) {
      for (int64_t r = 0; r < cols; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < a.NG; ++g) {
          float ag = 0.f;
          for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
            const int64_t c = b >> 1, half = b & 1;
            const int8_t* xp = a.xq + m * xrow + c * kChunk;
            int32_t d = 0;
            for (int64_t jj = 0; jj < 4; ++jj) {
              const int64_t j = 4 * half + jj;
              const uint8_t* word = wt + c * kTileChunkBytes + (j * kLaneRows + r) * 4;
              for (int i = 0; i < 4; ++i) {
                d += static_cast<int32_t>(word[i] & 0x0F) * xp[4 * j + i];
                d += static_cast<int32_t>(word[i] >> 4) * xp[32 + 4 * j + i];
              }
            }
            ag = std::fma(static_cast<float>(d), a.xs[m * lrow + c * 8 + half * 4], ag);
          }
          acc = std::fma(ag, a.s[(t * a.NG + g) * kLaneRows + r], acc);
          const float sz = a.s[(t * a.NG + g) * kLaneRows + r] * static_cast<float>(a.z[(t * a.NG + g) * kLaneRows + r]);
          acc = std::fma(-sz, a.xg[m * a.NG + g], acc);
        }
        a.y[m * a.N + n0 + r] = acc;
      }
    }
  }
}

// ---- AMX-INT8 (on top of the AVX-512 VNNI level) ------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#include "cpu/w4a8_lanes_amx.inc"
#pragma GCC pop_options

at::Tensor lanes_run(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scale, const at::Tensor& zeros,
                     int64_t G, int64_t n, at::Tensor* out) {
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = n, KC = K / kChunk, NG = K / G;
  at::Tensor y = out ? *out : at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out ? y : float_to_activation_dtype(y, x.scalar_type());
  const QuantizedActivations q(x, G, KC);
  const LaneArgs a{M, N, K, G, KC, NG, qweight.size(0), reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()),
                   scale.data_ptr<float>(), zeros.data_ptr<uint8_t>(), q.xq, q.xs, q.xg, y.data_ptr<float>()};
  const Isa isa = active_isa();
  if (isa == Isa::Avx512Vnni && M >= std::max<int64_t>(2, lanes::amx_min_rows()) && amx_int8_available()) {
    const AmxActivations xa(a);
    const AmxRows all = xa.rows;
    lanes::for_passes(M, K, kAmxLaneRows, a.T, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
      LaneArgs b = a;
      b.M = rows, b.y = a.y + m0 * N;
      lanes_amx(b, all.from(m0, K, NG), t0, t1);
    });
    return out ? y : float_to_activation_dtype(y, x.scalar_type());
  }
  lanes::for_passes(M, K, kMaxRows, a.T, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
    LaneArgs b = a;
    b.M = rows, b.xq = a.xq + m0 * KC * kChunk, b.xs = a.xs + m0 * KC * 8, b.xg = a.xg + m0 * NG, b.y = a.y + m0 * N;
    if (isa == Isa::Avx512Vnni) lanes_vnni(b, t0, t1);
    else if (isa == Isa::Avx2) lanes_avx2(b, t0, t1);
    else lanes_scalar(b, t0, t1);
  });
  return out ? y : float_to_activation_dtype(y, x.scalar_type());
}

}  // namespace

void lanes::check_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const at::Tensor& zeros, int64_t G, int64_t n, Groups groups) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a 2-D CPU tensor, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt && qweight.is_contiguous(), op,
              ": qweight must be the contiguous int32 [tiles, K * 2] of reference.w4a8_prepare_lanes, got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(qweight.size(1) == 2 * K, op, ": qweight holds K = ", qweight.size(1) / 2, " a row, x has K = ", K);
  TORCH_CHECK(K % kChunk == 0, op, ": K must be a multiple of 64, got ", K);
  if (groups == Groups::kInt8Blocks) {
    TORCH_CHECK(G > 0 && K % G == 0 && (G == kBlock || G % kChunk == 0), op,
                ": group_size must divide K and be 32 or a multiple of 64, got ", G, " for K = ", K);
  } else {
    TORCH_CHECK(G > 0 && G % 8 == 0 && K % G == 0, op, ": group_size must be a multiple of 8 dividing K, got ", G,
                " for K = ", K);
  }
  const int64_t tiles = qweight.size(0);
  TORCH_CHECK(n > 0 && ceil_div(n, kLaneRows) == tiles, op, ": n = ", n, " output features do not make the ", tiles,
              " tiles of 16 rows qweight holds");
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == tiles && scale.size(1) == K / G && scale.size(2) == kLaneRows,
              op, ": scale must be the contiguous float32 [tiles, K / group_size, 16] = [", tiles, ", ", K / G,
              ", 16], got ", scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK(zeros.sizes() == scale.sizes() && zeros.scalar_type() == at::kByte && zeros.is_contiguous(), op,
              ": zeros must be contiguous uint8 shaped like scale ", scale.sizes(), ", got ", zeros.scalar_type(), " ",
              zeros.sizes());
  TORCH_CHECK(qweight.device().is_cpu() && scale.device().is_cpu() && zeros.device().is_cpu(), op,
              ": all tensors must be on the CPU");
}

at::Tensor w4a8_gemm_lanes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const at::Tensor& zeros, int64_t group_size, int64_t n) {
  lanes::check_args("w4a8_gemm_lanes", x, qweight, scale, zeros, group_size, n, lanes::Groups::kInt8Blocks);
  return lanes_run(x, qweight, scale, zeros, group_size, n, nullptr);
}

at::Tensor& w4a8_gemm_lanes_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                 const at::Tensor& zeros, int64_t group_size, int64_t n, at::Tensor& out) {
  lanes::check_args("w4a8_gemm_lanes_into", x, qweight, scale, zeros, group_size, n, lanes::Groups::kInt8Blocks);
  check_float_out("w4a8_gemm_lanes_into", x, n, out);
  lanes_run(x, qweight, scale, zeros, group_size, n, &out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("w4a8_gemm_lanes", &compress_cpu::w4a8_gemm_lanes); }
