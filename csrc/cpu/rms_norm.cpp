// RMSNorm for the runtime's hot path (CPU): compress::rms_norm and the fused
// residual form compress::add_rms_norm. A decode step normalises one row of a few
// thousand values, where ATen's composite pow/mean/rsqrt/mul chain costs tens of
// microseconds in dispatch; this is one pass per row. Reference:
// compress/ops/reference.py::rms_norm / add_rms_norm (the rounding order matches:
// normalise in fp32, round to x's dtype, then multiply by the weight).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <type_traits>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"

namespace compress_cpu {
namespace {

// One fp32 row on AVX2: the same operations as the generic loop (h = x + res, then
// w * (h * r)), with the sum of squares in 32 lanes instead of one running sum.
__attribute__((target("avx2,fma"))) void norm_row_f32_avx2(const float* x, const float* res, const float* w,
                                                            float* y, float* sum_out, int64_t k, float eps) {
  __m256 ss[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t j = 0;
  for (; j + 32 <= k; j += 32)
    for (int u = 0; u < 4; ++u) {
      __m256 h = _mm256_loadu_ps(x + j + 8 * u);
      if (res) {
        h = _mm256_add_ps(h, _mm256_loadu_ps(res + j + 8 * u));
        _mm256_storeu_ps(sum_out + j + 8 * u, h);
      }
      ss[u] = _mm256_fmadd_ps(h, h, ss[u]);
    }
  float total = hsum256_ps(_mm256_add_ps(_mm256_add_ps(ss[0], ss[1]), _mm256_add_ps(ss[2], ss[3])));
  for (; j < k; ++j) {
    const float h = res ? x[j] + res[j] : x[j];
    if (res) sum_out[j] = h;
    total += h * h;
  }
  const float* h = res ? sum_out : x;
  const float r = 1.f / std::sqrt(total / static_cast<float>(k) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  j = 0;
  for (; j + 8 <= k; j += 8)
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(h + j), rv)));
  for (; j < k; ++j) y[j] = w[j] * (h[j] * r);
}

template <typename T>
void norm_rows(const T* x, const T* res, const T* w, T* y, T* sum_out, int64_t m, int64_t k, float eps) {
  if constexpr (std::is_same_v<T, float>) {
    if (active_isa() >= Isa::Avx2) {
      at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          norm_row_f32_avx2(x + i * k, res ? res + i * k : nullptr, w, y + i * k, sum_out ? sum_out + i * k : nullptr,
                            k, eps);
      });
      return;
    }
  }
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = x + i * k;
      T* yr = y + i * k;
      T* sr = sum_out ? sum_out + i * k : nullptr;
      float ss = 0.f;
      if (res) {  // h = x + residual, rounded to T (what the unfused add would store)
        const T* rr = res + i * k;
        for (int64_t j = 0; j < k; ++j) {
          const T h = static_cast<T>(static_cast<float>(xr[j]) + static_cast<float>(rr[j]));
          sr[j] = h;
          const float hf = static_cast<float>(h);
          ss += hf * hf;
        }
        xr = sr;
      } else {
        for (int64_t j = 0; j < k; ++j) {
          const float v = static_cast<float>(xr[j]);
          ss += v * v;
        }
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(k) + eps);
      for (int64_t j = 0; j < k; ++j) {
        const float normed = static_cast<float>(static_cast<T>(static_cast<float>(xr[j]) * r));
        yr[j] = static_cast<T>(static_cast<float>(w[j]) * normed);
      }
    }
  });
}

// `residual`: add_rms_norm's, which must match x.
void check(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor* residual = nullptr) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), op, ": weight ", w.sizes(),
              " must match the last dim of x ", x.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight dtype ", w.scalar_type(), " must equal x dtype ",
              x.scalar_type());
  TORCH_CHECK(residual == nullptr || (residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type()),
              op, ": residual ", residual ? residual->sizes() : x.sizes(), " ",
              residual ? residual->scalar_type() : x.scalar_type(), " must match x ", x.sizes(), " ", x.scalar_type());
}

// `y_out` / `sum_out`: where to write (x's sizes and dtype, contiguous), else new tensors.
std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x_in, const at::Tensor* res_in, const at::Tensor& w_in,
                                       double eps, at::Tensor* y_out = nullptr, at::Tensor* sum_out = nullptr) {
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const at::Tensor res = res_in ? res_in->contiguous() : at::Tensor();
  const int64_t k = x.size(-1), m = k ? x.numel() / k : 0;
  for (const at::Tensor* o : {y_out, sum_out})
    TORCH_CHECK(o == nullptr || (o->sizes() == x.sizes() && o->scalar_type() == x.scalar_type() && o->is_contiguous()),
                "rms_norm: an output must be contiguous with x's sizes ", x.sizes(), " and dtype ", x.scalar_type(),
                ", got ", o->sizes(), " ", o->scalar_type());
  at::Tensor y = y_out ? *y_out : at::empty_like(x);
  at::Tensor sum = res_in ? (sum_out ? *sum_out : at::empty_like(x)) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), res_in ? res.data_ptr<scalar_t>() : nullptr, w.data_ptr<scalar_t>(),
                        y.data_ptr<scalar_t>(), res_in ? sum.data_ptr<scalar_t>() : nullptr, m, k,
                        static_cast<float>(eps));
  });
  return {y, sum};
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check("rms_norm", x, weight);
  return std::get<0>(run(x, nullptr, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check("add_rms_norm", x, weight, &residual);
  return run(x, &residual, weight, eps);
}

void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y) {
  check("rms_norm", x, weight);
  run(x, nullptr, weight, eps, &y);
}

void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& y, at::Tensor& sum) {
  check("add_rms_norm", x, weight, &residual);
  run(x, &residual, weight, eps, &y, &sum);
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("rms_norm", &compress_cpu::rms_norm);
  m.impl("add_rms_norm", &compress_cpu::add_rms_norm);
}
