// Per-token symmetric int8 activation quantization (CPU), the native
// implementation of compress::quantize_per_token_int8. Reference:
// compress/ops/reference.py::quantize_per_token_int8.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu/kernel_common.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace compress_cpu {

template <typename T>
static void quantize_rows(const T* x, int8_t* q, float* scale, int64_t m, int64_t k) {
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = x + i * k;
      float amax = 0.f;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(static_cast<float>(row[j])));
      const float s = std::max(amax, 1e-10f) / 127.f;
      for (int64_t j = 0; j < k; ++j) {
        // division (not a multiply by 1/s) so that ties round exactly as the reference
        float v = round_half_even(static_cast<float>(row[j]) / s);
        v = std::min(127.f, std::max(-127.f, v));
        q[i * k + j] = static_cast<int8_t>(v);
      }
      scale[i] = s;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token_int8(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "quantize_per_token_int8: x must be 2-D [M, K], got ", x_in.sizes());
  at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_per_token_int8", [&] {
    quantize_rows<scalar_t>(x.data_ptr<scalar_t>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), m, k);
  });
  return {q, scale};
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("quantize_per_token_int8", &compress_cpu::quantize_per_token_int8);
}
