// ISA emulation harness: runs the kernels' AVX2 and AVX-512 VNNI tiles on a CPU without
// AVX-512, so the VNNI paths (chosen at run time on Cascade Lake and later Xeons, Zen 4
// and later) are checked on machines that cannot execute them.
//
// It includes the kernels' own tile sources (w4a16_tile.inc, w8a8_tile_*.inc) and their
// ATen-free layout / quantizer headers, compiled with simde_shim/ first on the include
// path: every intrinsic is SIMDe's portable implementation, and COMPRESS_ISA_EMULATION
// keeps all code at the baseline ISA. The setup around the tiles (activation
// quantization, workspaces, block split) mirrors w4a8_run and w8::run without ATen.
// tests/csrc/test_cpu_isa_emulation.py builds it into a shared library and compares it
// with the compiled extension's ops and the reference.
#ifndef COMPRESS_ISA_EMULATION
#error "build with -DCOMPRESS_ISA_EMULATION and csrc/cpu/tests/simde_shim first on the include path"
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/simd_common.h"
#include "cpu/w4a16_common.h"
#include "cpu/w8a8_common.h"

namespace compress_cpu {
namespace emu {
using namespace w4;
// The op's switch between the few-row tiles (w4a8_gemm.cpp): set by cpk_emu_set_w4_shared_unpack.
bool shared_unpack = true;
inline bool w4_shared_unpack_on() { return shared_unpack; }
namespace avx2 {
#define W4_VNNI 0
#include "cpu/w4a16_tile.inc"
#undef W4_VNNI
}  // namespace avx2
namespace vnni {
#define W4_VNNI 1
#include "cpu/w4a16_tile.inc"
#undef W4_VNNI
}  // namespace vnni
}  // namespace emu

namespace w8 {
#include "cpu/w8a8_tile_avx2.inc"
#include "cpu/w8a8_tile_vnni.inc"
}  // namespace w8
}  // namespace compress_cpu

namespace {
using namespace compress_cpu;

constexpr int kIsaScalar = 0, kIsaAvx2 = 1, kIsaVnni = 2;

// m-blocks of 64 rows, n-blocks of nb rows (a multiple of 4, as the op's), in order.
template <typename F>
void for_blocks(int64_t M, int64_t N, int64_t nb, const F& fn) {
  for (int64_t n0 = 0; n0 < N; n0 += nb)
    for (int64_t m0 = 0; m0 < M; m0 += 64) fn(m0, std::min(M, m0 + 64), n0, std::min(N, n0 + nb));
}
}  // namespace

extern "C" {

// The VNNI level's few-row tiles: 1 unpacks a weight chunk once for up to eight rows (the
// op's default), 0 once per row. Returns the previous setting.
int cpk_emu_set_w4_shared_unpack(int on) {
  const bool before = emu::shared_unpack;
  emu::shared_unpack = on != 0;
  return before ? 1 : 0;
}

// Prepared W4A8 (w4a8_gemm_prepared's tensors): x fp32 [M, K], w the row-tiled bytes
// ([N, K/2]; rows [0, N4) tiled), s fp32 / z uint8 [N, K/G], y fp32 [M, N]. isa: 0
// scalar, 1 AVX2 tiles, 2 AVX-512 VNNI tiles (activations quantized on the AVX2 path
// for 1 and 2, as on those CPUs). Returns 0, or -1 for arguments the tiles do not take.
int cpk_emu_w4a16(int isa, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t N4,
                  int64_t G, const float* s, const uint8_t* z, int64_t nb, float* y) {
  if (M < 1 || N < 1 || K % G != 0 || nb < 4 || nb % 4 != 0) return -1;
  if (G != w4::kBlock && G % w4::kChunk != 0) return -1;  // the tiles' group sizes (w4a8_run)
  if (N4 != 0 && (N4 != N - N % w4::kTileRows || K % w4::kChunk != 0)) return -1;
  const int64_t KC = ceil_div(K, w4::kChunk), NG = K / G;
  std::vector<int8_t> xq(M * KC * w4::kChunk);
  std::vector<float> xs(M * KC * 8), xg(M * NG);
  for (int64_t m = 0; m < M; ++m)
    w4::quantize_row(x + m * K, K, G, KC, isa != kIsaScalar, xq.data() + m * KC * w4::kChunk,
                     xs.data() + m * KC * 8, xg.data() + m * NG);
  const w4::W4Args a{M, N, K, G, KC, NG, N4, w, s, z, xq.data(), xs.data(), xg.data(), y};
  for_blocks(M, N, nb, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (isa == kIsaScalar) w4::w4_scalar(a, m0, m1, n0, n1);
    else if (isa == kIsaAvx2 && G == 32) emu::avx2::w4_block_avx<true>(a, m0, m1, n0, n1);
    else if (isa == kIsaAvx2) emu::avx2::w4_block_avx<false>(a, m0, m1, n0, n1);
    else if (G == 32) emu::vnni::w4_block_avx<true>(a, m0, m1, n0, n1);
    else emu::vnni::w4_block_avx<false>(a, m0, m1, n0, n1);
  });
  return 0;
}

// W8A8 / fused LLM.int8 (w8a8_gemm_prepared / w8a8_outlier_gemm_prepared's tensors):
// x fp32 [M, K], w int8 [N, K] (rows [0, N4) row-tiled), ws [N] of scale type wst
// (0 fp32, 1 fp16, 2 bf16), C outlier columns idx (in range) with weights ow [N, C] of
// type owt, y fp32 [M, N]. isa as above. As w8::run: at M = 1 the tiles' epilogue adds
// the outlier products; at M > 1 the tiles run without them and outlier_products_*
// adds them after (the AVX2 form for the AVX2 and VNNI paths, as on those CPUs).
int cpk_emu_w8a8(int isa, const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N, int64_t N4,
                 const void* ws, int wst, const int64_t* idx, int64_t C, const void* ow, int owt, int64_t nb,
                 float* y) {
  if (M < 1 || N < 1 || K < 1 || C < 0 || nb < 4 || nb % 4 != 0) return -1;
  if (N4 != 0 && (N4 != N - N % w8::kTileRows || K % w8::kTileChunk != 0)) return -1;
  const int64_t Kp = ceil_div(K, w8::kPad) * w8::kPad;
  std::vector<int8_t> qx(M * Kp);
  std::vector<uint8_t> ax(M * Kp);
  std::vector<float> sx(M), xo(M * C), row(K);
  for (int64_t m = 0; m < M; ++m) {
    std::copy_n(x + m * K, K, row.data());
    sx[m] = w8::quantize_row(row.data(), K, idx, C, Kp, isa != kIsaScalar, qx.data() + m * Kp,
                             ax.data() + m * Kp, xo.data() + m * C);
  }
  const bool epilogue_outliers = C != 0 && M == 1;
  const w8::Args a{M, N, K, Kp, N4, w, ws, static_cast<ScaleType>(wst), qx.data(), ax.data(), sx.data(),
                   epilogue_outliers ? C : 0, xo.data(), epilogue_outliers ? ow : nullptr,
                   static_cast<ScaleType>(owt), y};
  for_blocks(M, N, nb, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (isa == kIsaScalar) w8::block_scalar(a, m0, m1, n0, n1);
    else if (isa == kIsaAvx2) w8::block_avx2(a, m0, m1, n0, n1);
    else w8::block_vnni(a, m0, m1, n0, n1);
  });
  if (C && !epilogue_outliers) {
    w8::Args b = a;
    b.C = C, b.ow = ow, b.owt = static_cast<ScaleType>(owt);
    std::vector<float> panel(16 * C);
    if (isa == kIsaScalar) w8::outlier_products_scalar(b, 0, M, 0, N);
    else w8::outlier_products_avx2(b, 0, M, 0, N, panel.data());
  }
  return 0;
}

// simd_common.h's fp16 -> fp32 conversion (the kernels' fp16 scale loads), for an
// exhaustive check against torch.
float cpk_emu_half_to_float(uint16_t h) { return half_to_float(h); }

}  // extern "C"
