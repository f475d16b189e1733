// Shared pieces of the compress CPU kernels: run-time ISA selection, scale loading,
// and the work-splitting helper. Every kernel file (one op per file) includes this.
//
// ISA-specific code is compiled with `#pragma GCC target(...)` regions inside each
// kernel file (setup.py compiles all files with the same flags, and the extension must
// load on any x86-64), and is only called when active_isa() says the CPU supports it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace compress_cpu {

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512Vnni = 2 };

// What cpuid (and the OS's XSAVE state) says this CPU can run.
Isa detected_isa();
// The ISA kernels use now: min(detected, override). The override starts from the
// environment variable COMPRESS_CPU_ISA (auto|avx512_vnni|avx2|scalar).
Isa active_isa();
// Sets the override; returns false for an unknown name. "auto" clears it.
bool set_isa_override(const char* name);
const char* isa_name(Isa isa);

// Scales / per-channel weight scales may be fp32, fp16 or bf16; they are read one
// value per group (never per weight), so a switch per load is cheap.
enum class ScaleType : int { F32 = 0, F16 = 1, BF16 = 2 };

inline ScaleType scale_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScaleType::F32;
    case at::kHalf: return ScaleType::F16;
    case at::kBFloat16: return ScaleType::BF16;
    default: TORCH_CHECK(false, "compress: scales must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline float load_scale(const void* p, ScaleType t, int64_t i) {
  switch (t) {
    case ScaleType::F32: return static_cast<const float*>(p)[i];
    case ScaleType::F16: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    default: return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sum of the 8 floats of an AVX register; call only from code compiled for AVX2.
__attribute__((target("avx2"))) inline float hsum256_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The four sums of the 8 floats of c0..c3, as one 4-float vector (three hadds instead of
// four horizontal sums; AVX2 code only).
__attribute__((target("avx2"))) inline __m128 hsum4x256_ps(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Sum of the 8 int32 lanes of an AVX register (AVX2 code only).
__attribute__((target("avx2"))) inline int32_t hsum256_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 4 x 8 int32 (each within int8 range) -> 32 int8 in order (signed saturating packs,
// then undoing their per-128-bit-lane interleave). AVX2 code only.
__attribute__((target("avx2"))) inline __m256i pack_32_epi8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// max |v[j]| over n floats (AVX2 code only).
__attribute__((target("avx2"))) inline float absmax_avx2(const float* v, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  for (; j < n; ++j) amax = std::max(amax, std::fabs(v[j]));
  return amax;
}

// e^x for x <= 0 (a softmax after subtracting the max; a sigmoid through e^-|x|):
// Cody-Waite range reduction by ln 2, a degree-6 polynomial on [-ln2/2, ln2/2] (relative
// error ~2e-7), 2^n through the exponent bits; x below -87.3 (and -inf) gives 0.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.33654f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}

// Round half to even (= std::nearbyint / torch.round in the default FP mode) for
// |v| < 2^22, without the libm call that made activation quantization ~6 ns/element on
// a generic x86-64 build; loops using it vectorize. No -ffast-math here, so the
// compiler keeps the add/sub pair.
inline float round_half_even(float v) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// Copies a float / bf16 / fp16 activation row into fp32.
inline void row_to_float(const at::Tensor& x, int64_t m, float* dst) {
  const int64_t k = x.size(1);
  switch (x.scalar_type()) {
    case at::kFloat: std::copy_n(x.data_ptr<float>() + m * k, k, dst); break;
    case at::kBFloat16: {
      const c10::BFloat16* src = x.data_ptr<c10::BFloat16>() + m * k;
      for (int64_t j = 0; j < k; ++j) dst[j] = static_cast<float>(src[j]);
      break;
    }
    case at::kHalf: {
      const c10::Half* src = x.data_ptr<c10::Half>() + m * k;
      for (int64_t j = 0; j < k; ++j) dst[j] = static_cast<float>(src[j]);
      break;
    }
    default: TORCH_CHECK(false, "compress: activations must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

// Splits an [M, N] output into (m-block, n-block) work items for at::parallel_for
// with the m-block index fastest, so one thread keeps one weight n-block hot in its
// cache while it walks the M rows. `fn(m0, m1, n0, n1)`.
template <typename F>
inline void parallel_tiles(int64_t M, int64_t N, int64_t mb, int64_t nb, const F& fn) {
  const int64_t m_blocks = ceil_div(M, mb), n_blocks = ceil_div(N, nb);
  at::parallel_for(0, m_blocks * n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mi = item % m_blocks, ni = item / m_blocks;
      fn(mi * mb, std::min(M, (mi + 1) * mb), ni * nb, std::min(N, (ni + 1) * nb));
    }
  });
}

}  // namespace compress_cpu
