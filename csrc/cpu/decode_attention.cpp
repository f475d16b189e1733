// One-query-per-row attention over a KV cache (CPU): compress::decode_attention, the
// attention of a decode step. q [B, Hq, D]; k, v [B, Hkv, S, D] (any strides except a
// contiguous last dim, so the cache's slices are used in place); mask [B|1, S] bool
// (true = may attend) or none; grouped-query heads (head h reads kv head h / (Hq/Hkv)).
// Out [B, Hq * D] in q's dtype, ready for o_proj. fp32 scores and softmax, one pass per
// (row, head). Reference: compress/ops/reference.py::decode_attention (= SDPA with
// enable_gqa at one query).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"

namespace compress_cpu {
namespace {

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, int64_t mask_rows,
            at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), S = k.size(2);
  const int64_t group = Hq / Hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S), qf(D), acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hq, h = item % Hq, hk = h / group;
      const T* qrow = qp + b * qs0 + h * qs1;
      for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qrow[d]) * scale;
      const bool* mrow = mask ? mask + (mask_rows == 1 ? 0 : b) * S : nullptr;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        if (mrow && !mrow[s]) {
          scores[s] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const T* krow = kp + b * ks0 + hk * ks1 + s * ks2;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qf[d] * static_cast<float>(krow[d]);
        scores[s] = dot;
        mx = std::max(mx, dot);
      }
      float denom = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const float e = (mrow && !mrow[s]) ? 0.f : std::exp(scores[s] - mx);
        scores[s] = e;
        denom += e;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const float p = scores[s];
        if (p == 0.f) continue;
        const T* vrow = vp + b * vs0 + hk * vs1 + s * vs2;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(vrow[d]);
      }
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      T* orow = op + b * Hq * D + h * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[d] * inv);
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "decode_attention: q must be [B, Hq, D] and k, v ",
              "[B, Hkv, S, D]; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "decode_attention: k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "decode_attention: q ", q.sizes(), " does not fit k ", k.sizes(), " (batch, head_dim, or Hq % Hkv)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention: q, k and v must share a dtype");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v need a contiguous last dim");
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && (m.size(0) == 1 || m.size(0) == q.size(0)) && m.size(1) == k.size(2),
                "decode_attention: mask must be [B or 1, S] = [", q.size(0), ", ", k.size(2), "], got ", m.sizes());
  }
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    attend<scalar_t>(qc, k, v, mask.has_value() ? m.data_ptr<bool>() : nullptr, mask.has_value() ? m.size(0) : 0,
                     out);
  });
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("decode_attention", &compress_cpu::decode_attention); }
