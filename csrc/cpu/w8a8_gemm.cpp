// compress::w8a8_gemm on CPU: per-token dynamic int8 activations x per-channel int8
// weights, int32 accumulation, fp32 epilogue. Reference: reference.py::w8a8_gemm.
// compress::w8a8_gemm_prepared: the same on the load-time row-tiled weights
// (reference.w8a8_tile_cpu), what the runtime calls.
// The kernel core (quantization, scalar / AVX2 / AVX-512 VNNI tiles) is w8a8_kernel.h.
#include <torch/library.h>

#include "cpu/ops.h"
#include "cpu/w8a8_kernel.h"

namespace compress_cpu {

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale) {
  return w8::run(x, qweight, weight_scale, nullptr, nullptr, /*tiled=*/false, "w8a8_gemm");
}

at::Tensor w8a8_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale) {
  return w8::run(x, qweight, weight_scale, nullptr, nullptr, /*tiled=*/true, "w8a8_gemm_prepared");
}

at::Tensor& w8a8_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                                    at::Tensor& out) {
  w8::run(x, qweight, weight_scale, nullptr, nullptr, /*tiled=*/true, "w8a8_gemm_prepared_into", &out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w8a8_gemm", &compress_cpu::w8a8_gemm);
  m.impl("w8a8_gemm_prepared", &compress_cpu::w8a8_gemm_prepared);
}
