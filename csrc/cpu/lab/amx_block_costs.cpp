// What one block of 32 k costs the lanes op's AMX-INT8 tiles (w4a8_lanes_amx.inc), one
// thread, data in L1, so only the core's units count:
//   g++ -O2 -march=sapphirerapids -Icsrc csrc/cpu/lab/amx_block_costs.cpp -o /tmp/amx_block_costs && /tmp/amx_block_costs
// Prints ns per block for:
//   tdp K=32 / K=64  a tdpbsud on tiles loaded once (K = 32: the op's block; K = 64 the full tile)
//   tiles            a block's A (16 rows x 32 bytes) and B (8 x 64) loads and its tdpbsud
//   fold             the block's 16 zmm of int32 sums converted and FMA'd with a row scale each
//   tiles + fold     both, the fold reading what the tiles stored (the op's loop)
// Needs AMX-INT8 and Linux's permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked for here.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cpu/amx_common.h"

namespace {

// tmm0-1: C; tmm2-3: A, 16 rows x kbytes; tmm4-5: B, kbytes / 4 rows x 64
void configure(int kbytes) {
  const uint8_t b_rows = static_cast<uint8_t>(kbytes / 4);
  const uint16_t a_cols = static_cast<uint16_t>(kbytes);
  compress_cpu::amx_load_config({16, 16, 16, 16, b_rows, b_rows, 0, 0}, {64, 64, a_cols, a_cols, 64, 64, 0, 0});
}

template <typename F>
double ns_per(int64_t n, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n * 1e9;
}

constexpr int kK = 1024, kBlocks = kK / 32;
constexpr int64_t kReps = 100000;

inline __attribute__((always_inline)) void fold16(const int32_t* sums, const float* xs, __m512* ag) {
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    ag[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * m)), _mm512_set1_ps(xs[m]), ag[m]);
}

// blocks b and b + 1: their A and B tiles loaded, their tdpbsud into C0 and C1
inline __attribute__((always_inline)) void tile_pair(const int8_t* xa, const uint8_t* panel, int b) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_loadd(2, xa + 32 * b, kK);
  _tile_loadd(4, panel + 512 * b, 64);
  _tile_loadd(3, xa + 32 * (b + 1), kK);
  _tile_loadd(5, panel + 512 * (b + 1), 64);
  _tile_dpbsud(0, 2, 4);
  _tile_dpbsud(1, 3, 5);
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::fprintf(stderr, "no AMX tile permission from the OS\n");
    return 1;
  }
  std::vector<int8_t> xa(16 * kK, 1);
  std::vector<uint8_t> panel(kBlocks * 512 + 64, 1);
  std::vector<float> xs(kBlocks * 16, 1.f);
  alignas(64) static int32_t sums[2][256];
  alignas(64) static float out[256];

  for (int kbytes : {32, 64}) {
    configure(kbytes);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, xa.data(), kK);
    _tile_loadd(4, panel.data(), 64);
    _tile_loadd(3, xa.data(), kK);
    _tile_loadd(5, panel.data(), 64);
    const double ns = ns_per(2 * kReps, [&] {
      for (int64_t r = 0; r < kReps; ++r) {
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
      }
    });
    _tile_stored(0, sums[0], 64);
    std::printf("tdp K=%-2d       %6.2f ns per tdpbsud (16 x %d x 16)\n", kbytes, ns, kbytes);
  }

  configure(32);
  const double tiles = ns_per(kReps * kBlocks, [&] {
    for (int64_t r = 0; r < kReps; ++r)
      for (int b = 0; b < kBlocks; b += 2) {
        tile_pair(xa.data(), panel.data(), b);
      }
  });
  _tile_stored(0, sums[0], 64);
  __m512 ag[16];
  for (auto& v : ag) v = _mm512_setzero_ps();
  const double fold = ns_per(kReps * kBlocks, [&] {
    for (int64_t r = 0; r < kReps; ++r)
      for (int b = 0; b < kBlocks; ++b) fold16(sums[b & 1], xs.data() + 16 * b, ag);
  });
  const double both = ns_per(kReps * kBlocks, [&] {
    for (int64_t r = 0; r < kReps; ++r)
      for (int b = 0; b < kBlocks; b += 2) {
        tile_pair(xa.data(), panel.data(), b);
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        fold16(sums[0], xs.data() + 16 * b, ag);
        fold16(sums[1], xs.data() + 16 * (b + 1), ag);
      }
  });
  for (int m = 0; m < 16; ++m) _mm512_store_ps(out + 16 * m, ag[m]);
  compress_cpu::amx_release();
  std::printf("tiles          %6.2f ns a block (loads + tdpbsud)\n", tiles);
  std::printf("fold           %6.2f ns a block (16 zmm)\n", fold);
  std::printf("tiles + fold   %6.2f ns a block (sum of the two: %.2f)\n", both, tiles + fold);
  std::printf("checksum %g\n", static_cast<double>(out[0]));
  return 0;
}
