// C++ entry points of the compress CPU ops, for kernels that call other ops directly
// (compress::decode_layer runs a whole decoder layer without a dispatcher round trip
// per op). Each is the function registered for that op in its own file.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace compress_cpu {

at::Tensor w4a16_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const at::Tensor& scaled_zero, int64_t group_size);
at::Tensor w8a8_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale);
at::Tensor w8a8_outlier_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                                      const at::Tensor& outlier_idx, const at::Tensor& outlier_weight);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask);

}  // namespace compress_cpu
