// fp32 GEMM results in the activations' dtype (float_to_activation_dtype, kernel_common.h):
// our own conversion loop in place of y.to(dtype). Rounding is ATen's: to nearest even,
// NaN to the canonical quiet NaN (bf16 0x7FC0; fp16 by c10::Half).
#include <immintrin.h>

#include "cpu/kernel_common.h"

namespace compress_cpu {
namespace {

inline uint16_t bf16_bits(float v) { return c10::BFloat16(v).x; }

void to_bf16_scalar(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits(src[i]);
}

// Eight floats to bf16 bits in 32-bit lanes: the fp32 bits rounded to their top half
// (+0x7FFF + the kept lowest bit), NaN lanes 0x7FC0.
COMPRESS_TARGET("avx2") inline __m256i bf16_round8(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// 16 floats per step, packed to 16 bits in order.
COMPRESS_TARGET("avx2") void to_bf16_avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i packed = _mm256_packus_epi32(bf16_round8(src + i), bf16_round8(src + i + 8));  // per 128-bit lane
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  to_bf16_scalar(src + i, dst + i, n - i);
}

}  // namespace

at::Tensor float_to_activation_dtype(const at::Tensor& y, at::ScalarType dtype) {
  if (dtype == at::kFloat) return y;
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous(), "float_to_activation_dtype: needs contiguous fp32");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "compress: activations must be float32, bfloat16 or float16, got ", dtype);
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(dtype));
  const float* src = y.data_ptr<float>();
  const bool bf16 = dtype == at::kBFloat16, avx2 = active_isa() >= Isa::Avx2;
  uint16_t* dst = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>())
                       : reinterpret_cast<uint16_t*>(out.data_ptr<c10::Half>());
  at::parallel_for(0, y.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    if (bf16 && avx2) to_bf16_avx2(src + b, dst + b, e - b);
    else if (bf16) to_bf16_scalar(src + b, dst + b, e - b);
    else
      for (int64_t i = b; i < e; ++i) dst[i] = c10::Half(src[i]).x;
  });
  return out;
}

}  // namespace compress_cpu
