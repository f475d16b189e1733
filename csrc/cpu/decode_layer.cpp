// One Llama-family decoder layer for a decode step (one new token per row) on the paged
// KV cache, in one C++ call: the DecodePlan's body (decode_plan.cpp). What it computes is
// the module path's layer (compress/runtime/models/llama.py) with
// compress::paged_decode_attention for the attention:
//
//   h = rms_norm(x); qkv = W_qkv h; rope(q, k) at each row's position
//   k_pool, v_pool [block_tables[b][pos_b / BS], :, pos_b % BS] = k, v
//   a = W_o paged_attention(q, keys 0..pos_b, window); (h2, x2) = add_rms_norm(a, x)
//   out = x2 + W_down (silu(g) * u), (g, u) = W_gate_up h2
//
// Why: at batch 1 a 345M model's layer is ~11 small kernels and ~80 PyTorch ops
// (views, slices, rope, cache writes) whose dispatch cost as much as the GEMMs. Here
// the GEMMs, norms and attention are the same C++ functions their own ops register
// (cpu/ops.h), called directly; rope, the cache write and SwiGLU are plain loops.
// Elementwise steps round to x's dtype where the PyTorch layer does (rope's two
// products and their sum, silu then the product), so fp32 matches it exactly up to exp.
//
// Each of the four linears (qkv, o, gate_up, down) names its scheme and takes that
// many tensors from `weights`, in order:
//   w4a16_prepared:    qweight (row-tiled), scale (fp32), zeros (uint8): reference.w4a16_prepare_cpu
//                      (float activations, w4a16_gemm_prepared)
//   w4a8_prepared:     the same tensors, int8 activations per block of 32 (w4a8_gemm_prepared)
//   w4a16_lanes:       qweight, scale, zeros in the weight-row-lane layout (reference.w4a8_prepare_lanes)
//                      and the output features as a one-element int64 tensor (float activations,
//                      w4a16_gemm_lanes)
//   w4a8_lanes:        the same tensors, int8 activations (w4a8_gemm_lanes)
//   w8a8_prepared:     qweight (row-tiled, reference.w8a8_tile_cpu), weight_scale
//   w8a8_lanes:        qweight, scale, rowsum in the weight-row-lane layout (reference.w8a8_prepare_lanes)
//                      and the output features as a one-element int64 tensor (w8a8_gemm_lanes)
//   llm_int8_prepared: the same plus outlier_idx, outlier_weight (static set)
//   llm_int8_guarded_prepared: the same four plus the spike guard's threshold (a
//                      one-element float32 tensor)
//   dense:          weight [N, K]
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/kv_int8.h"
#include "cpu/ops.h"

namespace compress_cpu {

int64_t decode_linear_tensors(const std::string& scheme) {
  if (scheme == "w4a16_prepared" || scheme == "w4a8_prepared") return 3;
  if (scheme == "w4a16_lanes" || scheme == "w4a8_lanes" || scheme == "w8a8_lanes") return 4;
  if (scheme == "w8a8_prepared") return 2;
  if (scheme == "llm_int8_prepared") return 4;
  if (scheme == "llm_int8_guarded_prepared") return 5;
  if (scheme == "dense") return 1;
  TORCH_CHECK(false, "DecodePlan: unknown linear scheme '", scheme,
              "'; expected w4a16_prepared, w4a8_prepared, w4a16_lanes, w4a8_lanes, w8a8_prepared, w8a8_lanes, "
              "llm_int8_prepared, llm_int8_guarded_prepared or dense");
}

bool is_lanes(const DecodeLinear& l) {
  return l.scheme == "w4a16_lanes" || l.scheme == "w4a8_lanes" || l.scheme == "w8a8_lanes";
}

// A lanes linear's output features (its fourth tensor: its qweight holds whole 16-row tiles).
int64_t decode_lanes_n(const DecodeLinear& l) { return l.w[3].data_ptr<int64_t>()[0]; }

void check_decode_linear(const DecodeLinear& l, const char* where) {
  if (is_lanes(l)) {
    const at::Tensor& t = l.w[3];
    TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == 1 && t.device().is_cpu(), where, ": a ", l.scheme,
                " linear's fourth tensor must be its output features as one int64 value, got ", t.scalar_type(), " ",
                t.sizes());
    return;
  }
  if (l.scheme != "llm_int8_guarded_prepared") return;
  const at::Tensor& t = l.w[4];
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1 && t.device().is_cpu(), where,
              ": an llm_int8_guarded_prepared linear's fifth tensor must be the spike threshold as one float32 "
              "value on the CPU, got ", t.scalar_type(), " ", t.sizes());
}

at::Tensor run_decode_linear(const DecodeLinear& l, const at::Tensor& x, at::Tensor* out) {
  const bool into = out != nullptr && x.scalar_type() == at::kFloat;
  at::Tensor y;
  if (l.scheme == "w4a16_prepared")
    y = into ? w4a16_gemm_prepared_into(x, l.w[0], l.w[1], l.w[2], l.group_size, *out)
             : w4a16_gemm_prepared(x, l.w[0], l.w[1], l.w[2], l.group_size);
  else if (l.scheme == "w4a8_prepared")
    y = into ? w4a8_gemm_prepared_into(x, l.w[0], l.w[1], l.w[2], l.group_size, *out)
             : w4a8_gemm_prepared(x, l.w[0], l.w[1], l.w[2], l.group_size);
  else if (l.scheme == "w4a16_lanes")
    y = into ? w4a16_gemm_lanes_into(x, l.w[0], l.w[1], l.w[2], l.group_size, decode_lanes_n(l), *out)
             : w4a16_gemm_lanes(x, l.w[0], l.w[1], l.w[2], l.group_size, decode_lanes_n(l));
  else if (l.scheme == "w4a8_lanes")
    y = into ? w4a8_gemm_lanes_into(x, l.w[0], l.w[1], l.w[2], l.group_size, decode_lanes_n(l), *out)
             : w4a8_gemm_lanes(x, l.w[0], l.w[1], l.w[2], l.group_size, decode_lanes_n(l));
  else if (l.scheme == "w8a8_prepared")
    y = into ? w8a8_gemm_prepared_into(x, l.w[0], l.w[1], *out) : w8a8_gemm_prepared(x, l.w[0], l.w[1]);
  else if (l.scheme == "w8a8_lanes")
    y = into ? w8a8_gemm_lanes_into(x, l.w[0], l.w[1], l.w[2], decode_lanes_n(l), *out)
             : w8a8_gemm_lanes(x, l.w[0], l.w[1], l.w[2], decode_lanes_n(l));
  else if (l.scheme == "llm_int8_prepared" || l.scheme == "llm_int8_guarded_prepared") {
    c10::optional<double> threshold;  // check_decode_linear checked the guarded form's threshold tensor
    if (l.scheme == "llm_int8_guarded_prepared") threshold = static_cast<double>(*l.w[4].data_ptr<float>());
    y = into ? w8a8_outlier_gemm_prepared_into(x, l.w[0], l.w[1], l.w[2], l.w[3], threshold, *out)
             : w8a8_outlier_gemm_prepared(x, l.w[0], l.w[1], l.w[2], l.w[3], threshold);
  }
  else y = dense_gemm(x, l.w[0]);
  if (l.bias.has_value()) y.add_(l.bias->to(y.scalar_type()));
  return y;
}

namespace {

// The layer's intermediates, kept per thread and reused while their sizes and dtype
// stay (they change with the batch only): a decode step runs ~24 layers of ~20 small
// tensors each, and an allocation there cost ~1-2 us (cold allocator metadata).
enum ScratchSlot { kH, kQkv, kQ, kAttn, kA, kH2, kGu, kAct, kDown, kSlots };
at::Tensor& layer_scratch(ScratchSlot slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
  thread_local at::Tensor tensors[kSlots];
  at::Tensor& t = tensors[slot];
  if (!t.defined() || t.sizes() != sizes || t.scalar_type() != options.dtype().toScalarType()) t = at::empty(sizes, options);
  return t;
}

// y = x W^T for one of the layer's linears, into the slot's scratch where run_decode_linear
// can write there (int4 / int8 weights, float32 x), else a new tensor.
at::Tensor linear_into_scratch(ScratchSlot slot, const DecodeLinear& l, const at::Tensor& x) {
  const bool f32 = x.scalar_type() == at::kFloat;
  const int64_t n = is_lanes(l) ? decode_lanes_n(l) : l.w[0].size(0);
  return run_decode_linear(l, x, f32 ? &layer_scratch(slot, {x.size(0), n}, x.options()) : nullptr);
}

// Rotates q and k heads of one qkv row block (rotate-half convention, products and sum
// rounded to T as x * cos + rotate_half(x) * sin is), writes q to `q` [B, nq, D] and
// k, v into the pools (element type TC) at each row's position through its block table.
template <typename T, typename TC>
void rope_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q,
                    const at::Tensor& k_pool, const at::Tensor& v_pool, const PagedRows& rows, int64_t nq,
                    int64_t nkv) {
  const int64_t B = qkv.size(0), D = cos.size(1), half = D / 2, heads = nq + 2 * nkv, BS = k_pool.size(2);
  const T* src_base = qkv.data_ptr<T>();
  const T* cos_base = cos.data_ptr<T>();
  const T* sin_base = sin.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  TC* kp = k_pool.data_ptr<TC>();
  TC* vp = v_pool.data_ptr<TC>();
  const int64_t ks0 = k_pool.stride(0), ks1 = k_pool.stride(1), ks2 = k_pool.stride(2);
  const int64_t vs0 = v_pool.stride(0), vs1 = v_pool.stride(1), vs2 = v_pool.stride(2);
  // rows write distinct slots (one position each): a prompt chunk's rows in parallel
  at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {
  thread_local std::vector<float> row;   // an int8 pool's k / v row in fp32, before kv_int8_quantize
  if constexpr (std::is_same_v<TC, int8_t>) row.resize(D);
  for (int64_t b = b0; b < b1; ++b) {
    const T* c = cos_base + b * cos.stride(0);
    const T* s = sin_base + b * sin.stride(0);
    const int64_t pos = rows.positions[b];
    const int64_t blk = rows.tables[b * rows.M + pos / BS], off = pos % BS;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = src_base + b * qkv.stride(0) + h * D;
      if (h >= nq + nkv) {  // v: stored as is (rounded to TC)
        TC* dst = vp + blk * vs0 + (h - nq - nkv) * vs1 + off * vs2;
        if constexpr (std::is_same_v<TC, int8_t>) {
          for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(x[d]);
          kv_int8_quantize(row.data(), D, dst);
        } else {
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<TC>(static_cast<float>(x[d]));
        }
        continue;
      }
      auto rotate = [&](auto* dst) {
        using TD = std::remove_pointer_t<decltype(dst)>;
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
          const T a = static_cast<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
          const T r = static_cast<T>(rot * static_cast<float>(s[d]));
          dst[d] = static_cast<TD>(static_cast<float>(static_cast<T>(static_cast<float>(a) + static_cast<float>(r))));
        }
      };
      if (h < nq) {
        rotate(qp + (b * nq + h) * D);
      } else if constexpr (std::is_same_v<TC, int8_t>) {
        rotate(row.data());
        kv_int8_quantize(row.data(), D, kp + blk * ks0 + (h - nq) * ks1 + off * ks2);
      } else {
        rotate(kp + blk * ks0 + (h - nq) * ks1 + off * ks2);
      }
    }
  }
  });
}

template <typename T>
void rope_and_store_dispatch(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q,
                             const at::Tensor& k_pool, const at::Tensor& v_pool, const PagedRows& rows, int64_t nq,
                             int64_t nkv) {
  switch (k_pool.scalar_type()) {
    case at::kFloat: rope_and_store<T, float>(qkv, cos, sin, q, k_pool, v_pool, rows, nq, nkv); break;
    case at::kBFloat16: rope_and_store<T, c10::BFloat16>(qkv, cos, sin, q, k_pool, v_pool, rows, nq, nkv); break;
    case at::kChar: rope_and_store<T, int8_t>(qkv, cos, sin, q, k_pool, v_pool, rows, nq, nkv); break;
    default: rope_and_store<T, c10::Half>(qkv, cos, sin, q, k_pool, v_pool, rows, nq, nkv); break;
  }
}

// silu(g) * u over n fp32 values on AVX2: silu(g) = g * sigmoid(g), the sigmoid through
// e = exp(-|g|) (1 / (1 + e) for g >= 0, e / (1 + e) below), so exp never overflows.
// Agrees with g / (1 + exp(-g)) to a few fp32 ulps (the vector exp's ~2e-7).
__attribute__((target("avx2,fma"))) void silu_mul_f32_avx2(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));  // exp(-|x|)
    const __m256 num = _mm256_blendv_ps(one, e, x);          // sign bit of x set: e
    const __m256 act = _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// out[b, i] = silu(g[b, i]) * u[b, i] with gu = [g | u] per row; silu rounded to T first.
template <typename T>
void silu_mul(const at::Tensor& gu, at::Tensor& out) {
  const int64_t B = gu.size(0), I = out.size(1);
  const T* src = gu.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (active_isa() >= Isa::Avx2) {
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) silu_mul_f32_avx2(src + b * 2 * I, src + b * 2 * I + I, dst + b * I, I);
      });
      return;
    }
  }
  at::parallel_for(0, B * I, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t b = e / I, i = e % I;
      const float g = static_cast<float>(src[b * 2 * I + i]);
      const T act = static_cast<T>(g / (1.f + std::exp(-g)));
      dst[e] = static_cast<T>(static_cast<float>(act) * static_cast<float>(src[b * 2 * I + I + i]));
    }
  });
}

}  // namespace

// Checks that `schemes` / `group_sizes` / `weights` / `biases` describe four linears and
// returns them, pointing into `weights` (which must outlive the result).
std::vector<DecodeLinear> decode_linears(const std::vector<std::string>& schemes, const std::vector<int64_t>& group_sizes,
                                         const std::vector<at::Tensor>& weights,
                                         const std::vector<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(schemes.size() == 4 && group_sizes.size() == 4 && biases.size() == 4,
              "DecodePlan: schemes, group_sizes and biases need one entry per linear (qkv, o, gate_up, down)");
  std::vector<DecodeLinear> lin(4);
  size_t next = 0;
  for (int i = 0; i < 4; ++i) {
    const int64_t n = decode_linear_tensors(schemes[i]);
    TORCH_CHECK(next + n <= weights.size(), "DecodePlan: weights has ", weights.size(),
                " tensors, fewer than the schemes need");
    lin[i] = DecodeLinear{schemes[i], group_sizes[i], weights.data() + next, biases[i]};
    check_decode_linear(lin[i], "DecodePlan");
    next += n;
  }
  TORCH_CHECK(next == weights.size(), "DecodePlan: weights has ", weights.size(), " tensors, the schemes take ", next);
  return lin;
}

at::Tensor decode_layer_run(const at::Tensor& x_in, const at::Tensor& attn_norm_weight, const at::Tensor& mlp_norm_weight,
                            double eps, const std::vector<DecodeLinear>& lin, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const PagedRows& rows, int64_t window, int64_t n_heads, int64_t n_kv_heads,
                            const c10::optional<at::Tensor>& q_norm_weight,
                            const c10::optional<at::Tensor>& k_norm_weight) {
  // The caller (DecodePlan.decode_tokens) checked the shapes, dtypes, tables and positions.
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), D = cos.size(-1), nq = n_heads, nkv = n_kv_heads;
  const int64_t H = x.size(1);
  at::Tensor& h = layer_scratch(kH, {B, H}, x.options());
  rms_norm_into(x, attn_norm_weight, eps, h);
  const at::Tensor qkv = linear_into_scratch(kQkv, lin[0], h).contiguous();
  TORCH_CHECK(qkv.size(1) == (nq + 2 * nkv) * D, "DecodePlan: qkv linear gives ", qkv.size(1),
              " features, expected (n_heads + 2 n_kv_heads) * head_dim = ", (nq + 2 * nkv) * D);
  if (q_norm_weight.has_value()) {
    // Qwen3: every q and k head through rms_norm (the module path's op on the same values,
    // so the same bits), written back over the qkv rows before rope reads them
    const at::Tensor heads = qkv.view({B, nq + 2 * nkv, D});
    at::Tensor qv = heads.narrow(1, 0, nq), kv = heads.narrow(1, nq, nkv);
    qv.copy_(rms_norm(qv, *q_norm_weight, eps));
    kv.copy_(rms_norm(kv, *k_norm_weight, eps));
  }
  at::Tensor& q = layer_scratch(kQ, {B, nq, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decode_layer_rope", [&] {
    rope_and_store_dispatch<scalar_t>(qkv, cos, sin, q, k_pool, v_pool, rows, nq, nkv);
  });
  at::Tensor& attn = layer_scratch(kAttn, {B, nq, D}, x.options());
  paged_decode_attention_into(q, k_pool, v_pool, rows.tables, rows.M, rows.lens, window, attn);
  const at::Tensor a = linear_into_scratch(kA, lin[1], attn.view({B, nq * D}));
  at::Tensor& h2 = layer_scratch(kH2, {B, H}, x.options());
  at::Tensor out = at::empty({B, H}, x.options());  // x + attention: the residual stream, returned
  add_rms_norm_into(a, x, mlp_norm_weight, eps, h2, out);
  const at::Tensor gu = linear_into_scratch(kGu, lin[2], h2).contiguous();
  TORCH_CHECK(gu.size(1) % 2 == 0, "DecodePlan: gate_up linear gives an odd feature count ", gu.size(1));
  at::Tensor& act = layer_scratch(kAct, {B, gu.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decode_layer_silu",
                                  [&] { silu_mul<scalar_t>(gu, act); });
  const at::Tensor down = linear_into_scratch(kDown, lin[3], act);
  TORCH_CHECK(down.sizes() == out.sizes(), "DecodePlan: down linear gives ", down.sizes(), ", expected ", out.sizes());
  if (x.scalar_type() == at::kFloat && down.is_contiguous()) {  // out += down (an ATen add costs ~5 us here)
    float* o = out.data_ptr<float>();
    const float* d = down.data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) o[i] += d[i];
  } else {
    out.add_(down);
  }
  return out;
}

}  // namespace compress_cpu
