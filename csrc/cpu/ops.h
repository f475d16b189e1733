// C++ entry points of the compress CPU ops, for kernels that call other ops directly
// (the DecodePlan runs whole decoder layers without a dispatcher round trip per op).
// Each is the function registered for that op in its own file.
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
// compress::paged_decode_attention (paged_attention.cpp) and its parts: the checks of the
// pools and of the tables / lengths (errors name `op`), and the body on already checked
// arguments (tables int32 [B, M] and lens int32 [B] as raw arrays) writing into out, a
// contiguous tensor of q's sizes and dtype (q contiguous too).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t window);
void check_paged_pools(const char* op, const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t n_kv_heads,
                       int64_t head_dim);
void check_paged_tables(const char* op, const int32_t* tables, int64_t B, int64_t M, const int32_t* lens,
                        int64_t block_size, int64_t num_blocks, int64_t window);
void paged_decode_attention_into(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                 const int32_t* tables, int64_t M, const int32_t* lens, int64_t window,
                                 at::Tensor& out);
// compress::argmax_rows's answer for one float32 row of n > 0 values.
int64_t argmax_row_f32(const float* x, int64_t n);

// compress::dense_gemm: y = x W^T, float32 / bfloat16 W [N, K]; a few rows of x
// (dense_gemm_small_rows) through the weight-streaming kernel, else at::mm.
at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& w);
// w4a16_gemm (float activations) on the same layout (w4a16_lanes.cpp).
at::Tensor w4a16_gemm_lanes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const at::Tensor& zeros, int64_t group_size, int64_t n);
// w4a8_gemm on the weight-row-lane layout (w4a8_lanes.cpp, reference.w4a8_prepare_lanes):
// qweight int32 [tiles, 2K], scale float32 and zeros uint8 [tiles, K / group_size, 16], n outputs.
at::Tensor w4a8_gemm_lanes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const at::Tensor& zeros, int64_t group_size, int64_t n);
// w8a8_gemm on the weight-row-lane layout (w8a8_lanes.cpp, reference.w8a8_prepare_lanes):
// qweight int8 [tiles, ceil(K / 4) * 64], scale float32 and rowsum int32 [tiles, 16], n outputs.
at::Tensor w8a8_gemm_lanes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const at::Tensor& rowsum, int64_t n);
bool dense_gemm_small_rows(const at::Tensor& x, const at::Tensor& w);

// The same ops writing into caller-owned tensors (decode_layer reuses its intermediates
// from call to call instead of allocating ~20 tensors a layer). The GEMMs take float32
// x and a contiguous float32 out [M, N]; the norms outputs of x's sizes and dtype.
at::Tensor& w4a16_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                     const at::Tensor& zeros, int64_t group_size, at::Tensor& out);
at::Tensor& w4a8_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                    const at::Tensor& zeros, int64_t group_size, at::Tensor& out);
at::Tensor& w8a8_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                                    at::Tensor& out);
at::Tensor& w4a16_gemm_lanes_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                  const at::Tensor& zeros, int64_t group_size, int64_t n, at::Tensor& out);
at::Tensor& w4a8_gemm_lanes_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                 const at::Tensor& zeros, int64_t group_size, int64_t n, at::Tensor& out);
at::Tensor& w8a8_gemm_lanes_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                 const at::Tensor& rowsum, int64_t n, at::Tensor& out);
at::Tensor& w8a8_outlier_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight,
                                            const at::Tensor& weight_scale, const at::Tensor& outlier_idx,
                                            const at::Tensor& outlier_weight, c10::optional<double> threshold,
                                            at::Tensor& out);
void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y);
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& y, at::Tensor& sum);

// One of a decoder layer's four linears as the DecodePlan runs it (decode_layer.cpp).
struct DecodeLinear {
  std::string scheme;  // w4a16_prepared, w4a8_prepared, w4a16_lanes, w4a8_lanes, w8a8_prepared, llm_int8_prepared,
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
// Checks and splits a layer's linear arguments (qkv, o, gate_up, down; pointing into `weights`).
std::vector<DecodeLinear> decode_linears(const std::vector<std::string>& schemes, const std::vector<int64_t>& group_sizes,
                                         const std::vector<at::Tensor>& weights,
                                         const std::vector<c10::optional<at::Tensor>>& biases);

// The rows of one decode step on the paged cache: row b's new token is at position
// positions[b], its block table is tables[b * M .. b * M + M), and it attends to
// lens[b] = positions[b] + 1 keys (checked by the caller against every pool it uses).
struct PagedRows {
  int64_t B = 0, M = 0;
  const int64_t* positions = nullptr;
  const int32_t* tables = nullptr;
  const int32_t* lens = nullptr;
};
// One decoder layer for a decode step: x [B, hidden] (the residual stream) -> the
// layer's output. cos / sin [B, head_dim] are the rows' rope rows; the new k / v go
// into this layer's pools k_pool / v_pool [NB, n_kv_heads, BS, head_dim] at each row's
// position, then paged attention over positions 0 .. positions[b] (the last `window`
// of them; 0 = all). `q_norm_weight` / `k_norm_weight` (Qwen3; both or neither,
// [head_dim]): each q and k head goes through rms_norm with them before rope.
at::Tensor decode_layer_run(const at::Tensor& x, const at::Tensor& attn_norm_weight, const at::Tensor& mlp_norm_weight,
                            double eps, const std::vector<DecodeLinear>& lin, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const PagedRows& rows, int64_t window, int64_t n_heads, int64_t n_kv_heads,
                            const c10::optional<at::Tensor>& q_norm_weight = c10::nullopt,
                            const c10::optional<at::Tensor>& k_norm_weight = c10::nullopt);

}  // namespace compress_cpu
