// One-query-per-row attention over a KV cache (CPU): compress::decode_attention, the
// attention of a decode step. q [B, Hq, D]; k, v [B, Hkv, S, D] (any strides except a
// contiguous last dim, so the cache's slices are used in place); mask [B|1, S] bool
// (true = may attend) or none; grouped-query heads (head h reads kv head h / (Hq/Hkv)).
// Out [B, Hq * D] in q's dtype, ready for o_proj. fp32 scores and softmax, one pass per
// (row, head). k and v have q's dtype, or float16 (a half-size KV cache; values are
// widened to fp32 as they are read). Reference: compress/ops/reference.py::decode_attention
// (= SDPA with enable_gqa at one query).
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

// Sizes, strides and typed pointers of one call (q [B, Hq, D], k / v [B, Hkv, S, D]).
template <typename T, typename TKV>
struct AttnArgs {
  int64_t B, Hq, D, Hkv, S, group;
  float scale;
  const T* q;
  const TKV *k, *v;
  T* out;
  int64_t qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2;

  AttnArgs(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, at::Tensor& ot)
      : B(qt.size(0)), Hq(qt.size(1)), D(qt.size(2)), Hkv(kt.size(1)), S(kt.size(2)), group(Hq / Hkv),
        scale(1.f / std::sqrt(static_cast<float>(D))), q(qt.data_ptr<T>()), k(kt.data_ptr<TKV>()),
        v(vt.data_ptr<TKV>()), out(ot.data_ptr<T>()), qs0(qt.stride(0)), qs1(qt.stride(1)), ks0(kt.stride(0)),
        ks1(kt.stride(1)), ks2(kt.stride(2)), vs0(vt.stride(0)), vs1(vt.stride(1)), vs2(vt.stride(2)) {}
};

template <typename T, typename TKV>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, int64_t mask_rows,
            at::Tensor& out) {
  const AttnArgs<T, TKV> a(q, k, v, out);
  const int64_t S = a.S, D = a.D;
  at::parallel_for(0, a.B * a.Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S), qf(D), acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / a.Hq, h = item % a.Hq, hk = h / a.group;
      const T* qrow = a.q + b * a.qs0 + h * a.qs1;
      for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qrow[d]) * a.scale;
      const bool* mrow = mask ? mask + (mask_rows == 1 ? 0 : b) * S : nullptr;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        if (mrow && !mrow[s]) {
          scores[s] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const TKV* krow = a.k + b * a.ks0 + hk * a.ks1 + s * a.ks2;
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
        const TKV* vrow = a.v + b * a.vs0 + hk * a.vs1 + s * a.vs2;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(vrow[d]);
      }
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      T* orow = a.out + b * a.Hq * D + h * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[d] * inv);
    }
  });
}

// fp32 on AVX2 + FMA: the q heads that share a kv head are done together (each K / V row
// is read once per group, not once per head) with 8-wide FMAs over D (D % 8 == 0).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// A K / V row as fp32: an fp32 cache row is used in place; a float16 one is widened once
// into `buf` (D % 8 == 0), so the q heads of the group read it without converting again.
inline const float* widen_row(const float* p, int64_t, float*) { return p; }
inline const float* widen_row(const c10::Half* p, int64_t D, float* buf) {
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d))));
  return buf;
}

// K and V rows of one kv head are short strided streams (D values each, a cache row of
// max_len * D per head): fetch the row kAttnPrefetchRows ahead, one prefetch per line.
// Prefetching past the slice is harmless (the cache tensor goes on, and prefetches never fault).
// 8 rows (2 KiB at D = 64) ahead measured 2-16% faster than none over 96-1024 keys
// (24 layers, same process, alternating); 2 and 4 rows were in between.
constexpr int64_t kAttnPrefetchRows = 8;
template <typename TKV>
inline void prefetch_row(const TKV* p, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / static_cast<int64_t>(sizeof(TKV)))
    _mm_prefetch(reinterpret_cast<const char*>(p + d), _MM_HINT_T0);
}

template <typename TKV>
void attend_f32_avx2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                     int64_t mask_rows, at::Tensor& out) {
  const AttnArgs<float, TKV> a(q, k, v, out);
  const int64_t S = a.S, D = a.D, group = a.group;
  at::parallel_for(0, a.B * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), scores(group * S), acc(group * D), row(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / a.Hkv, hk = item % a.Hkv;
      for (int64_t g = 0; g < group; ++g) {
        const float* qrow = a.q + b * a.qs0 + (hk * group + g) * a.qs1;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = qrow[d] * a.scale;
      }
      const bool* mrow = mask ? mask + (mask_rows == 1 ? 0 : b) * S : nullptr;
      const TKV* kbase = a.k + b * a.ks0 + hk * a.ks1;
      for (int64_t s = 0; s < S; ++s) {
        if (mrow && !mrow[s]) {
          for (int64_t g = 0; g < group; ++g) scores[g * S + s] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const TKV* ksrc = kbase + s * a.ks2;
        prefetch_row(ksrc + kAttnPrefetchRows * a.ks2, D);
        const float* krow = widen_row(ksrc, D, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * D;
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
          int64_t d = 0;
          for (; d + 16 <= D; d += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(krow + d), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(krow + d + 8), a1);
          }
          if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(krow + d), a0);
          scores[g * S + s] = hsum256_ps(_mm256_add_ps(a0, a1));
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax per head (masked keys give exp(-inf) = 0)
        float* sc = scores.data() + g * S;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) mx = std::max(mx, sc[s]);
        if (std::isinf(mx)) {  // every key masked: no weights (out of contract, kept finite)
          std::fill(sc, sc + S, 0.f);
          continue;
        }
        const __m256 mxv = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t s = 0;
        for (; s + 8 <= S; s += 8) {
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + s), mxv));
          _mm256_storeu_ps(sc + s, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        float denom = hsum256_ps(sum8);
        for (; s < S; ++s) {
          sc[s] = std::isinf(sc[s]) ? 0.f : std::exp(sc[s] - mx);
          denom += sc[s];
        }
        const float inv = denom > 0.f ? 1.f / denom : 0.f;
        for (int64_t s = 0; s < S; ++s) sc[s] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const TKV* vbase = a.v + b * a.vs0 + hk * a.vs1;
      for (int64_t s = 0; s < S; ++s) {
        const TKV* vsrc = vbase + s * a.vs2;
        prefetch_row(vsrc + kAttnPrefetchRows * a.vs2, D);
        const float* vrow = widen_row(vsrc, D, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * S + s];
          if (p == 0.f) continue;
          const __m256 pv = _mm256_set1_ps(p);
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(ag + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vrow + d), _mm256_loadu_ps(ag + d)));
        }
      }
      for (int64_t g = 0; g < group; ++g)
        std::copy_n(acc.data() + g * D, D, a.out + b * a.Hq * D + (hk * group + g) * D);
    }
  });
}
#pragma GCC pop_options

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "decode_attention: q must be [B, Hq, D] and k, v ",
              "[B, Hkv, S, D]; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "decode_attention: k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "decode_attention: q ", q.sizes(), " does not fit k ", k.sizes(), " (batch, head_dim, or Hq % Hkv)");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == q.scalar_type() || k.scalar_type() == at::kHalf),
              "decode_attention: k and v must both have q's dtype or both float16; got q ", q.scalar_type(), ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  const bool half_kv = k.scalar_type() == at::kHalf && q.scalar_type() != at::kHalf;
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v need a contiguous last dim");
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && (m.size(0) == 1 || m.size(0) == q.size(0)) && m.size(1) == k.size(2),
                "decode_attention: mask must be [B or 1, S] = [", q.size(0), ", ", k.size(2), "], got ", m.sizes());
  }
  const bool* mask_ptr = mask.has_value() ? m.data_ptr<bool>() : nullptr;
  const int64_t mask_rows = mask.has_value() ? m.size(0) : 0;
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat && q.size(2) % 8 == 0 && active_isa() != Isa::Scalar) {
    if (half_kv) attend_f32_avx2<c10::Half>(qc, k, v, mask_ptr, mask_rows, out);
    else attend_f32_avx2<float>(qc, k, v, mask_ptr, mask_rows, out);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    if (half_kv) attend<scalar_t, c10::Half>(qc, k, v, mask_ptr, mask_rows, out);
    else attend<scalar_t, scalar_t>(qc, k, v, mask_ptr, mask_rows, out);
  });
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("decode_attention", &compress_cpu::decode_attention); }
