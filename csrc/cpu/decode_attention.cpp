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
#include <type_traits>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"

namespace compress_cpu {
namespace {

// Sizes, strides and typed pointers of one call (q [B, Hq, D]; keys and values: the
// first B rows and S slots of k / v [>= B, Hkv, >= S, D]).
template <typename T, typename TKV>
struct AttnArgs {
  int64_t B, Hq, D, Hkv, S, group;
  float scale;
  const T* q;
  const TKV *k, *v;
  T* out;
  int64_t qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2;

  AttnArgs(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, int64_t slots, at::Tensor& ot)
      : B(qt.size(0)), Hq(qt.size(1)), D(qt.size(2)), Hkv(kt.size(1)), S(slots), group(Hq / Hkv),
        scale(1.f / std::sqrt(static_cast<float>(D))), q(qt.data_ptr<T>()), k(kt.data_ptr<TKV>()),
        v(vt.data_ptr<TKV>()), out(ot.data_ptr<T>()), qs0(qt.stride(0)), qs1(qt.stride(1)), ks0(kt.stride(0)),
        ks1(kt.stride(1)), ks2(kt.stride(2)), vs0(vt.stride(0)), vs1(vt.stride(1)), vs2(vt.stride(2)) {}
};

template <typename T, typename TKV>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t S_, const bool* mask,
            int64_t mask_rows, at::Tensor& out) {
  const AttnArgs<T, TKV> a(q, k, v, S_, out);
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

// fp32 on AVX2 + FMA (D % 8 == 0), per (row, kv head): the q heads that share the kv head
// run back to back, so K and V come from DRAM once per group (the first head streams
// them, the others find them in cache); q . k four keys at a time, p . V with the output
// block in registers.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
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

// A kv head's S rows as fp32 rows of stride `*stride`: an fp32 cache is used in place; a
// float16 one is widened once into `buf` (then every q head of the group reads fp32).
inline const float* rows_f32(const float* p, int64_t stride, int64_t, int64_t, std::vector<float>&,
                             int64_t* out_stride) {
  *out_stride = stride;
  return p;
}
inline const float* rows_f32(const c10::Half* p, int64_t stride, int64_t S, int64_t D, std::vector<float>& buf,
                             int64_t* out_stride) {
  buf.resize(S * D);
  for (int64_t s = 0; s < S; ++s) {
    const c10::Half* row = p + s * stride;
    prefetch_row(row + kAttnPrefetchRows * stride, D);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(buf.data() + s * D + d,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  }
  *out_stride = D;
  return buf.data();
}

// Scores of one or two q heads (TWO) against S key rows: four keys at a time, one
// accumulator per (head, key) over D, reduced together with three hadds (a horizontal
// sum per key cost more than the dot itself). Two heads per pass read each K row once
// for both. `stream`: the rows come from DRAM (first pass of a group): prefetch ahead.
template <bool TWO>
inline void qk_dots(const float* qa, const float* qb, const float* k, int64_t ks, int64_t S, int64_t D, bool stream,
                    float* sa, float* sb) {
  int64_t s = 0;
  for (; s + 4 <= S; s += 4) {
    const float* k0 = k + s * ks;
    if (stream)
      for (int r = 0; r < 4; ++r) prefetch_row(k0 + (kAttnPrefetchRows + r) * ks, D);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k0 + ks + d);
      const __m256 x2 = _mm256_loadu_ps(k0 + 2 * ks + d), x3 = _mm256_loadu_ps(k0 + 3 * ks + d);
      const __m256 qv = _mm256_loadu_ps(qa + d);
      a0 = _mm256_fmadd_ps(qv, x0, a0), a1 = _mm256_fmadd_ps(qv, x1, a1);
      a2 = _mm256_fmadd_ps(qv, x2, a2), a3 = _mm256_fmadd_ps(qv, x3, a3);
      if constexpr (TWO) {
        const __m256 qw = _mm256_loadu_ps(qb + d);
        b0 = _mm256_fmadd_ps(qw, x0, b0), b1 = _mm256_fmadd_ps(qw, x1, b1);
        b2 = _mm256_fmadd_ps(qw, x2, b2), b3 = _mm256_fmadd_ps(qw, x3, b3);
      }
    }
    _mm_storeu_ps(sa + s, hsum4x256_ps(a0, a1, a2, a3));
    if constexpr (TWO) _mm_storeu_ps(sb + s, hsum4x256_ps(b0, b1, b2, b3));
  }
  for (; s < S; ++s) {
    __m256 ca = _mm256_setzero_ps(), cb = ca;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x = _mm256_loadu_ps(k + s * ks + d);
      ca = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), x, ca);
      if constexpr (TWO) cb = _mm256_fmadd_ps(_mm256_loadu_ps(qb + d), x, cb);
    }
    sa[s] = hsum256_ps(ca);
    if constexpr (TWO) sb[s] = hsum256_ps(cb);
  }
}

// out[d0 .. d0 + 8 NV) = sum_s p[s] v[s][d0 ..] for one or two heads (TWO), with the
// NV (x 2) accumulators in registers over all S rows; keys of weight 0 (masked) skipped.
// `prefetch`: floats of each row to prefetch kAttnPrefetchRows ahead (the whole row on
// the first block of a streaming pass, else 0).
template <int NV, bool TWO>
inline void pv_block(const float* pa, const float* pb, const float* v, int64_t vs, int64_t S, int64_t d0,
                     int64_t prefetch, float* oa, float* ob) {
  __m256 acc_a[NV], acc_b[NV];
  for (int j = 0; j < NV; ++j) acc_a[j] = acc_b[j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const float* row = v + s * vs + d0;
    if (prefetch) prefetch_row(v + (s + kAttnPrefetchRows) * vs, prefetch);
    if (pa[s] == 0.f && (!TWO || pb[s] == 0.f)) continue;
    const __m256 wa = _mm256_broadcast_ss(pa + s);
    const __m256 wb = TWO ? _mm256_broadcast_ss(pb + s) : wa;
    for (int j = 0; j < NV; ++j) {
      const __m256 x = _mm256_loadu_ps(row + 8 * j);
      acc_a[j] = _mm256_fmadd_ps(wa, x, acc_a[j]);
      if constexpr (TWO) acc_b[j] = _mm256_fmadd_ps(wb, x, acc_b[j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    _mm256_storeu_ps(oa + d0 + 8 * j, acc_a[j]);
    if constexpr (TWO) _mm256_storeu_ps(ob + d0 + 8 * j, acc_b[j]);
  }
}

template <bool TWO>
inline void pv_rows(const float* pa, const float* pb, const float* v, int64_t vs, int64_t S, int64_t D, bool stream,
                    float* oa, float* ob) {
  // blocks of 8 accumulators: 64 output floats for one head, 32 each for two; a block
  // after the first reads V rows the first one brought into cache
  constexpr int64_t kMax = TWO ? 4 : 8;
  for (int64_t d0 = 0; d0 < D; d0 += 8 * kMax) {
    const int64_t st = stream && d0 == 0 ? D : 0;
    switch (std::min<int64_t>(kMax, (D - d0) / 8)) {
      case 8: pv_block<8, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
      case 7: pv_block<7, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
      case 6: pv_block<6, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
      case 5: pv_block<5, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
      case 4: pv_block<4, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
      case 3: pv_block<3, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
      case 2: pv_block<2, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
      default: pv_block<1, TWO>(pa, pb, v, vs, S, d0, st, oa, ob); break;
    }
  }
}

template <typename TKV>
void attend_f32_avx2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t S_, const bool* mask,
                     int64_t mask_rows, at::Tensor& out) {
  const AttnArgs<float, TKV> a(q, k, v, S_, out);
  const int64_t S = a.S, D = a.D, group = a.group;
  at::parallel_for(0, a.B * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    // Scaled queries and scores: reused by this thread from call to call (a decode step
    // makes one call a layer). The fp16 caches' widened rows (S x D) are not kept.
    thread_local std::vector<float> qf_buf, score_buf;
    std::vector<float> kbuf, vbuf;
    if (qf_buf.size() < static_cast<size_t>(group * D)) qf_buf.resize(group * D);
    if (score_buf.size() < static_cast<size_t>(group * S)) score_buf.resize(group * S);
    float* qf = qf_buf.data();
    float* scores = score_buf.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / a.Hkv, hk = item % a.Hkv;
      const bool* mrow = mask ? mask + (mask_rows == 1 ? 0 : b) * S : nullptr;
      int64_t ks, vs;
      const float* kb = rows_f32(a.k + b * a.ks0 + hk * a.ks1, a.ks2, S, D, kbuf, &ks);
      constexpr bool kInPlace = std::is_same_v<TKV, float>;  // else widened copies, already in cache
      const bool k_stream = kInPlace;
      for (int64_t g = 0; g < group; ++g) {
        const float* qrow = a.q + b * a.qs0 + (hk * group + g) * a.qs1;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = qrow[d] * a.scale;
      }
      for (int64_t g = 0; g < group; g += 2) {  // heads in pairs: each pass reads K once for two
        float* sc = scores + g * S;
        if (g + 1 < group) qk_dots<true>(&qf[g * D], &qf[(g + 1) * D], kb, ks, S, D, k_stream && g == 0, sc, sc + S);
        else qk_dots<false>(&qf[g * D], nullptr, kb, ks, S, D, k_stream && g == 0, sc, nullptr);
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax per head (masked keys get weight 0)
        float* sc = scores + g * S;
        if (mrow)
          for (int64_t s = 0; s < S; ++s)
            if (!mrow[s]) sc[s] = -std::numeric_limits<float>::infinity();
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
      const float* vb = rows_f32(a.v + b * a.vs0 + hk * a.vs1, a.vs2, S, D, vbuf, &vs);
      const bool v_stream = kInPlace;
      float* orow = a.out + b * a.Hq * D + hk * group * D;
      for (int64_t g = 0; g < group; g += 2) {
        const float* p = scores + g * S;
        if (g + 1 < group) pv_rows<true>(p, p + S, vb, vs, S, D, v_stream && g == 0, orow + g * D, orow + (g + 1) * D);
        else pv_rows<false>(p, nullptr, vb, vs, S, D, v_stream && g == 0, orow + g * D, nullptr);
      }
    }
  });
}
#pragma GCC pop_options

}  // namespace

namespace {

// The op's body on the first B = q.size(0) rows and S slots of k / v [>= B, Hkv, >= S, D].
void attention_run(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t S,
                   const c10::optional<at::Tensor>& mask, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, op, ": q must be [B, Hq, D] and k, v ",
              "[B, Hkv, S, D]; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(k.size(0) >= q.size(0) && k.size(2) >= S && S > 0 && k.size(3) == q.size(2) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              op, ": q ", q.sizes(), " does not fit k ", k.sizes(), " (batch, head_dim, or Hq % Hkv)");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == q.scalar_type() || k.scalar_type() == at::kHalf),
              op, ": k and v must both have q's dtype or both float16; got q ", q.scalar_type(), ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  const bool half_kv = k.scalar_type() == at::kHalf && q.scalar_type() != at::kHalf;
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, op, ": k and v need a contiguous last dim");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2),
              op, ": out must be contiguous ", q.scalar_type(), " [", q.size(0), ", ", q.size(1) * q.size(2), "]");
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->scalar_type() == at::kBool && mask->is_contiguous() ? *mask : mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && (m.size(0) == 1 || m.size(0) == q.size(0)) && m.size(1) == S, op,
                ": mask must be [B or 1, S] = [", q.size(0), ", ", S, "], got ", m.sizes());
  }
  const bool* mask_ptr = mask.has_value() ? m.data_ptr<bool>() : nullptr;
  const int64_t mask_rows = mask.has_value() ? m.size(0) : 0;
  if (q.scalar_type() == at::kFloat && q.size(2) % 8 == 0 && active_isa() != Isa::Scalar) {
    if (half_kv) attend_f32_avx2<c10::Half>(qc, k, v, S, mask_ptr, mask_rows, out);
    else attend_f32_avx2<float>(qc, k, v, S, mask_ptr, mask_rows, out);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    if (half_kv) attend<scalar_t, c10::Half>(qc, k, v, S, mask_ptr, mask_rows, out);
    else attend<scalar_t, scalar_t>(qc, k, v, S, mask_ptr, mask_rows, out);
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.size(0) == q.size(0),
              "decode_attention: q must be [B, Hq, D] and k, v [B, Hkv, S, D]; got q ", q.sizes(), ", k ", k.sizes(),
              ", v ", v.sizes());
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  attention_run("decode_attention", q, k, v, k.size(2), mask, out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("decode_attention", &compress_cpu::decode_attention); }
