// int4 weight layouts and dequantization for the W4A16 tensor-core kernel.
//
// Canonical layout (compress/ops/reference.py): qweight int32 [N, K/8], column k
// of row n is the nibble at bits 4*(k%8) of word k/8, unsigned u in 0..15;
// zeros uint8 [N, K/g]; w = (u - z) * s.
//
// Shuffled ("fragment order") layout made once at load time by
// w4a16_shuffle_for_cuda: N padded to a multiple of 128 (Np), K to 64 (Kp);
// int32 words indexed [Np/16][Kp/64][32 lanes][4 k16-steps]. The word of
// (n16-tile nt, 64-wide k-block kb, lane, step ks) holds exactly the 8 weights
// that lane needs as B operand of two m16n8k16 mma (n8 sub-tiles 0 and 1 of nt)
// at k16-step ks, ordered so that the lop3 magic-number dequantization yields the
// four B registers directly:
//
//   nibble p : n = 16*nt + 8*((p>>1)&1) + lane/4
//              k = 64*kb + 16*ks + 2*(lane%4) + (p>>2) + 8*(p&1)
//   pairs (0,4) (1,5) (2,6) (3,7)  ->  b0 tile0, b1 tile0, b0 tile1, b1 tile1
//
// A warp reads 32 lanes x 16 bytes = 512 contiguous bytes per (nt, kb).
#pragma once

#include "cpk_common.cuh"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace cpk {

constexpr int kW4TileN = 128;  // N padding / block tile
constexpr int kW4TileK = 64;   // K padding / block tile

CPK_HD int w4_padded_n(int n) { return round_up(n, kW4TileN); }
CPK_HD int w4_padded_k(int k) { return round_up(k, kW4TileK); }

// (n, k) of nibble p of shuffled word `word` (linear index) for padded K = kp.
CPK_HD RowCol w4_shuffled_coord(long long word, int p, int kp) {
  const int ks = static_cast<int>(word & 3);
  const int lane = static_cast<int>((word >> 2) & 31);
  const long long tile = word >> 7;  // nt * (kp/64) + kb
  const int kblocks = kp / kW4TileK;
  const int nt = static_cast<int>(tile / kblocks), kb = static_cast<int>(tile % kblocks);
  const int n = 16 * nt + 8 * ((p >> 1) & 1) + (lane >> 2);
  const int k = 64 * kb + 16 * ks + 2 * (lane & 3) + (p >> 2) + 8 * (p & 1);
  return {n, k};
}

// Builds shuffled word `word` from the canonical qweight [n, k/8] (zero nibbles
// in the padding).
CPK_HD uint32_t w4_shuffle_word(const int32_t* qweight, int n, int k, int kp, long long word) {
  uint32_t out = 0;
  for (int p = 0; p < 8; ++p) {
    const RowCol c = w4_shuffled_coord(word, p, kp);
    uint32_t u = 0;
    if (c.row < n && c.col < k) {
      const uint32_t w = static_cast<uint32_t>(qweight[static_cast<long long>(c.row) * (k / 8) + c.col / 8]);
      u = (w >> (4 * (c.col % 8))) & 0xfu;
    }
    out |= u << (4 * p);
  }
  return out;
}

// Word offset inside one pipeline stage of the B tile (8 n16-tiles x 32 lanes x
// 4 steps) for warp `warp` (32 columns = n16 tiles 2*warp, 2*warp+1), its n16
// tile j, lane, step ks.
CPK_HD int w4_stage_word(int warp, int j, int lane, int ks) { return ((warp * 2 + j) * 32 + lane) * 4 + ks; }

// ---------------------------------------------------------------------------
// Dequantization of one shuffled word into 4 B registers (x2 halves each).
// Zero point folded into the magic-number subtraction, then one multiply by the
// group scale; every step before the multiply is exact.
//
// fp16: lop3(q, 0x000f000f, 0x64006400) = (1024 + u_lo, 1024 + u_hi) as half2;
//       minus (1024 + z) -> u - z.  The nibbles at bits 4 / 20 come out as
//       1024 + 16u; fma(h, 1/16, -(64 + z)) -> u - z.  q >> 8 gives the rest.
// bf16: mantissa has 7 bits: magic 128 (0x4300), one shift by 4 per pair;
//       minus (128 + z) -> u - z.
// s0/s1 are the scales of n8 sub-tile 0/1 as x2 bit patterns (both halves
// equal), z0/z1 the zero points (0..15).
// ---------------------------------------------------------------------------
CPK_HD uint32_t w4_magic_zero_f16(uint32_t z) { return (0x6400u | z) * 0x10001u; }          // 1024+z
CPK_HD uint32_t w4_magic_zero_hi_f16(uint32_t z) { return (0xD400u | (z << 4)) * 0x10001u; }  // -(64+z)
CPK_HD uint32_t w4_magic_zero_bf16(uint32_t z) { return (0x4300u | z) * 0x10001u; }         // 128+z
constexpr uint32_t kF16OneSixteenth2 = 0x2c002c00u;  // 1/16 in both halves

#if !defined(__CUDA_ARCH__)
// host emulation of the packed x2 arithmetic (each op rounds once, like the PTX ops)
template <bool kBf16>
inline float x2_get(uint32_t v, int hi) {
  const uint16_t h = static_cast<uint16_t>(hi ? v >> 16 : v & 0xffff);
  return kBf16 ? bf16_to_f32_host(h) : f16_to_f32_host(h);
}
template <bool kBf16>
inline uint32_t x2_make(float lo, float hi) {
  const uint32_t a = kBf16 ? f32_to_bf16_host(lo) : f32_to_f16_host(lo);
  const uint32_t b = kBf16 ? f32_to_bf16_host(hi) : f32_to_f16_host(hi);
  return a | (b << 16);
}
template <bool kBf16>
inline uint32_t x2_sub(uint32_t a, uint32_t b) {
  return x2_make<kBf16>(x2_get<kBf16>(a, 0) - x2_get<kBf16>(b, 0), x2_get<kBf16>(a, 1) - x2_get<kBf16>(b, 1));
}
template <bool kBf16>
inline uint32_t x2_mul(uint32_t a, uint32_t b) {
  return x2_make<kBf16>(x2_get<kBf16>(a, 0) * x2_get<kBf16>(b, 0), x2_get<kBf16>(a, 1) * x2_get<kBf16>(b, 1));
}
template <bool kBf16>
inline uint32_t x2_fma(uint32_t a, uint32_t b, uint32_t c) {
  return x2_make<kBf16>(__builtin_fmaf(x2_get<kBf16>(a, 0), x2_get<kBf16>(b, 0), x2_get<kBf16>(c, 0)),
                        __builtin_fmaf(x2_get<kBf16>(a, 1), x2_get<kBf16>(b, 1), x2_get<kBf16>(c, 1)));
}
#endif

#if defined(__CUDA_ARCH__)
CPK_D uint32_t h2_sub(uint32_t a, uint32_t b) {
  __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
CPK_D uint32_t h2_mul(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
CPK_D uint32_t h2_fma(uint32_t a, uint32_t b, uint32_t c) {
  __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
                      *reinterpret_cast<const __half2*>(&c));
  return *reinterpret_cast<uint32_t*>(&r);
}
CPK_D uint32_t b2_sub(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
CPK_D uint32_t b2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
#endif

CPK_HD void w4_dequant_f16(uint32_t q, uint32_t s0, uint32_t s1, uint32_t z0, uint32_t z1, uint32_t b[4]) {
  const uint32_t lo0 = lop3_and_or(q, 0x000f000fu, 0x64006400u);
  const uint32_t hi0 = lop3_and_or(q, 0x00f000f0u, 0x64006400u);
  const uint32_t q8 = q >> 8;
  const uint32_t lo1 = lop3_and_or(q8, 0x000f000fu, 0x64006400u);
  const uint32_t hi1 = lop3_and_or(q8, 0x00f000f0u, 0x64006400u);
#if defined(__CUDA_ARCH__)
  b[0] = h2_mul(h2_sub(lo0, w4_magic_zero_f16(z0)), s0);
  b[1] = h2_mul(h2_fma(hi0, kF16OneSixteenth2, w4_magic_zero_hi_f16(z0)), s0);
  b[2] = h2_mul(h2_sub(lo1, w4_magic_zero_f16(z1)), s1);
  b[3] = h2_mul(h2_fma(hi1, kF16OneSixteenth2, w4_magic_zero_hi_f16(z1)), s1);
#else
  b[0] = x2_mul<false>(x2_sub<false>(lo0, w4_magic_zero_f16(z0)), s0);
  b[1] = x2_mul<false>(x2_fma<false>(hi0, kF16OneSixteenth2, w4_magic_zero_hi_f16(z0)), s0);
  b[2] = x2_mul<false>(x2_sub<false>(lo1, w4_magic_zero_f16(z1)), s1);
  b[3] = x2_mul<false>(x2_fma<false>(hi1, kF16OneSixteenth2, w4_magic_zero_hi_f16(z1)), s1);
#endif
}

CPK_HD void w4_dequant_bf16(uint32_t q, uint32_t s0, uint32_t s1, uint32_t z0, uint32_t z1, uint32_t b[4]) {
  const uint32_t m0 = w4_magic_zero_bf16(z0), m1 = w4_magic_zero_bf16(z1);
CPK_UNROLL
  for (int i = 0; i < 4; ++i) {
    const uint32_t v = lop3_and_or(q >> (4 * i), 0x000f000fu, 0x43004300u);
#if defined(__CUDA_ARCH__)
    b[i] = b2_mul(b2_sub(v, i < 2 ? m0 : m1), i < 2 ? s0 : s1);
#else
    b[i] = x2_mul<true>(x2_sub<true>(v, i < 2 ? m0 : m1), i < 2 ? s0 : s1);
#endif
  }
}

template <bool kBf16>
CPK_HD void w4_dequant(uint32_t q, uint32_t s0, uint32_t s1, uint32_t z0, uint32_t z1, uint32_t b[4]) {
  if (kBf16)
    w4_dequant_bf16(q, s0, s1, z0, z1, b);
  else
    w4_dequant_f16(q, s0, s1, z0, z1, b);
}

}  // namespace cpk
