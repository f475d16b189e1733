// The int8 K / V cache row (kv_cache_dtype int8): one position's head_dim values as int8,
// then that row's fp32 scale in the next 4 bytes, so a pool is int8 [NB, Hkv, BS, D + 4]
// and a row's scale comes with its values (no second pool, no second block table).
//
//   scale = max |x| / 127 (fp32 division), q = round_half_even(x / scale) in -127..127
//   (0 where scale is 0); a value reads back as float(q) * scale (one fp32 product).
//
// Every position is quantized alone, so what a position holds does not depend on what
// was batched or chunked with it: prefix-cache hits read what a miss would write.
// compress/runtime/kv_quant.py computes the same bits in torch (tests compare them).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace compress_cpu {

constexpr int64_t kKvInt8ScaleBytes = 4;

// elements of one pool row of element type TKV for head_dim D
template <typename TKV>
constexpr int64_t kv_row_elems(int64_t D) {
  return std::is_same_v<TKV, int8_t> ? D + kKvInt8ScaleBytes : D;
}

inline float kv_int8_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

// The row's scale for int8, 1 otherwise (unused: float rows are read as they are).
template <typename TKV>
inline float kv_row_scale(const TKV* row, int64_t D) {
  if constexpr (std::is_same_v<TKV, int8_t>) return kv_int8_scale(row, D);
  else return 1.f;
}

// Element d of a row as fp32: float(q) * scale for int8 (scale from kv_row_scale).
template <typename TKV>
inline float kv_elem(const TKV* row, int64_t d, float scale) {
  if constexpr (std::is_same_v<TKV, int8_t>) return static_cast<float>(row[d]) * scale;
  else return static_cast<float>(row[d]);
}

// x[0 .. D) into one int8 row (D values, then the scale).
inline void kv_int8_quantize(const float* x, int64_t D, int8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.f;
  for (int64_t d = 0; d < D; ++d) {
    const float r = scale > 0.f ? std::nearbyint(x[d] / scale) : 0.f;
    row[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  std::memcpy(row + D, &scale, sizeof(scale));
}

}  // namespace compress_cpu
