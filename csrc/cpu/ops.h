// C++ entry points of the compress CPU ops, for kernels that call other ops directly
// (compress::decode_layer runs a whole decoder layer without a dispatcher round trip
// per op). Each is the function registered for that op in its own file.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

namespace compress_cpu {

at::Tensor w4a16_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const at::Tensor& scaled_zero, int64_t group_size);
at::Tensor w8a8_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale);
at::Tensor w4a8_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                              const at::Tensor& zeros, int64_t group_size);
at::Tensor w8a8_outlier_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                                      const at::Tensor& outlier_idx, const at::Tensor& outlier_weight,
                                      c10::optional<double> threshold);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask);
// decode_attention on the first q.size(0) rows and S slots of a cache layer
// k / v [rows, Hkv, slots, D] (no slicing views), into out [B, Hq * D] of q's dtype.
void decode_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t S,
                           const c10::optional<at::Tensor>& mask, at::Tensor& out);
// compress::argmax_rows's answer for one float32 row of n > 0 values.
int64_t argmax_row_f32(const float* x, int64_t n);

// The same ops writing into caller-owned tensors (decode_layer reuses its intermediates
// from call to call instead of allocating ~20 tensors a layer). The GEMMs take float32
// x and a contiguous float32 out [M, N]; the norms outputs of x's sizes and dtype.
at::Tensor& w4a16_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                     const at::Tensor& zeros, int64_t group_size, at::Tensor& out);
at::Tensor& w4a8_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                    const at::Tensor& zeros, int64_t group_size, at::Tensor& out);
at::Tensor& w8a8_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                                    at::Tensor& out);
at::Tensor& w8a8_outlier_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight,
                                            const at::Tensor& weight_scale, const at::Tensor& outlier_idx,
                                            const at::Tensor& outlier_weight, c10::optional<double> threshold,
                                            at::Tensor& out);
void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y);
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& y, at::Tensor& sum);

// One of a decoder layer's four linears as decode_layer runs it (decode_layer.cpp).
struct DecodeLinear {
  std::string scheme;  // w4a16_prepared, w4a8_prepared, w8a8_prepared, llm_int8_prepared,
                       // llm_int8_guarded_prepared or dense
  int64_t group_size = 0;
  const at::Tensor* w = nullptr;  // first of this linear's tensors, in a vector that outlives this
  c10::optional<at::Tensor> bias;
};
// How many tensors a linear of `scheme` takes (an error naming the scheme if unknown).
int64_t decode_linear_tensors(const std::string& scheme);
// Checks what the tensor count does not (the guarded LLM.int8 threshold); errors name `where`.
void check_decode_linear(const DecodeLinear& l, const char* where);
// y = x W^T (+ bias) for one linear, in x's dtype. With `out` (float32 [M, N],
// contiguous) and float32 x, the int4 / int8 schemes write into it and return it.
at::Tensor run_decode_linear(const DecodeLinear& l, const at::Tensor& x, at::Tensor* out = nullptr);
// Checks and splits decode_layer's linear arguments (pointing into `weights`).
std::vector<DecodeLinear> decode_linears(const std::vector<std::string>& schemes, const std::vector<int64_t>& group_sizes,
                                         const std::vector<at::Tensor>& weights,
                                         const std::vector<c10::optional<at::Tensor>>& biases);
// compress::decode_layer's body on already split linears; the caches are written in place.
at::Tensor decode_layer_run(const at::Tensor& x, const at::Tensor& attn_norm_weight, const at::Tensor& mlp_norm_weight,
                            double eps, const std::vector<DecodeLinear>& lin, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t pos,
                            const c10::optional<at::Tensor>& mask, int64_t n_heads, int64_t n_kv_heads);

}  // namespace compress_cpu
