// compress::w8a8_outlier_gemm on CPU: LLM.int8() decomposition fused into one pass.
// The outlier columns are gathered (and zeroed) while the activations are quantized,
// and each output's fp32 outlier dot product (C values of x against the [N, C]
// unquantized weight columns) is added in the int8 tile's epilogue, so the int8 weight
// matrix is read once. Reference: reference.py::w8a8_outlier_gemm.
// compress::w8a8_outlier_gemm_prepared: the same on the load-time row-tiled int8 weights,
// with the spike guard when given a threshold (reference.w8a8_outlier_gemm_guarded): a
// column outside the calibrated set that reaches it in this call joins the float path
// (w8::run; checked on each row's absmax, which the quantization takes anyway).
#include <torch/library.h>

#include "cpu/ops.h"
#include "cpu/w8a8_kernel.h"

namespace compress_cpu {

at::Tensor w8a8_outlier_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                             const at::Tensor& outlier_idx, const at::Tensor& outlier_weight) {
  return w8::run(x, qweight, weight_scale, &outlier_idx, &outlier_weight, /*tiled=*/false, "w8a8_outlier_gemm");
}

at::Tensor w8a8_outlier_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                                      const at::Tensor& outlier_idx, const at::Tensor& outlier_weight,
                                      c10::optional<double> threshold) {
  return w8::run(x, qweight, weight_scale, &outlier_idx, &outlier_weight, /*tiled=*/true,
                 "w8a8_outlier_gemm_prepared", nullptr, threshold);
}

at::Tensor& w8a8_outlier_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight,
                                            const at::Tensor& weight_scale, const at::Tensor& outlier_idx,
                                            const at::Tensor& outlier_weight, c10::optional<double> threshold,
                                            at::Tensor& out) {
  w8::run(x, qweight, weight_scale, &outlier_idx, &outlier_weight, /*tiled=*/true,
          "w8a8_outlier_gemm_prepared_into", &out, threshold);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w8a8_outlier_gemm", &compress_cpu::w8a8_outlier_gemm);
  m.impl("w8a8_outlier_gemm_prepared", &compress_cpu::w8a8_outlier_gemm_prepared);
}
