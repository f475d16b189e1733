// Shared core (compiled once) of compress::w8a8_gemm and compress::w8a8_outlier_gemm (CPU): per-token
// int8 activation quantization (bit-identical to the reference), int8 x int8 -> int32
// tiles for scalar / AVX2 / AVX-512 VNNI, and the fp32 outlier epilogue that the
// fused LLM.int8() op adds in the same pass over the weights.
//
// Signed x signed bytes: AVX2 vpmaddubsw and VNNI vpdpbusd take one unsigned operand,
// so the kernels use |x| (unsigned) and w * sign(x) (signed): vpsignb on AVX2, a masked
// byte negate on AVX-512. Weights are therefore expected in [-127, 127] (symmetric
// quantization never produces -128).
//
// Weights come canonical ([N, K] row-major) or, from the *_prepared ops, row-tiled
// (reference.w8a8_tile_cpu): when K % 64 == 0 the first N4 = N - N % 4 rows are stored
// in tiles of 4 rows with their 64-byte chunks interleaved (tile t, chunk c, row r at
// byte 4t * K + 256c + 64r), so the four rows an M = 1 tile reads are one sequential
// stream; the other rows stay row-major.

#include "cpu/w8a8_kernel.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>


namespace compress_cpu {
namespace w8 {

constexpr int64_t kPad = 64;  // activation rows are zero-padded to a multiple of this
constexpr int64_t kTileRows = 4, kTileChunk = 64;
// How far ahead an M = 1 tile prefetches a tiled weight stream.
constexpr int64_t kPrefetchBytes = 2048;

struct Args {
  int64_t M, N, K, Kp;
  int64_t N4;        // rows [0, N4) tiled by 4 (see above), the rest row-major
  const int8_t* w;   // [N, K] bytes
  const void* ws;    // weight scale [N]
  ScaleType wst;
  const int8_t* qx;  // [M, Kp] quantized activations
  const uint8_t* ax; // [M, Kp] |qx|
  const float* sx;   // [M]
  // fused outliers (C == 0: none)
  int64_t C;
  const float* xo;   // [M, C] outlier activations
  const void* ow;    // [N, C] outlier weights
  ScaleType owt;
  float* y;          // [M, N] fp32
};

// Start of row n's chunk 0, and the distance between its consecutive 64-byte chunks:
// weight (n, k) is at w8_row(n) + (k / 64) * w8_chunk_stride(n) + k % 64.
inline const int8_t* w8_row(const Args& a, int64_t n) {
  return n < a.N4 ? a.w + (n & ~(kTileRows - 1)) * a.K + (n & (kTileRows - 1)) * kTileChunk : a.w + n * a.K;
}
inline int64_t w8_chunk_stride(const Args& a, int64_t n) { return n < a.N4 ? kTileRows * kTileChunk : kTileChunk; }
inline const int8_t* w8_at(const int8_t* row, int64_t cs, int64_t k) { return row + (k / kTileChunk) * cs + k % kTileChunk; }

// q = clamp(round_half_even(v / s), +-127) and |q| for n values; AVX2 below gives the
// same bytes (IEEE division and round-to-nearest-even are exact operations).
inline void quantize_span_scalar(const float* v, float s, int64_t n, int8_t* q, uint8_t* a) {
  for (int64_t j = 0; j < n; ++j) {
    const float r = std::min(127.f, std::max(-127.f, round_half_even(v[j] / s)));
    q[j] = static_cast<int8_t>(r);
    a[j] = static_cast<uint8_t>(std::fabs(r));
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
inline int64_t quantize_span_avx2(const float* v, float s, int64_t n, int8_t* q, uint8_t* a) {
  const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m256i r[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 x = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + j + 8 * i), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, x)));
    }
    const __m256i b = pack_32_epi8(r[0], r[1], r[2], r[3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + j), _mm256_abs_epi8(b));
  }
  return j;
}

#pragma GCC pop_options

// Per-token quantization, identical to reference.quantize_per_token_int8 (division,
// round half to even, clamp +-127). Outlier columns (if any) are gathered to xo and
// zeroed before the row's absmax, as in reference.w8a8_outlier_gemm.
inline void quantize_rows(const at::Tensor& x, const int64_t* idx, int64_t C, int64_t Kp, int8_t* qx,
                          uint8_t* ax, float* sx, float* xo) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool avx2 = active_isa() >= Isa::Avx2;
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      row_to_float(x, m, row.data());
      for (int64_t c = 0; c < C; ++c) xo[m * C + c] = row[idx[c]];
      for (int64_t c = 0; c < C; ++c) row[idx[c]] = 0.f;
      float amax = 0.f;
      if (avx2) {
        amax = absmax_avx2(row.data(), K);
      } else {
        for (int64_t j = 0; j < K; ++j) amax = std::max(amax, std::fabs(row[j]));
      }
      const float s = std::max(amax, 1e-10f) / 127.f;
      sx[m] = s;
      int8_t* q = qx + m * Kp;
      uint8_t* a = ax + m * Kp;
      const int64_t done = avx2 ? quantize_span_avx2(row.data(), s, K, q, a) : 0;
      quantize_span_scalar(row.data() + done, s, K - done, q + done, a + done);
      std::memset(q + K, 0, Kp - K);
      std::memset(a + K, 0, Kp - K);
    }
  });
}

inline float outlier_dot_scalar(const Args& a, int64_t m, int64_t n) {
  float s = 0.f;
  for (int64_t c = 0; c < a.C; ++c) s += a.xo[m * a.C + c] * load_scale(a.ow, a.owt, n * a.C + c);
  return s;
}

// ---- scalar -------------------------------------------------------------------------
inline void block_scalar(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* q = a.qx + m * a.Kp;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = w8_row(a, n);
      const int64_t cs = w8_chunk_stride(a, n);
      int32_t acc = 0;
      for (int64_t k = 0; k < a.K; ++k) acc += static_cast<int32_t>(q[k]) * static_cast<int32_t>(*w8_at(w, cs, k));
      float y = static_cast<float>(acc) * a.sx[m] * load_scale(a.ws, a.wst, n);
      if (a.C) y += outlier_dot_scalar(a, m, n);
      a.y[m * a.N + n] = y;
    }
  }
}

// ---- AVX2 ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")


inline float outlier_dot_avx2(const Args& a, int64_t m, int64_t n) {
  const float* xo = a.xo + m * a.C;
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= a.C; c += 8) {
    __m256 w;
    const int64_t off = n * a.C + c;
    switch (a.owt) {
      case ScaleType::F32: w = _mm256_loadu_ps(static_cast<const float*>(a.ow) + off); break;
      case ScaleType::F16:
        w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a.ow) + off)));
        break;
      default:
        w = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a.ow) + off))), 16));
    }
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(xo + c), w, acc);
  }
  if (c < a.C) {  // tail: the last C % 8 values through zeroed 8-wide buffers
    alignas(32) float xt[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    alignas(32) float wt[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = 0; c + j < a.C; ++j) {
      xt[j] = xo[c + j];
      wt[j] = load_scale(a.ow, a.owt, n * a.C + c + j);
    }
    acc = _mm256_fmadd_ps(_mm256_load_ps(xt), _mm256_load_ps(wt), acc);
  }
  return hsum256_ps(acc);
}

template <int MT, int NT>
inline void tile_avx2(const Args& a, int64_t m0, int64_t n0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_si256();
  // |x| is recomputed per step (one vpabsb per row, shared by the NT weight rows) instead
  // of loaded: the MT activation rows then take half the L1 space and half the loads.
  // Tiles never straddle the tiled / row-major boundary, so one chunk stride serves all
  // NT rows. M = 1 prefetch: a tiled tile is one stream, fetched kPrefetchBytes ahead once
  // per 64-byte line; row-major rows are NT short streams, each fetched at the next
  // tile's rows (the hardware prefetcher alone ramps up too slowly on either).
  const int8_t* wrow[NT];
  for (int n = 0; n < NT; ++n) wrow[n] = w8_row(a, n0 + n);
  const int64_t cs = w8_chunk_stride(a, n0);
  const bool tiled = cs != kTileChunk;
  auto body = [&](int64_t koff, const int8_t* const (&wp)[NT]) {
    __m256i w[NT];
    for (int n = 0; n < NT; ++n) {
      if constexpr (MT == 1) {
        if (!tiled) _mm_prefetch(reinterpret_cast<const char*>(wp[n] + NT * a.K), _MM_HINT_T0);
        else if (koff % kTileChunk == 0) _mm_prefetch(reinterpret_cast<const char*>(wp[n] + kPrefetchBytes), _MM_HINT_T0);
      }
      w[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[n]));
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qx + (m0 + m) * a.Kp + koff));
      const __m256i ax = _mm256_abs_epi8(x);
      for (int n = 0; n < NT; ++n) {
        const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[n], x));
        acc[m][n] = _mm256_add_epi32(acc[m][n], _mm256_madd_epi16(p, ones));
      }
    }
  };
  const int64_t full = a.K / 32 * 32;
  const int8_t* wp[NT];
  for (int64_t k = 0; k < full; k += 32) {
    for (int n = 0; n < NT; ++n) wp[n] = w8_at(wrow[n], cs, k);
    body(k, wp);
  }
  if (full < a.K) {  // tail (row-major only): copy the last partial chunk of each row
    alignas(32) int8_t tail[NT][32];
    for (int n = 0; n < NT; ++n) {
      std::memset(tail[n], 0, 32);
      std::memcpy(tail[n], w8_at(wrow[n], cs, full), a.K - full);
      wp[n] = tail[n];
    }
    body(full, wp);
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float y = static_cast<float>(hsum256_epi32(acc[m][n])) * a.sx[m0 + m] * load_scale(a.ws, a.wst, n0 + n);
      if (a.C) y += outlier_dot_avx2(a, m0 + m, n0 + n);
      a.y[(m0 + m) * a.N + n0 + n] = y;
    }
}

inline void block_avx2(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  auto run_m = [&](auto mt_tag, int64_t mm) {
    constexpr int MT = decltype(mt_tag)::value;
    constexpr int NT = MT == 1 ? 4 : 2;
    int64_t n = n0;
    for (; n + NT <= n1; n += NT) tile_avx2<MT, NT>(a, mm, n);
    for (; n < n1; ++n) tile_avx2<MT, 1>(a, mm, n);
  };
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) run_m(std::integral_constant<int, 4>{}, m);
  for (; m + 2 <= m1; m += 2) run_m(std::integral_constant<int, 2>{}, m);
  for (; m < m1; ++m) run_m(std::integral_constant<int, 1>{}, m);
}
#pragma GCC pop_options

// ---- AVX-512 VNNI -------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

template <int MT, int NT>
inline void tile_vnni(const Args& a, int64_t m0, int64_t n0) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_si512();
  auto body = [&](int64_t koff, const int8_t* const (&wp)[NT]) {
    __m512i ax[MT];
    __mmask64 neg[MT];
    for (int m = 0; m < MT; ++m) {
      ax[m] = _mm512_loadu_si512(a.ax + (m0 + m) * a.Kp + koff);
      neg[m] = _mm512_movepi8_mask(_mm512_loadu_si512(a.qx + (m0 + m) * a.Kp + koff));
    }
    for (int n = 0; n < NT; ++n) {
      const __m512i w = _mm512_loadu_si512(wp[n]);
      for (int m = 0; m < MT; ++m)
        acc[m][n] = _mm512_dpbusd_epi32(acc[m][n], ax[m], _mm512_mask_sub_epi8(w, neg[m], zero, w));
    }
  };
  const int8_t* wrow[NT];
  for (int n = 0; n < NT; ++n) wrow[n] = w8_row(a, n0 + n);
  const int64_t cs = w8_chunk_stride(a, n0);
  const int64_t full = a.K / 64 * 64;
  const int8_t* wp[NT];
  for (int64_t k = 0; k < full; k += 64) {
    for (int n = 0; n < NT; ++n) {
      wp[n] = w8_at(wrow[n], cs, k);
      if constexpr (MT == 1) _mm_prefetch(reinterpret_cast<const char*>(wp[n] + (cs != kTileChunk ? kPrefetchBytes : NT * a.K)), _MM_HINT_T0);
    }
    body(k, wp);
  }
  if (full < a.K) {
    alignas(64) int8_t tail[NT][64];
    for (int n = 0; n < NT; ++n) {
      std::memset(tail[n], 0, 64);
      std::memcpy(tail[n], w8_at(wrow[n], cs, full), a.K - full);
      wp[n] = tail[n];
    }
    body(full, wp);
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float y = static_cast<float>(_mm512_reduce_add_epi32(acc[m][n])) * a.sx[m0 + m] * load_scale(a.ws, a.wst, n0 + n);
      if (a.C) y += outlier_dot_avx2(a, m0 + m, n0 + n);
      a.y[(m0 + m) * a.N + n0 + n] = y;
    }
}

inline void block_vnni(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  auto run_m = [&](auto mt_tag, int64_t mm) {
    constexpr int MT = decltype(mt_tag)::value;
    constexpr int NT = 4;
    int64_t n = n0;
    for (; n + NT <= n1; n += NT) tile_vnni<MT, NT>(a, mm, n);
    for (; n < n1; ++n) tile_vnni<MT, 1>(a, mm, n);
  };
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) run_m(std::integral_constant<int, 4>{}, m);
  for (; m < m1; ++m) run_m(std::integral_constant<int, 1>{}, m);
}
#pragma GCC pop_options

// Runs the whole op: quantize, tiles over the intra-op pool, cast to x's dtype.
at::Tensor run(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& wscale_in,
               const at::Tensor* outlier_idx, const at::Tensor* outlier_weight, bool tiled, const char* op) {
  TORCH_CHECK(x_in.dim() == 2, op, ": x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(qweight_in.dim() == 2 && qweight_in.scalar_type() == at::kChar, op, ": qweight must be int8 [N, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0);
  TORCH_CHECK(qweight_in.size(1) == K, op, ": qweight is ", qweight_in.sizes(), " but x has K=", K);
  TORCH_CHECK(wscale_in.numel() == N, op, ": weight_scale must have N=", N, " elements");
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous(), wscale = wscale_in.contiguous();
  at::Tensor idx, ow;
  int64_t C = 0;
  if (outlier_idx != nullptr) {
    idx = outlier_idx->to(at::kLong).contiguous();
    C = idx.numel();
    ow = outlier_weight->contiguous();
    TORCH_CHECK(ow.dim() == 2 && ow.size(0) == N && ow.size(1) == C, op, ": outlier_weight must be [N, C]=[", N, ", ", C, "]");
    if (C) {
      const int64_t* ip = idx.data_ptr<int64_t>();
      for (int64_t c = 0; c < C; ++c) TORCH_CHECK(ip[c] >= -K && ip[c] < K, op, ": outlier index ", ip[c], " out of range");
      idx = at::where(idx < 0, idx + K, idx);
    }
  }
  if (M == 0 || N == 0) return at::zeros({M, N}, x.options());
  const int64_t Kp = ceil_div(std::max<int64_t>(K, 1), kPad) * kPad;
  // One workspace (a decode step makes ~100 of these calls): int8 activations and their
  // |values| [M, Kp] each (Kp % 64 == 0), per-row scales [M], gathered outliers [M, C].
  at::Tensor work = at::empty({2 * M * Kp + 4 * M * (1 + C)}, x.options().dtype(at::kByte));
  int8_t* qx = reinterpret_cast<int8_t*>(work.data_ptr<uint8_t>());
  uint8_t* ax = work.data_ptr<uint8_t>() + M * Kp;
  float* sx = reinterpret_cast<float*>(work.data_ptr<uint8_t>() + 2 * M * Kp);
  float* xo = sx + M;
  quantize_rows(x, C ? idx.data_ptr<int64_t>() : nullptr, C, Kp, qx, ax, sx, xo);
  // With several rows, each outlier weight is used M times: convert them to fp32 once and
  // zero-pad C to a multiple of 8 so the epilogue is whole 8-wide FMAs. (M = 1 reads each
  // value once, so it converts in the epilogue instead of paying a copy.)
  int64_t Ce = C;
  at::Tensor xo_padded;
  if (C && M > 1) {
    Ce = ceil_div(C, 8) * 8;
    ow = at::constant_pad_nd(ow.to(at::kFloat), {0, Ce - C}).contiguous();
    xo_padded = at::constant_pad_nd(at::from_blob(xo, {M, C}, x.options().dtype(at::kFloat)), {0, Ce - C}).contiguous();
    xo = xo_padded.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int64_t N4 = tiled && K % kTileChunk == 0 ? N - N % kTileRows : 0;
  Args a{M, N, K, Kp, N4, qweight.data_ptr<int8_t>(), wscale.data_ptr(), scale_type_of(wscale),
         qx, ax, sx, Ce, xo, C ? ow.data_ptr() : nullptr, C ? scale_type_of(ow) : ScaleType::F32,
         y.data_ptr<float>()};
  void (*kernel)(const Args&, int64_t, int64_t, int64_t, int64_t) = block_scalar;
  switch (active_isa()) {
    case Isa::Avx512Vnni: kernel = block_vnni; break;
    case Isa::Avx2: kernel = block_avx2; break;
    default: break;
  }
  const int64_t nb = std::max<int64_t>(8, ((128 << 10) / std::max<int64_t>(1, K)) / 8 * 8);
  parallel_tiles(M, N, 64, nb, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) { kernel(a, m0, m1, n0, n1); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace w8
}  // namespace compress_cpu
