// compress::argmax_rows (CPU): the sampler's greedy pick, the index of each row's largest
// value. torch.argmax over a vocabulary row runs a scalar index-tracking reduction
// (~53 us for 32000 fp32 values on the development machine, against ~5 us for the
// row's max); a decode step takes one per sequence, two when it samples. Here: one
// vector pass for the max (and whether the row holds a NaN), then a vector scan for its
// first occurrence, which is torch.argmax's answer: the first index on ties, the first
// NaN if there is one. float32 rows; other dtypes go to at::argmax.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"

namespace compress_cpu {
namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(x[j])) return j;
  return -1;
}

int64_t argmax_row_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > x[best]) best = j;
  }
  return best;
}

__attribute__((target("avx2"))) int64_t argmax_row_avx2(const float* x, int64_t n) {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx[4] = {lowest, lowest, lowest, lowest};
  __m256 nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32)
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(x + j + 8 * u);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mx[u] = _mm256_max_ps(mx[u], v);
    }
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx[0] = _mm256_max_ps(mx[0], v);
  }
  const __m256 m8 = _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3]));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = j; t < n; ++t) {
    has_nan |= std::isnan(x[t]);
    if (x[t] > m) m = x[t];
  }
  if (has_nan) return first_nan(x, n);
  const __m256 target = _mm256_set1_ps(m);
  for (j = 0; j + 8 <= n; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; j < n; ++j)
    if (x[j] == m) return j;
  return 0;  // unreachable: m is one of the row's values
}

}  // namespace

int64_t argmax_row_f32(const float* x, int64_t n) {
  return active_isa() >= Isa::Avx2 ? argmax_row_avx2(x, n) : argmax_row_scalar(x, n);
}

namespace {

at::Tensor argmax_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) > 0, "argmax_rows: x must have a non-empty last dim, got ",
              x_in.sizes());
  if (x_in.scalar_type() != at::kFloat) return at::argmax(x_in, -1);
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row_f32(xp + r * n, n);
  });
  return out;
}

}  // namespace
}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("argmax_rows", &compress_cpu::argmax_rows); }
