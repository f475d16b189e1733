// compress::w4a16_gemm on CPU: x [M, K] (fp32 / bf16 / fp16) @ dequant(int4 W [N, K])^T
// with float activations, the numbers the w4a16 scheme (and its compressed-tensors
// export) promises. Reference: compress/ops/reference.py::w4a16_gemm.
// compress::w4a16_gemm_prepared: the same on the load-time tensors (row-tiled qweight,
// fp32 scales, uint8 zeros), what the runtime calls.
//
// Each weight is dequantized exactly as the reference does, w = (u - z) * s in fp32, and
// multiplied with fp32 FMAs, so the result differs from the reference only in the order
// of the sums. Few rows (decode): register tiles that decode each 32-byte run of nibbles
// once for all their rows (w4a16_float_tile.inc; AVX2 and AVX-512). Many rows (prefill):
// blocks of weight rows dequantized to fp32 and multiplied with at::mm. Both read the
// activations permuted to the nibbles' order (per 64 k: the even k, then the odd k).
// Group sizes that are neither 32 nor a multiple of 64 dequantize in K order and use
// at::mm at any M.
//
// The faster int8-activation kernel of the same checkpoints is compress::w4a8_gemm
// (w4a8_gemm.cpp); the runtime takes it with LLM(w4_activations="int8").
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <memory>
#include <vector>

#include "cpu/ops.h"
#include "cpu/w4a16_common.h"
#include "cpu/w4a16_kernel.h"

namespace compress_cpu {
namespace w4 {
namespace {

// ---- AVX2 (8 floats) ----------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace favx2 {
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kFloatTileRows = 2;  // 2 x 4 tiles: 8 accumulators of the 16 registers
constexpr int kRowAcc = 1;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum256_ps(v); }
template <int P>
inline Vec bytes_to_float(__m256i b) {
  const __m128i half = P < 2 ? _mm256_castsi256_si128(b) : _mm256_extracti128_si256(b, 1);
  const __m128i bytes = P % 2 == 0 ? half : _mm_unpackhi_epi64(half, half);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
#include "cpu/w4a16_float_tile.inc"
}  // namespace favx2
#pragma GCC pop_options

// ---- AVX-512 (16 floats; the avx512_vnni level) --------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
// GCC 12 takes the 512-bit intrinsics' own _mm512_undefined_* pass-through operand for an
// uninitialized variable (-W(maybe-)uninitialized); nothing here reads it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace favx512 {
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kFloatTileRows = 4;  // 4 x 4 tiles: 16 accumulators of the 32 registers
constexpr int kRowAcc = 2;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
template <int P>
inline Vec bytes_to_float(__m256i b) {
  const __m128i bytes = P == 0 ? _mm256_castsi256_si128(b) : _mm256_extracti128_si256(b, 1);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
#include "cpu/w4a16_float_tile.inc"
}  // namespace favx512
#include "cpu/w4a16_panel.inc"
#pragma GCC diagnostic pop
#pragma GCC pop_options

// ---- scalar ---------------------------------------------------------------------------
inline float weight_at(const W4Args& a, int64_t n, int64_t k) {
  const uint8_t byte = w4_row(a, n)[(k / kChunk) * w4_chunk_stride(a, n) + (k % kChunk) / 2];
  const int u = (k & 1) ? (byte >> 4) : (byte & 0xF);
  const int64_t g = n * a.NG + k / a.G;
  return static_cast<float>(u - static_cast<int>(a.z[g])) * a.s[g];
}

// The scalar tiles: natural K order (xp unused; x fp32 rows [M, K] in `x`).
void float_block_scalar(const W4Args& a, const float* x, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < a.K; ++k) acc += x[m * a.K + k] * weight_at(a, n, k);
      a.y[m * a.N + n] = acc;
    }
}

// Rows [n0, n1) dequantized to fp32 in K order (dst [n1 - n0, K]): any group size, any ISA.
void dequantize_rows_k_order(const W4Args& a, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = 0; k < a.K; ++k) dst[(n - n0) * a.K + k] = weight_at(a, n, k);
}

// ---- activations ------------------------------------------------------------------------
// Row m of x as fp32 in the permuted K order: per 64 k, the 32 even k then the 32 odd k;
// zeros past K (a half chunk). `tmp`: K floats of scratch (non-fp32 x).
void permute_row(const at::Tensor& x, int64_t m, int64_t KC, float* tmp, float* out) {
  const int64_t K = x.size(1);
  const float* row = tmp;
  if (x.scalar_type() == at::kFloat) row = x.data_ptr<float>() + m * K;
  else row_to_float(x, m, tmp);
  for (int64_t c = 0; c < KC; ++c) {
    float* o = out + c * kChunk;
    const int64_t k0 = c * kChunk;
    for (int64_t j = 0; j < 32; ++j) {
      const int64_t k = k0 + 2 * j;
      o[j] = k < K ? row[k] : 0.f;
      o[32 + j] = k + 1 < K ? row[k + 1] : 0.f;
    }
  }
}

std::atomic<int64_t> mm_rows{kFloatMmMinRows};
std::atomic<int64_t> panel_rows{kFloatPanelMinRows};

using BlockFn = void (*)(const W4Args&, const float*, int64_t, int64_t, int64_t, int64_t);
using DequantFn = void (*)(const W4Args&, int64_t, int64_t, float*);

// y = xs @ dequant(rows)^T through at::mm, n-blocks of ~4 MiB of fp32 weights dequantized
// in parallel: `xs` [M, Kd] fp32 (Kd = K in K order, KC * 64 permuted), `dequant` writes
// rows in the same order.
void dequant_mm(const W4Args& a, const at::Tensor& xs, DequantFn dequant, at::Tensor& y) {
  const int64_t Kd = xs.size(1);
  const int64_t nb = std::min<int64_t>(a.N, std::max<int64_t>(8, (4 << 20) / (Kd * 4)));
  at::Tensor wf = at::empty({nb, Kd}, xs.options());
  for (int64_t n0 = 0; n0 < a.N; n0 += nb) {
    const int64_t n1 = std::min(a.N, n0 + nb);
    float* dst = wf.data_ptr<float>();
    at::parallel_for(n0, n1, 8, [&](int64_t b, int64_t e) { dequant(a, b, e, dst + (b - n0) * Kd); });
    y.narrow(1, n0, n1 - n0).copy_(at::mm(xs, wf.narrow(0, 0, n1 - n0).t()));
  }
}

}  // namespace

int64_t set_float_panel_min_rows(int64_t rows) { return panel_rows.exchange(rows); }
int64_t float_panel_min_rows() { return panel_rows.load(std::memory_order_relaxed); }
int64_t set_float_mm_min_rows(int64_t rows) { return mm_rows.exchange(rows); }
int64_t float_mm_min_rows() { return mm_rows.load(std::memory_order_relaxed); }

void check_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const at::Tensor& zeros, int64_t G) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt, op, ": qweight must be int32 [N, K/8]");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * 8 == K, op, ": qweight [N, K/8] does not match K=", K);
  TORCH_CHECK(G > 0 && K % G == 0, op, ": group_size ", G, " must divide K=", K);
  TORCH_CHECK(scales.numel() == N * (K / G) && zeros.numel() == N * (K / G), op,
              ": scales/zeros must be [N, K/group_size]");
}

void check_prepared_metadata(const char* op, const at::Tensor& scale, const at::Tensor& zeros) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && zeros.scalar_type() == at::kByte && scale.is_contiguous() &&
                  zeros.is_contiguous(),
              op, ": scale must be contiguous float32 and zeros contiguous uint8 (see w4a16_prepare_cpu), got ",
              scale.scalar_type(), " and ", zeros.scalar_type());
}

at::Tensor run_float(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& scale,
                     const at::Tensor& zeros, int64_t G, bool tiled, at::Tensor* out) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0);
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous();
  if (M == 0 || N == 0) return out ? out->zero_() : at::zeros({M, N}, x.options());
  const int64_t KC = ceil_div(K, kChunk), NG = K / G;
  const int64_t N4 = tiled && K % kChunk == 0 ? N - N % kTileRows : 0;
  at::Tensor y = out ? *out : at::empty({M, N}, x.options().dtype(at::kFloat));
  const W4Args a{M, N, K, G, KC, NG, N4, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()),
                 scale.data_ptr<float>(), zeros.data_ptr<uint8_t>(), nullptr, nullptr, nullptr, y.data_ptr<float>()};
  const Isa isa = active_isa();
  const bool tiles = G == kBlock || G % kChunk == 0;  // a group is half a run or whole runs
  if (!tiles || isa == Isa::Scalar) {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    if (!tiles || M >= float_mm_min_rows()) {
      dequant_mm(a, xf, dequantize_rows_k_order, y);
    } else {
      const float* xr = xf.data_ptr<float>();
      parallel_tiles(M, N, 16, 64, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
        float_block_scalar(a, xr, m0, m1, n0, n1);
      });
    }
    return float_to_activation_dtype(y, x.scalar_type());
  }
  const bool avx512 = isa == Isa::Avx512Vnni, g32 = G == kBlock;
  // The permuted activations [M, KC * 64], then K floats per thread for non-fp32 rows.
  const int64_t xp_floats = M * KC * kChunk;
  const bool panel = avx512 && K % kChunk == 0 && M >= float_panel_min_rows();
  const bool mm = !panel && M >= float_mm_min_rows();
  at::Tensor xp_owned;
  std::unique_ptr<Scratch> work;
  float* xp;
  if (mm) {  // at::mm reads it from its own threads: a tensor of our own
    xp_owned = at::empty({M, KC * kChunk}, x.options().dtype(at::kFloat));
    xp = xp_owned.data_ptr<float>();
  } else {
    work = std::make_unique<Scratch>(Scratch::kW4, xp_floats * 4);
    xp = reinterpret_cast<float*>(work->data());
  }
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> tmp(x.scalar_type() == at::kFloat ? 0 : K);
    for (int64_t m = m0; m < m1; ++m) permute_row(x, m, KC, tmp.data(), xp + m * KC * kChunk);
  });
  if (panel) {
    fpanel::gemm(a, xp, g32);
  } else if (mm) {
    DequantFn dq = avx512 ? (g32 ? favx512::dequantize_rows<true> : favx512::dequantize_rows<false>)
                          : (g32 ? favx2::dequantize_rows<true> : favx2::dequantize_rows<false>);
    dequant_mm(a, xp_owned, dq, y);
  } else {
    BlockFn block = avx512 ? (g32 ? favx512::float_block<true> : favx512::float_block<false>)
                           : (g32 ? favx2::float_block<true> : favx2::float_block<false>);
    // n-blocks of ~128 KiB of packed weights (L2), a multiple of 8 rows.
    const int64_t nb = std::max<int64_t>(8, ((128 << 10) / std::max<int64_t>(1, K / 2)) / 8 * 8);
    parallel_tiles(M, N, 64, nb, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) { block(a, xp, m0, m1, n0, n1); });
  }
  return float_to_activation_dtype(y, x.scalar_type());
}

}  // namespace w4

// Canonical checkpoint tensors (scales fp32/fp16/bf16, zeros uint8), converted to the
// kernel's fp32 scales per call. The runtime prepares once at load time
// (reference.w4a16_prepare_cpu) and calls w4a16_gemm_prepared instead.
at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size) {
  w4::check_args("w4a16_gemm", x, qweight, scales, zeros, group_size);
  return w4::run_float(x, qweight, scales.to(at::kFloat).contiguous(), zeros.to(at::kByte).contiguous(), group_size,
                       /*tiled=*/false);
}

at::Tensor w4a16_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const at::Tensor& zeros, int64_t group_size) {
  w4::check_args("w4a16_gemm_prepared", x, qweight, scale, zeros, group_size);
  w4::check_prepared_metadata("w4a16_gemm_prepared", scale, zeros);
  return w4::run_float(x, qweight, scale, zeros, group_size, /*tiled=*/true);
}

at::Tensor& w4a16_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                     const at::Tensor& zeros, int64_t group_size, at::Tensor& out) {
  w4::check_args("w4a16_gemm_prepared_into", x, qweight, scale, zeros, group_size);
  w4::check_prepared_metadata("w4a16_gemm_prepared_into", scale, zeros);
  check_float_out("w4a16_gemm_prepared_into", x, qweight.size(0), out);
  w4::run_float(x, qweight, scale, zeros, group_size, /*tiled=*/true, &out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w4a16_gemm", &compress_cpu::w4a16_gemm);
  m.impl("w4a16_gemm_prepared", &compress_cpu::w4a16_gemm_prepared);
}
