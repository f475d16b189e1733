// Host launchers of the compress CUDA kernels. Plain C++ + CUDA runtime types,
// no torch: the torch bindings (bindings/ops.cpp) allocate and call these.
// All pointers are device pointers, all matrices row-major and contiguous.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace cpk {

// kI8: paged attention's int8 K / V pools only (rows of head_dim values + an fp32 scale)
enum class DType : int { kF16 = 0, kBF16 = 1, kF32 = 2, kI8 = 3 };

// ---- W4A16 -----------------------------------------------------------------
// Canonical int4 -> shuffled fragment order (see int4_layout.cuh);
// out int32 [Np/16 * Kp * 2].
cudaError_t launch_w4a16_shuffle(const int32_t* qweight, int n, int k, int32_t* out, cudaStream_t stream);

// Canonical int4 -> dense weight [n, k] in `dtype` (any group size); the
// fallback for shapes / dtypes the tensor-core kernel does not take.
cudaError_t launch_w4a16_dequant(DType dtype, const int32_t* qweight, const void* scales, const uint8_t* zeros,
                                 int n, int k, int group_size, void* out, cudaStream_t stream);

struct W4A16Args {
  const void* x;          // [m, k] f16/bf16
  const int32_t* qshuf;   // shuffled weights, padded [np, kp]
  const void* scales_t;   // [ceil(kp/g), np] same dtype as x
  const uint8_t* zeros_t; // [ceil(kp/g), np]
  void* y;                // [m, n] same dtype as x
  float* workspace;       // [splits, m, n] fp32 when splits > 1
  int m, n, k, np, kp, group_size, splits;
};
// splits for this problem on a GPU with `sms` SMs (host helper).
int w4a16_splits(int m, int np, int kp, int sms);
// group_size must be a multiple of 16; dtype kF16 or kBF16.
cudaError_t launch_w4a16_gemm(DType dtype, const W4A16Args& args, cudaStream_t stream);

// ---- int8 ------------------------------------------------------------------
// Per-token symmetric int8 quantization of x [m, k] (f16/bf16/f32). Columns
// listed in outlier_idx [c] (may be null with c = 0; -k <= j < 0 names column
// k + j, as in the reference) are left out of the row max, written as 0 in q,
// and gathered into x_outliers [m, c] (x's dtype); an index out of range marks
// nothing and gathers 0 (the bindings never pass one: see op_checks.h).
// q has row stride ldq >= k; columns k..ldq-1 are written as 0.
cudaError_t launch_quantize_rows(DType dtype, const void* x, int m, int k, int ldq, const int64_t* outlier_idx,
                                 int c, int8_t* q, float* scale, void* x_outliers, cudaStream_t stream);

// kq <= round_up(kMaxInt8DotK, 16): the int32 sums must not overflow.
struct W8A8Args {
  const int8_t* xq;        // [m, kq] (kq % 16 == 0, zero padded)
  const float* x_scale;    // [m]
  const int8_t* wq;        // [n, kq]
  const float* w_scale;    // [n]
  const void* x_outliers;  // [m, c] output dtype, or null
  const float* w_outliers; // [n, c] fp32 (the reference's precision), or null
  void* y;                 // [m, n] output dtype
  int32_t* workspace;      // [m, n] int32, zeroed, when splits > 1
  int m, n, kq, c, splits;
};
int w8a8_splits(int m, int n, int kq, int sms);
cudaError_t launch_w8a8_gemm(DType out_dtype, const W8A8Args& args, cudaStream_t stream);

// ---- paged decode attention (paged_attention.cu) -----------------------------
struct PagedAttnArgs {
  const void* q;                 // [rows, n_heads, head_dim], contiguous
  const void* k_pool;            // [num_blocks, n_kv_heads, block_size, head_dim (+ 4 for int8)], last dim contiguous
  const void* v_pool;            // the same sizes and dtype as k_pool
  long long k_stride[3];         // k_pool's strides of block, head, slot (elements)
  long long v_stride[3];
  const int32_t* block_tables;   // [rows, table_cols]
  const int32_t* context_lens;   // [rows]
  void* out;                     // [rows, n_heads, head_dim], q's dtype
  int rows, n_heads, n_kv_heads, head_dim, num_blocks, block_size, table_cols, window;
  float scale;                   // 1 / sqrt(head_dim)
  int splits;                    // set by plan_paged_decode_attention: the split kernel's splits a row, 0: the heads kernel
  float* workspace;              // plan_paged_decode_attention(args) floats (none: nullptr)
};
// The kernel launch_paged_decode_attention runs (paged_attention.cuh): the split kernel (the
// default) or the per-query-head baseline, for the lab's A / B in one process.
enum class PagedKernel : int { kHeads = 0, kSplit = 1 };
void set_paged_attention_kernel(PagedKernel kernel);
PagedKernel paged_attention_kernel();
// Picks the kernel for this call once (the current paged_attention_kernel()), sets
// args.splits, and returns the fp32 scratch its splits' partials need (0: none), from the
// arguments' sizes alone (the lengths live on the GPU). Call before the launch.
long long plan_paged_decode_attention(PagedAttnArgs& args);
// q_dtype: q's and out's (a float type); kv_dtype: the pools' (a float type, or kI8: each
// row head_dim int8 values then its fp32 scale, paged_attention.cuh). head_dim <= 256, n_heads <= 65535,
// table_cols * block_size < 2^31 (op_checks.h). Table entries outside 0..num_blocks-1 and
// context lengths outside 0..table_cols * block_size read no memory outside the pools
// (out of contract: the key is left out; a row with no key gets zeros).
cudaError_t launch_paged_decode_attention(DType q_dtype, DType kv_dtype, const PagedAttnArgs& args,
                                          cudaStream_t stream);

}  // namespace cpk
