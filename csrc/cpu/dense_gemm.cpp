// compress::dense_gemm (CPU): y = x W^T for a float32 or bfloat16 weight W [N, K] and a
// few rows of x [M, K] (a decode step, a speculative verify pass): each weight row is
// read once and multiplied into every row of x, accumulating in float32.
//
// Why: a decode step streams every weight once, so M rows should cost what one costs
// until compute catches up. MKL's sgemm for 2 <= M <= 16 packs the weight first: on the
// embedded model's weights (27 MB, out of cache) M = 2 took 3.4x the time of M = 1 and
// M = 4 5.7x (1 thread, loaded machine) -- the cost of a verify pass of k + 1 tokens in
// speculative decoding. The order of every sum here depends only on K (one fixed
// sequence of fused multiply-adds per 16 lanes, then a fixed lane reduction), so a row's
// result does not depend on the other rows of x: batch-invariant, as greedy speculative
// decoding needs to reproduce plain decoding.
//
// More than kMaxRows rows (passes of 16 rows, 8 with AVX2), or other dtypes, go to at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"

namespace compress_cpu {
namespace {

// Rows beyond this go to at::mm: by then the weight's reads are amortised over enough
// rows that MKL's packed GEMM is the faster one (a verify pass of 16 sequences x 4 tokens).
constexpr int64_t kMaxRows = 64;

// 16 weights as float32 from float32 or bfloat16 storage.
template <typename W>
COMPRESS_TARGET("avx512f,avx512bw,avx512vl") inline __m512 load16(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <typename W>
COMPRESS_TARGET("avx512f,avx512bw,avx512vl") inline __m512 load16_masked(const W* p, __mmask16 m) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Weight rows per register tile for M rows of x: the M x NT accumulators stay in registers
// and each x vector loaded serves NT weight rows (fewer reads of x, which for 8 rows of
// K = 1024 no longer fits L1 beside the weights). A (row, output) sum runs the same way
// in every tile shape, so the shape changes no result.
template <int M>
constexpr int avx512_tile_rows() { return M <= 4 ? 4 : M <= 8 ? 2 : 1; }
template <int M>
constexpr int avx2_tile_rows() { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }

// Weight rows n .. n + NT - 1 against the M rows of x (float32, row stride K); y[m * N + n].
template <typename W, int M, int NT>
COMPRESS_TARGET("avx512f,avx512bw,avx512vl")
inline void tile_avx512(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n) {
  const int64_t K16 = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - K16)) - 1u);
  __m512 acc[M][NT];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load16(w + (n + j) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_fmadd_ps(wv[j], xv, acc[m][j]);
    }
  }
  if (tail) {
    __m512 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load16_masked(w + (n + j) * K + K16, tail);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + K16);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_fmadd_ps(wv[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NT; ++j) y[m * N + n + j] = _mm512_reduce_add_ps(acc[m][j]);
}

// Rows [n0, n1) of W against the M (<= 16) rows of x.
template <typename W, int M>
COMPRESS_TARGET("avx512f,avx512bw,avx512vl")
void rows_avx512(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NT = avx512_tile_rows<M>();
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) tile_avx512<W, M, NT>(x, w, y, K, N, n);
  for (; n < n1; ++n) tile_avx512<W, M, 1>(x, w, y, K, N, n);
}

// The same with 8 lanes (AVX2 + FMA); bfloat16 widened 8 at a time.
template <typename W>
COMPRESS_TARGET("avx2,fma") inline __m256 load8(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

COMPRESS_TARGET("avx2,fma") inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename W, int M, int NT>
COMPRESS_TARGET("avx2,fma")
inline void tile_avx2(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n) {
  const int64_t K8 = K / 8 * 8;
  __m256 acc[M][NT];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load8(w + (n + j) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_fmadd_ps(wv[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NT; ++j) {
      const W* wr = w + (n + j) * K;
      float s = hsum8(acc[m][j]);
      for (int64_t k = K8; k < K; ++k) s += static_cast<float>(wr[k]) * x[m * K + k];
      y[m * N + n + j] = s;
    }
}

template <typename W, int M>
COMPRESS_TARGET("avx2,fma")
void rows_avx2(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NT = avx2_tile_rows<M>();
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) tile_avx2<W, M, NT>(x, w, y, K, N, n);
  for (; n < n1; ++n) tile_avx2<W, M, 1>(x, w, y, K, N, n);
}

// Without AVX2: one fixed order per row as well.
template <typename W>
void rows_scalar(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += static_cast<float>(w[n * K + k]) * x[m * K + k];
      y[m * N + n] = s;
    }
}

template <typename W>
using RowsFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t);

// The kernel for M rows at the active ISA: AVX-512 takes up to 16 rows in one pass,
// AVX2 up to 8 (its 16 registers); more rows run in passes of that many.
template <typename W, int M>
RowsFn<W> pick(bool avx512) {
  return avx512 ? &rows_avx512<W, M> : &rows_avx2<W, (M > 8 ? 8 : M)>;
}

template <typename W>
RowsFn<W> kernel_for(int64_t rows, bool avx512) {
  switch (rows) {
    case 1: return pick<W, 1>(avx512);
    case 2: return pick<W, 2>(avx512);
    case 3: return pick<W, 3>(avx512);
    case 4: return pick<W, 4>(avx512);
    case 5: return pick<W, 5>(avx512);
    case 6: return pick<W, 6>(avx512);
    case 7: return pick<W, 7>(avx512);
    case 8: return pick<W, 8>(avx512);
    case 9: return &rows_avx512<W, 9>;
    case 10: return &rows_avx512<W, 10>;
    case 11: return &rows_avx512<W, 11>;
    case 12: return &rows_avx512<W, 12>;
    case 13: return &rows_avx512<W, 13>;
    case 14: return &rows_avx512<W, 14>;
    case 15: return &rows_avx512<W, 15>;
    default: return &rows_avx512<W, 16>;
  }
}

template <typename W>
void run(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  const Isa isa = active_isa();
  const bool avx512 = isa >= Isa::Avx512Vnni;
  const int64_t pass = avx512 ? 16 : 8;
  // ~64 KiB of weights per task: enough work per thread, many tasks for the tail
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (K * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (isa == Isa::Scalar) return rows_scalar(x, w, y, M, K, N, n0, n1);
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
      const int64_t rows = std::min(pass, M - m0);
      kernel_for<W>(rows, avx512)(x + m0 * K, w, y + m0 * N, K, N, n0, n1);
    }
  });
}

}  // namespace

bool dense_gemm_small_rows(const at::Tensor& x, const at::Tensor& w) {
  return x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1 && x.size(0) <= kMaxRows &&
         w.size(1) > 0 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
         (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && x.device().is_cpu() &&
         w.device().is_cpu();
}

at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_gemm: x must be [M, K] and weight [N, K], got ",
              x.sizes(), " and ", w.sizes());
  if (!dense_gemm_small_rows(x, w)) return at::mm(x, w.to(x.scalar_type()).t());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wc = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (w.scalar_type() == at::kFloat)
    run<float>(xf.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  else
    run<at::BFloat16>(xf.data_ptr<float>(), wc.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, K, N);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("dense_gemm", &compress_cpu::dense_gemm); }
