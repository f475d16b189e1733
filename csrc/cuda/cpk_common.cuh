// Shared helpers of the compress CUDA kernels (namespace cpk).
//
// Everything here that is not tensor-core or memory-pipeline hardware is a
// __host__ __device__ function, so the host test harness (csrc/cuda/tests/)
// compiles the very same code and checks it against compress/ops/reference.py.
// No torch headers: the kernels build with plain nvcc.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CPK_HD __host__ __device__ __forceinline__
#define CPK_D __device__ __forceinline__
#else
#define CPK_HD inline
#endif
#if defined(__CUDA_ARCH__)
#define CPK_UNROLL _Pragma("unroll")
#else
#define CPK_UNROLL
#endif

namespace cpk {

// ---------------------------------------------------------------------------
// Bits
// ---------------------------------------------------------------------------

// lop3.b32 with immLut 0xEA = (a & b) | c: the mask-and-or used by the int4
// dequantization (host: the same boolean function).
CPK_HD uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return (a & b) | c;
#endif
}

CPK_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }
CPK_HD int round_up(int a, int b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------
// mma.sync fragment coordinates (PTX ISA, "Matrix fragments for mma.m16n8k16"
// and "mma.m16n8k32"). lane = thread in warp, i = element index in the
// fragment (register i / elems_per_reg, slot i % elems_per_reg; slot 0 is the
// low bits). groupID = lane / 4, threadID_in_group = lane % 4.
// ---------------------------------------------------------------------------
struct RowCol {
  int row, col;
};

// m16n8k16 .f16/.bf16, A (16x16, row-major): 4 regs x 2 halves, i in 0..7.
CPK_HD RowCol mma_f16_a(int lane, int i) {
  return {(lane >> 2) + 8 * ((i >> 1) & 1), 2 * (lane & 3) + (i & 1) + 8 * (i >> 2)};
}
// m16n8k16 B (16x8, "col"): 2 regs x 2 halves, i in 0..3. row = k, col = n.
CPK_HD RowCol mma_f16_b(int lane, int i) {
  return {2 * (lane & 3) + (i & 1) + 8 * (i >> 1), lane >> 2};
}
// m16n8k32 .s8, A (16x32): 4 regs x 4 bytes, i in 0..15.
CPK_HD RowCol mma_s8_a(int lane, int i) {
  return {(lane >> 2) + 8 * ((i >> 2) & 1), 4 * (lane & 3) + (i & 3) + 16 * (i >> 3)};
}
// m16n8k32 .s8, B (32x8): 2 regs x 4 bytes, i in 0..7. row = k, col = n.
CPK_HD RowCol mma_s8_b(int lane, int i) {
  return {4 * (lane & 3) + (i & 3) + 16 * (i >> 2), lane >> 2};
}
// C/D (16x8) of both shapes, f32 or s32: 4 regs, i in 0..3.
CPK_HD RowCol mma_c(int lane, int i) {
  return {(lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)};
}

// ldmatrix.x4 (m8n8, b16) over a 16-row x 32-byte block: lane supplies the
// address of row (lane & 15), 16-byte chunk (lane >> 4). Register j of every lane
// then holds matrix j = (rows 8*(j&1).., chunk j>>1), which is exactly the
// m16n8k16 A fragment (and the m16n8k32 s8 A fragment, 2 int8 per b16).
CPK_HD int ldsm_x4_row(int lane) { return lane & 15; }
CPK_HD int ldsm_x4_chunk(int lane) { return lane >> 4; }

// Shared-memory tiles with 128-byte rows (8 chunks of 16 bytes), XOR-swizzled so
// that the 8 row addresses of one ldmatrix phase (same logical chunk, 8
// consecutive rows) hit 8 different 16-byte bank groups; returns the index of
// the 16-byte chunk.
CPK_HD int swz128(int row, int chunk) { return row * 8 + (chunk ^ (row & 7)); }

// Contiguous split of `tiles` k-tiles over `splits` parts (split-K).
CPK_HD void split_range(int tiles, int splits, int part, int* begin, int* end) {
  const int base = tiles / splits, extra = tiles % splits;
  *begin = part * base + (part < extra ? part : extra);
  *end = *begin + base + (part < extra ? 1 : 0);
}

// Split-K factor (a power of two, at most 16) for a grid of `blocks` output
// tiles over `ktiles` k-tiles on `sms` SMs: doubled while the grid is below two
// waves and every split keeps at least `min_tiles` k-tiles.
CPK_HD int choose_splits(int blocks, int ktiles, int sms, int min_tiles) {
  int s = 1;
  while (s < 16 && blocks * s < 2 * sms && ktiles / (2 * s) >= min_tiles) s *= 2;
  return s;
}

// ---------------------------------------------------------------------------
// Per-token int8 quantization math (reference: quantize_per_token_int8).
// ---------------------------------------------------------------------------
CPK_HD float int8_scale_from_amax(float amax) {
  const float a = amax > 1e-10f ? amax : 1e-10f;
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, 127.f);
#else
  return a / 127.f;
#endif
}

CPK_HD int8_t int8_quantize(float v, float scale) {
#if defined(__CUDA_ARCH__)
  float r = rintf(__fdiv_rn(v, scale));
#else
  volatile float qv = v / scale;  // IEEE division, as torch
  float r = __builtin_rintf(qv);
#endif
  r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
  return static_cast<int8_t>(r);
}

// Largest K whose int8 dot products are exact in int32: |x_q| <= 127 (the
// quantizer clamps), |w| <= 128 (any int8 weight), 132104 * 127 * 128 < 2^31.
constexpr int kMaxInt8DotK = 132104;

// LLM.int8() outlier columns. An index j names column j, and -K <= j < 0 names
// column K + j, as in the reference (x[:, -1] is the last column); anything else
// is out of range: -1, and the kernel leaves it out (no memory is touched for it).
CPK_HD int outlier_column(long long j, int k) {
  if (j < 0) j += k;
  return j >= 0 && j < k ? static_cast<int>(j) : -1;
}
// The quantize kernel marks the outlier columns of a row in a shared-memory bit
// mask: bit (j % 32) of word j / 32.
CPK_HD int outlier_mask_words(int k) { return ceil_div(k, 32); }
CPK_HD bool outlier_mask_test(const uint32_t* mask, int j) { return (mask[j >> 5] >> (j & 31)) & 1u; }
// Dynamic shared memory of the quantize kernel for a row of k columns with c outliers.
CPK_HD int quantize_rows_smem_bytes(int k, int c) { return c > 0 ? 4 * outlier_mask_words(k) : 0; }
// Dynamic shared memory a kernel may use without the opt-in (per block, every sm_80+ GPU);
// the kernel's static shared memory counts against the same 48 KiB.
constexpr int kDefaultSmemBytes = 48 * 1024;
CPK_HD bool smem_needs_optin(int dynamic_bytes, int static_bytes) {
  return dynamic_bytes + static_bytes > kDefaultSmemBytes;
}

// ---------------------------------------------------------------------------
// Host emulation of fp16 / bf16 rounding (round to nearest even), used only by
// the host paths of the helpers below and by the harness.
// ---------------------------------------------------------------------------
inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f16_to_f32_host(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {  // zero / subnormal: m * 2^-24
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (e == 31) return bits_to_f32(sign | 0x7f800000u | (m << 13));
  return bits_to_f32(sign | ((e + 112) << 23) | (m << 13));
}
inline uint16_t f32_to_f16_host(float f) {
  const uint32_t x = f32_to_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) {  // below 2^-14: subnormal half, round(|f| * 2^24)
    const float r = __builtin_rintf(bits_to_f32(ax) * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}
inline float bf16_to_f32_host(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16_host(float f) {
  const uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace cpk
