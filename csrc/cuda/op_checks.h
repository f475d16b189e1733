// Argument checks of the CUDA ops, free of torch and of the CUDA runtime, so that
// the host harness (tests/host_harness.cu, driven by tests/csrc/test_cuda_host.py)
// runs the very checks the bindings run. bindings/ops.cpp describes every tensor
// argument with a TensorDesc and raises a non-empty message as the op's error.
//
// What a kernel must never see: a tensor on another device than x (its pointer
// would be read as device memory of x's GPU), a shape that does not match the
// others (out-of-bounds reads), a group size that is not positive (host division
// by zero), a K whose int8 sums overflow int32, a size past what the kernels'
// int indices and grid dimensions hold.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "cpk_common.cuh"
#include "int4_layout.cuh"
#include "paged_attention.cuh"

namespace cpk {

enum class Kind : int { kF16 = 0, kBF16 = 1, kF32 = 2, kU8 = 3, kI8 = 4, kI16 = 5, kI32 = 6, kI64 = 7, kOther = 8 };
enum class Dev : int { kCPU = 0, kCUDA = 1, kOther = 2 };

struct TensorDesc {
  const char* name;  // the op's argument name
  Dev device;
  int index;         // device index (-1: none)
  Kind kind;
  int dim;
  int64_t size0, size1;  // sizes of dims 0 and 1 (0 where the tensor has fewer dims)
  int64_t numel;
  int64_t size2, size3;  // sizes of dims 2 and 3 (0 where the tensor has fewer dims)
};

// Rows, columns and K below this fit the kernels' int indices with room for padding.
constexpr int64_t kMaxOpDim = int64_t{1} << 30;
// N: the GEMM grids have one block column per 128 output columns, at most 65535.
constexpr int64_t kMaxOpN = int64_t{65535} * 128;

inline const char* kind_name(Kind k) {
  static const char* const names[] = {"float16", "bfloat16", "float32", "uint8", "int8",
                                      "int16",   "int32",    "int64",   "another dtype"};
  const int i = static_cast<int>(k);
  return names[i >= 0 && i <= 8 ? i : 8];
}
inline bool is_float_kind(Kind k) { return k == Kind::kF16 || k == Kind::kBF16 || k == Kind::kF32; }
inline bool is_int_kind(Kind k) {
  return k == Kind::kU8 || k == Kind::kI8 || k == Kind::kI16 || k == Kind::kI32 || k == Kind::kI64;
}
inline std::string device_name(const TensorDesc& t) {
  const char* type = t.device == Dev::kCPU ? "cpu" : t.device == Dev::kCUDA ? "cuda" : "another device";
  return t.device == Dev::kCUDA ? std::string(type) + ":" + std::to_string(t.index) : std::string(type);
}
inline std::string shape_name(const TensorDesc& t) {
  if (t.dim == 0) return "[]";
  std::string s = "[" + std::to_string(t.size0);
  if (t.dim >= 2) s += ", " + std::to_string(t.size1);
  if (t.dim >= 3) s += ", " + std::to_string(t.size2);
  if (t.dim >= 4) s += ", " + std::to_string(t.size3);
  if (t.dim > 4) s += ", ...";
  return s + "]";
}
inline std::string shape2(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

// ---- single-tensor checks ("" when valid) ---------------------------------------
inline std::string need_cuda_2d(const TensorDesc& t) {
  if (t.device != Dev::kCUDA) return std::string(t.name) + " must be a CUDA tensor, got one on " + device_name(t);
  if (t.dim != 2) return std::string(t.name) + " must be 2-D, got " + shape_name(t);
  return "";
}
inline std::string need_on_device_of(const TensorDesc& t, const TensorDesc& x) {
  if (t.device == x.device && t.index == x.index) return "";
  return std::string(t.name) + " is on " + device_name(t) + " but " + x.name + " is on " + device_name(x) +
         ": every tensor argument must be on " + x.name + "'s device";
}
inline std::string need_shape(const TensorDesc& t, int64_t s0, int64_t s1, const char* what) {
  if (t.dim == 2 && t.size0 == s0 && t.size1 == s1) return "";
  return std::string(t.name) + " must be " + shape2(s0, s1) + " (" + what + "), got " + shape_name(t);
}
inline std::string need_kind(const TensorDesc& t, bool ok, const char* want) {
  return ok ? "" : std::string(t.name) + " must be " + want + ", got " + kind_name(t.kind);
}
inline std::string need_dims_in_range(int64_t m, int64_t n, int64_t k) {
  if (m >= kMaxOpDim || k >= kMaxOpDim)
    return "M=" + std::to_string(m) + ", K=" + std::to_string(k) + ": rows and K must be below 2^30";
  if (n > kMaxOpN) return "N=" + std::to_string(n) + " is above " + std::to_string(kMaxOpN) + " (65535 column tiles)";
  return "";
}
inline std::string need_group_size(int64_t group_size, int64_t k) {
  if (group_size <= 0) return "group_size must be positive, got " + std::to_string(group_size);
  if (k % group_size != 0)
    return "group_size " + std::to_string(group_size) + " does not divide K=" + std::to_string(k);
  return "";
}

// The first non-empty message of a list of checks.
template <typename... S>
std::string first_error(const S&... msgs) {
  std::string out;
  ((out.empty() && !msgs.empty() ? (void)(out = msgs) : (void)0), ...);
  return out;
}

// ---- the ops --------------------------------------------------------------------
// Canonical group-wise int4: scales [N, K/g] float, zeros [N, K/g] integer (0..15),
// both on `on`'s device.
inline std::string check_int4_groups(const TensorDesc& scales, const TensorDesc& zeros, int64_t n, int64_t k,
                                     int64_t group_size, const TensorDesc& on) {
  if (std::string e = need_group_size(group_size, k); !e.empty()) return e;
  const int64_t g = k / group_size;
  return first_error(need_on_device_of(scales, on), need_on_device_of(zeros, on),
                     need_shape(scales, n, g, "[N, K / group_size]"), need_shape(zeros, n, g, "[N, K / group_size]"),
                     need_kind(scales, is_float_kind(scales.kind), "float16, bfloat16 or float32"),
                     need_kind(zeros, is_int_kind(zeros.kind), "an integer dtype (uint8 or int32)"));
}

inline std::string check_w4a16_shuffle(const TensorDesc& qweight, const TensorDesc& scales, const TensorDesc& zeros,
                                       int64_t group_size) {
  if (std::string e = first_error(need_cuda_2d(qweight), need_kind(qweight, qweight.kind == Kind::kI32, "int32 [N, K/8]"));
      !e.empty())
    return e;
  const int64_t n = qweight.size0, k = qweight.size1 * 8;
  return first_error(need_dims_in_range(0, n, k), check_int4_groups(scales, zeros, n, k, group_size, qweight));
}

inline std::string check_w4a16_gemm_shuffled(const TensorDesc& x, const TensorDesc& qs, const TensorDesc& scales_t,
                                             const TensorDesc& zeros_t, int64_t group_size, int64_t n) {
  if (std::string e = first_error(need_cuda_2d(x), need_kind(x, x.kind == Kind::kF16 || x.kind == Kind::kBF16,
                                                             "float16 or bfloat16 (w4a16_gemm takes float32)"));
      !e.empty())
    return e;
  if (group_size <= 0 || group_size % 16 != 0)
    return "group_size must be a positive multiple of 16 (w4a16_gemm takes any), got " + std::to_string(group_size);
  if (n < 0) return "n must not be negative, got " + std::to_string(n);
  const int64_t m = x.size0, k = x.size1;
  if (std::string e = first_error(need_dims_in_range(m, n, k), need_on_device_of(qs, x),
                                  need_kind(qs, qs.kind == Kind::kI32, "int32"));
      !e.empty())
    return e;
  if (k % 8 != 0) return "x has K=" + std::to_string(k) + ", not a multiple of 8 (int4 packing)";
  const int64_t np = round_up(static_cast<int>(n), kW4TileN), kp = round_up(static_cast<int>(k), kW4TileK);
  if (std::string e = need_shape(qs, np / 16, kp * 2, "[round_up(N, 128) / 16, round_up(K, 64) * 2]"); !e.empty())
    return e + " for K=" + std::to_string(k) + ", N=" + std::to_string(n);
  const int64_t gp = (kp + group_size - 1) / group_size;
  return first_error(need_on_device_of(scales_t, x), need_on_device_of(zeros_t, x),
                     need_shape(scales_t, gp, np, "[ceil(round_up(K, 64) / group_size), round_up(N, 128)]"),
                     need_shape(zeros_t, gp, np, "[ceil(round_up(K, 64) / group_size), round_up(N, 128)]"),
                     need_kind(scales_t, is_float_kind(scales_t.kind), "float16, bfloat16 or float32"),
                     need_kind(zeros_t, zeros_t.kind == Kind::kU8, "uint8"));
}

inline std::string check_w4a16_gemm(const TensorDesc& x, const TensorDesc& qweight, const TensorDesc& scales,
                                    const TensorDesc& zeros, int64_t group_size) {
  if (std::string e = first_error(need_cuda_2d(x), need_kind(x, is_float_kind(x.kind), "float16, bfloat16 or float32"),
                                  need_on_device_of(qweight, x),
                                  qweight.dim == 2 ? "" : std::string("qweight must be 2-D, got ") + shape_name(qweight),
                                  need_kind(qweight, qweight.kind == Kind::kI32, "int32 [N, K/8]"));
      !e.empty())
    return e;
  const int64_t m = x.size0, n = qweight.size0, k = qweight.size1 * 8;
  if (x.size1 != k) return "x has K=" + std::to_string(x.size1) + " but qweight has K=" + std::to_string(k);
  return first_error(need_dims_in_range(m, n, k), check_int4_groups(scales, zeros, n, k, group_size, x));
}

inline std::string check_quantize_rows(const TensorDesc& x) {
  return first_error(need_cuda_2d(x), need_kind(x, is_float_kind(x.kind), "float16, bfloat16 or float32"),
                     x.dim == 2 ? need_dims_in_range(x.size0, 0, x.size1) : "");
}

// W8A8 and LLM.int8(); outlier_idx / outlier_weight null for w8a8_gemm.
inline std::string check_w8a8(const TensorDesc& x, const TensorDesc& qweight, const TensorDesc& weight_scale,
                              const TensorDesc* outlier_idx, const TensorDesc* outlier_weight) {
  if (std::string e = first_error(need_cuda_2d(x), need_kind(x, is_float_kind(x.kind), "float16, bfloat16 or float32"),
                                  need_on_device_of(qweight, x),
                                  qweight.dim == 2 ? "" : std::string("qweight must be 2-D, got ") + shape_name(qweight),
                                  need_kind(qweight, qweight.kind == Kind::kI8, "int8 [N, K]"));
      !e.empty())
    return e;
  const int64_t m = x.size0, k = x.size1, n = qweight.size0;
  if (qweight.size1 != k) return "x has K=" + std::to_string(k) + " but qweight has K=" + std::to_string(qweight.size1);
  if (k > kMaxInt8DotK)
    return "K=" + std::to_string(k) + " is above " + std::to_string(kMaxInt8DotK) +
           ", the most columns whose int8 products sum exactly in int32";
  if (std::string e = first_error(need_dims_in_range(m, n, k), need_on_device_of(weight_scale, x),
                                  need_kind(weight_scale, is_float_kind(weight_scale.kind), "float16, bfloat16 or float32"));
      !e.empty())
    return e;
  if (weight_scale.numel != n)
    return std::string(weight_scale.name) + " must have N=" + std::to_string(n) + " elements, got " +
           std::to_string(weight_scale.numel);
  if (outlier_idx == nullptr) return "";
  const TensorDesc &idx = *outlier_idx, &ow = *outlier_weight;
  if (std::string e = first_error(need_on_device_of(idx, x), need_on_device_of(ow, x),
                                  idx.dim == 1 ? "" : std::string(idx.name) + " must be 1-D [C], got " + shape_name(idx),
                                  need_kind(idx, idx.kind == Kind::kI64 || idx.kind == Kind::kI32, "int64 or int32"));
      !e.empty())
    return e;
  return first_error(need_shape(ow, n, idx.numel, "[N, C]"),
                     need_kind(ow, is_float_kind(ow.kind), "float16, bfloat16 or float32"));
}

// Paged decode attention: q [B, Hq, D] float; k_pool, v_pool [NB, Hkv, BS, D] of one float
// dtype, or int8 [NB, Hkv, BS, D + 4] (each row's values, then its fp32 scale); block_tables int32 [B, M]; context_lens int32 [B]; window >= 0. The values of the
// tables and lengths live on the GPU and are not checked here (the kernel reads nothing
// outside the pools for any of them, paged_attention.cuh).
inline std::string check_paged_decode_attention(const TensorDesc& q, const TensorDesc& k_pool, const TensorDesc& v_pool,
                                                const TensorDesc& block_tables, const TensorDesc& context_lens,
                                                int64_t window) {
  if (q.device != Dev::kCUDA) return std::string(q.name) + " must be a CUDA tensor, got one on " + device_name(q);
  if (std::string e = first_error(
          q.dim == 3 ? "" : std::string(q.name) + " must be 3-D [B, Hq, head_dim], got " + shape_name(q),
          need_kind(q, is_float_kind(q.kind), "float16, bfloat16 or float32"), need_on_device_of(k_pool, q),
          need_on_device_of(v_pool, q), need_on_device_of(block_tables, q), need_on_device_of(context_lens, q));
      !e.empty())
    return e;
  const int64_t b = q.size0, hq = q.size1, d = q.size2;
  for (const TensorDesc* p : {&k_pool, &v_pool}) {
    if (std::string e = need_kind(*p, is_float_kind(p->kind) || p->kind == Kind::kI8,
                                  "float16, bfloat16, float32 or int8 (rows with their scales)");
        !e.empty())
      return e;
    const bool int8_rows = p->kind == Kind::kI8;  // head_dim values, then the fp32 scale's 4 bytes
    const int64_t row = int8_rows ? d + 4 : d;
    if (p->dim != 4 || p->size3 != row || p->size1 < 1 || p->size2 < 1)
      return std::string(p->name) + " must be 4-D [num_blocks, n_kv_heads, block_size, " +
             (int8_rows ? "head_dim + 4 = " : "head_dim = ") + std::to_string(row) + "], got " + shape_name(*p);
  }
  if (v_pool.size0 != k_pool.size0 || v_pool.size1 != k_pool.size1 || v_pool.size2 != k_pool.size2 ||
      v_pool.kind != k_pool.kind)
    return std::string(v_pool.name) + " must have " + k_pool.name + "'s sizes " + shape_name(k_pool) + " and dtype " +
           kind_name(k_pool.kind) + ", got " + shape_name(v_pool) + " " + kind_name(v_pool.kind);
  if (hq % k_pool.size1 != 0)
    return "q has " + std::to_string(hq) + " heads, not a multiple of the pools' " + std::to_string(k_pool.size1) +
           " kv heads (Hq % Hkv)";
  if (d < 1 || d > kPagedMaxHeadDim)
    return "head_dim " + std::to_string(d) + " is outside 1.." + std::to_string(kPagedMaxHeadDim);
  if (hq > kPagedMaxHeads) return "q has " + std::to_string(hq) + " heads, above " + std::to_string(kPagedMaxHeads);
  if (block_tables.dim != 2 || block_tables.size0 != b || block_tables.kind != Kind::kI32)
    return std::string(block_tables.name) + " must be int32 [B = " + std::to_string(b) + ", M], got " +
           kind_name(block_tables.kind) + " " + shape_name(block_tables);
  if (context_lens.dim != 1 || context_lens.size0 != b || context_lens.kind != Kind::kI32)
    return std::string(context_lens.name) + " must be int32 [B = " + std::to_string(b) + "], got " +
           kind_name(context_lens.kind) + " " + shape_name(context_lens);
  if (window < 0) return "window must be >= 0 (0 = full attention), got " + std::to_string(window);
  if (b >= kMaxOpDim || k_pool.size0 >= kMaxOpDim || window >= kMaxOpDim ||
      block_tables.size1 * k_pool.size2 >= kMaxOpDim)
    return "rows, num_blocks, window and M * block_size must be below 2^30, got B=" + std::to_string(b) +
           ", num_blocks=" + std::to_string(k_pool.size0) + ", M * block_size=" +
           std::to_string(block_tables.size1 * k_pool.size2);
  return "";
}

}  // namespace cpk
