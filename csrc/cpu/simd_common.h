// The parts of the CPU kernels that need neither ATen nor the dispatcher: scale loading
// and the small SIMD helpers the kernel files share. kernel_common.h includes this;
// the ISA emulation harness (csrc/cpu/tests/isa_emulation.cpp) includes it alone, with
// <immintrin.h> provided by SIMDe, to run the AVX-512 VNNI tiles on a CPU without them.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Functions that use one ISA above the build's baseline carry COMPRESS_TARGET(isa); the
// emulation harness defines COMPRESS_ISA_EMULATION so that everything it compiles stays
// at the baseline (its intrinsics are SIMDe's portable implementations).
#ifdef COMPRESS_ISA_EMULATION
#define COMPRESS_TARGET(isa)
#else
#define COMPRESS_TARGET(isa) __attribute__((target(isa)))
#endif

namespace compress_cpu {

// Scales / per-channel weight scales may be fp32, fp16 or bf16; they are read one
// value per group (never per weight), so a switch per load is cheap.
enum class ScaleType : int { F32 = 0, F16 = 1, BF16 = 2 };

// IEEE binary16 -> binary32, exact for every input (subnormals, infinities, NaN payloads).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, exact in fp32
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// bfloat16 is the top half of a binary32.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float load_scale(const void* p, ScaleType t, int64_t i) {
  switch (t) {
    case ScaleType::F32: return static_cast<const float*>(p)[i];
    case ScaleType::F16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Eight rows of 8 int32 transposed: out[i] = {r0[i], ..., r7[i]} (the W8A8 int16
// GEMM's panels and outlier panels); call only from code compiled for AVX2.
COMPRESS_TARGET("avx2") inline void transpose8_epi32(__m256i (&r)[8]) {
  __m256i t[8], s[8];
  for (int j = 0; j < 4; ++j) {
    t[2 * j] = _mm256_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm256_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3
    const __m256i* u = t + 4 * h;
    s[4 * h + 0] = _mm256_unpacklo_epi64(u[0], u[2]);
    s[4 * h + 1] = _mm256_unpackhi_epi64(u[0], u[2]);
    s[4 * h + 2] = _mm256_unpacklo_epi64(u[1], u[3]);
    s[4 * h + 3] = _mm256_unpackhi_epi64(u[1], u[3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(s[i], s[4 + i], 0x20);
    r[4 + i] = _mm256_permute2x128_si256(s[i], s[4 + i], 0x31);
  }
}

// Sum of the 8 floats of an AVX register; call only from code compiled for AVX2.
COMPRESS_TARGET("avx2") inline float hsum256_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Maximum of the 8 floats of an AVX register (AVX2 code only).
COMPRESS_TARGET("avx2") inline float hmax256_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The four sums of the 8 floats of c0..c3, as one 4-float vector (three hadds instead of
// four horizontal sums; AVX2 code only).
COMPRESS_TARGET("avx2") inline __m128 hsum4x256_ps(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Sum of the 8 int32 lanes of an AVX register (AVX2 code only).
COMPRESS_TARGET("avx2") inline int32_t hsum256_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 4 x 8 int32 (each within int8 range) -> 32 int8 in order (signed saturating packs,
// then undoing their per-128-bit-lane interleave). AVX2 code only.
COMPRESS_TARGET("avx2") inline __m256i pack_32_epi8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// max |v[j]| over n floats (AVX2 code only).
COMPRESS_TARGET("avx2") inline float absmax_avx2(const float* v, int64_t n) {
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
// error ~2e-7), 2^n through the exponent bits; x below -87.3 (and -inf) gives 0. Its
// 16-lane form (paged_row_attention.inc: exp_nonpositive512) runs the same operations on
// these constants, so the two give the same bits lane for lane.
struct ExpNonpositive {
  static constexpr float kLowest = -87.33654f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  // the polynomial's coefficients, highest degree first (Horner's order)
  static constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

COMPRESS_TARGET("avx2,fma") inline __m256 exp_nonpositive(__m256 x) {
  using E = ExpNonpositive;
  const __m256 lowest = _mm256_set1_ps(E::kLowest);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(E::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::kLn2Lo), r);
  __m256 y = _mm256_set1_ps(E::kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(E::kPoly[i]));
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

}  // namespace compress_cpu
