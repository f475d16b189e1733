// compress._C.compute_peak(recipe, iters): the arithmetic ceiling of this CPU for the
// instruction mixes our GEMM tiles use, the compute counterpart of stream_read_sum's
// bandwidth. Each thread of the intra-op pool runs a register-only loop (no loads, no
// stores) of one tile's inner step `iters` times; `compress bench kernels` times it and
// holds large-M results against it. Operands are 1, so the returned sum of all
// accumulator lanes equals the multiply-accumulates done (a check that no work was
// folded away). An empty asm statement "changes" the weight registers and the activation
// pointer every iteration, so the compiler cannot hoist the per-step work out of the loop
// and reloads the activations from L1 each step, as the tiles do.
//   fp32_fma   12 accumulators x 8 lanes, 12 FMAs per step (an AVX2 sgemm micro-tile)
//   int8_avx2  the W8A8 AVX2 4 x 2 tile: per step 4 vpabsb and 8 x (vpsignb, vpmaddubsw,
//              vpmaddwd, vpaddd), 256 MACs
//   int16_avx2 the W8A8 int16 6 x 16 tile itself (w8a8_i16_avx2.inc's tile_i16<6>, AVX2
//              without VNNI, many rows) on L1-resident operands: per step (one k pair) 2
//              panel loads, 6 int32 broadcasts and 12 x (vpmaddwd, vpaddd), 192 MACs
//   int8_vnni  the W8A8 VNNI 4 x 4 tile: 16 x (masked vpsubb, vpdpbusd) on 64 bytes, 1024 MACs
//   fp32_fma512 12 accumulators x 16 lanes, 12 AVX-512 FMAs per step: the fp32 ceiling of
//              CPUs with AVX-512, where MKL's sgemm runs on zmm (fp32_fma would put its
//              matmul above 100%)
//   amx_int8   the W8A8 AMX 32 x 32 block (w8a8_amx.inc) on tiles loaded once: 4 tdpbssd
//              per step, 65536 MACs (needs AMX-INT8 and the OS's permission, amx_int8_available)
#include <Python.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>

#include "cpu/amx_common.h"
#include "cpu/kernel_common.h"
#include "cpu/w8a8_common.h"

// The W8A8 int16 tile, for the int16_avx2 recipe: the same source and target as in
// w8a8_kernel.cpp (an inline function must be the same in every file that defines it).
namespace compress_cpu {
namespace w8 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "cpu/w8a8_i16_avx2.inc"
static int64_t peak_int16_avx2(int64_t iters, int16_t one) {  // this file only
  // The kernel's own 6 x 16 tile (tile_i16<6>) on L1-resident operands: a panel of
  // kRun pairs and six activation rows of them (22 KiB), run after run with its sums
  // carried in `sums` as between K blocks (12 loads and stores per kRun pairs). Runs of
  // 32 pairs read ~30% lower (53 against 74-79 GMAC/s on one thread).
  constexpr int64_t kRun = 256;
  alignas(32) int16_t panel[kRun * 32], x16[6 * 2 * kRun];
  std::fill(panel, panel + kRun * 32, one);
  std::fill(x16, x16 + 6 * 2 * kRun, one);
  alignas(32) int32_t sums[6 * kI16Cols] = {};
  Args a{};
  a.M = 6, a.Kp = 2 * kRun;  // x16 rows lie Kp int16 apart
  for (int64_t done = 0; done < iters;) {
    const int64_t run = std::min(kRun, iters - done);
    tile_i16<6>(a, x16, panel, run, 0, 0, 0, kI16Cols, nullptr, sums, /*first=*/done == 0, /*last=*/false);
    done += run;
  }
  int64_t s = 0;
  for (int32_t v : sums) s += v;
  return s;
}
#pragma GCC pop_options
}  // namespace w8
}  // namespace compress_cpu

namespace compress_cpu {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")
int64_t peak_fp32_fma(int64_t iters, float one) {
  __m256 acc[12];
  for (auto& a : acc) a = _mm256_setzero_ps();
  __m256 x0 = _mm256_set1_ps(one), x1 = x0;
  for (int64_t it = 0; it < iters; ++it) {
    for (int j = 0; j < 6; ++j) acc[j] = _mm256_fmadd_ps(x0, x1, acc[j]);
    for (int j = 6; j < 12; ++j) acc[j] = _mm256_fmadd_ps(x1, x0, acc[j]);
    __asm__ volatile("" : "+x"(x0), "+x"(x1));
  }
  double s = 0;
  for (auto& a : acc) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, a);
    for (float v : lanes) s += v;
  }
  return static_cast<int64_t>(s);
}

int64_t peak_int8_avx2(int64_t iters, int8_t one) {
  __m256i acc[4][2];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i w0 = _mm256_set1_epi8(one), w1 = w0;
  alignas(32) int8_t x[4][32];  // the activation rows, loaded every step as the tile does
  std::memset(x, one, sizeof(x));
  const int8_t* xp = &x[0][0];
  for (int64_t it = 0; it < iters; ++it) {
    for (int m = 0; m < 4; ++m) {
      const __m256i xm = _mm256_load_si256(reinterpret_cast<const __m256i*>(xp + 32 * m));
      const __m256i ax = _mm256_abs_epi8(xm);
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xm)), ones));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xm)), ones));
    }
    __asm__ volatile("" : "+x"(w0), "+x"(w1), "+r"(xp));
  }
  int64_t s = 0;
  for (auto& row : acc)
    for (auto& a : row) s += hsum256_epi32(a);
  return s;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
int64_t peak_int8_vnni(int64_t iters, int8_t one) {
  // Sixteen named accumulators (4 rows x 4 weight vectors): GCC 12 kept an array of them
  // in memory, a store per vpdpbusd, which had halved this peak.
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00,
          c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
  const __m512i zero = _mm512_setzero_si512();
  __m512i w0 = _mm512_set1_epi8(one), w1 = w0, w2 = w0, w3 = w0;
  alignas(64) int8_t ax[4][64];  // |x| rows, loaded every step as the tile does
  std::memset(ax, one, sizeof(ax));
  const __mmask64 neg = 0;  // x >= 0: the masked negate runs and changes nothing
  const int8_t* ap = &ax[0][0];
  for (int64_t it = 0; it < iters; ++it) {
    const __m512i a0 = _mm512_load_si512(ap), a1 = _mm512_load_si512(ap + 64), a2 = _mm512_load_si512(ap + 128),
                  a3 = _mm512_load_si512(ap + 192);
#define COMPRESS_VNNI_COLUMN(w, r0, r1, r2, r3)                       \
  {                                                                  \
    const __m512i ws = _mm512_mask_sub_epi8(w, neg, zero, w);         \
    r0 = _mm512_dpbusd_epi32(r0, a0, ws);                            \
    r1 = _mm512_dpbusd_epi32(r1, a1, ws);                            \
    r2 = _mm512_dpbusd_epi32(r2, a2, ws);                            \
    r3 = _mm512_dpbusd_epi32(r3, a3, ws);                            \
  }
    COMPRESS_VNNI_COLUMN(w0, c00, c10, c20, c30)
    COMPRESS_VNNI_COLUMN(w1, c01, c11, c21, c31)
    COMPRESS_VNNI_COLUMN(w2, c02, c12, c22, c32)
    COMPRESS_VNNI_COLUMN(w3, c03, c13, c23, c33)
#undef COMPRESS_VNNI_COLUMN
    __asm__ volatile("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3), "+r"(ap));
  }
  int64_t s = 0;  // each lane's sum stays below 2^31: iters <= 2^24
  for (const __m512i& v : {c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33})
    s += _mm512_reduce_add_epi32(v);
  return s;
}
#pragma GCC pop_options

// The W4A8 panel GEMM's inner step (w4a8_panel.inc, one 16-row m-block against 12
// weight rows): one activation load, and per weight row a 4-byte broadcast (the u8
// operand) into a zmm vpdpbusd; the per-block conversion and FMAs are left out.
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
int64_t peak_int8_vnni_panel(int64_t iters, int8_t one) {
  // Twelve named accumulators: GCC 12 kept an array of them in memory (a store per
  // vpdpbusd), whatever the asm statement named.
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
          a9 = a0, a10 = a0, a11 = a0;
  alignas(64) int32_t ax[16];
  alignas(64) int32_t wb[12];
  std::memset(ax, one, sizeof(ax));
  std::memset(wb, one, sizeof(wb));
  const __m512i* ap = reinterpret_cast<const __m512i*>(ax);
  const int32_t* wp = wb;
  for (int64_t it = 0; it < iters; ++it) {
    const __m512i x = _mm512_load_si512(ap);
#define COMPRESS_PANEL_STEP(acc, n) acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(wp[n]), x)
    COMPRESS_PANEL_STEP(a0, 0); COMPRESS_PANEL_STEP(a1, 1); COMPRESS_PANEL_STEP(a2, 2); COMPRESS_PANEL_STEP(a3, 3);
    COMPRESS_PANEL_STEP(a4, 4); COMPRESS_PANEL_STEP(a5, 5); COMPRESS_PANEL_STEP(a6, 6); COMPRESS_PANEL_STEP(a7, 7);
    COMPRESS_PANEL_STEP(a8, 8); COMPRESS_PANEL_STEP(a9, 9); COMPRESS_PANEL_STEP(a10, 10); COMPRESS_PANEL_STEP(a11, 11);
#undef COMPRESS_PANEL_STEP
    __asm__ volatile("" : "+r"(ap), "+r"(wp));
  }
  int64_t s = 0;  // each lane's sum stays below 2^31: iters <= 2^24
  for (const __m512i& v : {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11}) s += _mm512_reduce_add_epi32(v);
  return s;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
int64_t peak_fp32_fma512(int64_t iters, float one) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 x0 = _mm512_set1_ps(one), x1 = x0;
  for (int64_t it = 0; it < iters; ++it) {
    for (int j = 0; j < 6; ++j) acc[j] = _mm512_fmadd_ps(x0, x1, acc[j]);
    for (int j = 6; j < 12; ++j) acc[j] = _mm512_fmadd_ps(x1, x0, acc[j]);
    __asm__ volatile("" : "+v"(x0), "+v"(x1));
  }
  double s = 0;
  for (auto& a : acc) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, a);
    for (float v : lanes) s += v;
  }
  return static_cast<int64_t>(s);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,amx-tile,amx-int8")
// Tiles 0-3 accumulate, 4-5 and 6-7 hold the operands (all 16 x 64 bytes of ones), as
// in block_amx's 32 x 32 block; the loads happen once, so this is tdpbssd's ceiling.
int64_t peak_amx_int8(int64_t iters, int8_t one) {
  amx_load_config_16x64();
  alignas(64) int8_t ones[16 * 64];
  std::memset(ones, one, sizeof(ones));
  alignas(64) int32_t sums[4][16 * 16];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (int64_t it = 0; it < iters; ++it) {  // each int32 lane ends at 64 * iters <= 2^30
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  amx_release();
  int64_t s = 0;
  for (auto& t : sums)
    for (int32_t v : t) s += v;
  return s;
}
#pragma GCC pop_options

}  // namespace

// Runs `recipe` on every thread of the intra-op pool; returns the summed lanes (= MACs).
// Throws std::invalid_argument for an unknown recipe, std::runtime_error when the CPU
// (or, for our tiles' recipes, the ISA cap) does not allow it. The fp32 recipes ignore
// the cap: they are the ceiling of the fp32 matmul we are compared with, which runs on
// whatever the CPU has.
int64_t compute_peak(const char* recipe, int64_t iters) {
  int64_t (*loop)(int64_t) = nullptr;
  if (std::strcmp(recipe, "fp32_fma") == 0) {
    if (detected_isa() < Isa::Avx2) throw std::runtime_error("fp32_fma needs AVX2 + FMA");
    loop = [](int64_t n) { return peak_fp32_fma(n, 1.f); };
  } else if (std::strcmp(recipe, "int8_avx2") == 0) {
    if (active_isa() < Isa::Avx2) throw std::runtime_error("int8_avx2 needs AVX2");
    loop = [](int64_t n) { return peak_int8_avx2(n, 1); };
  } else if (std::strcmp(recipe, "int16_avx2") == 0) {
    if (active_isa() < Isa::Avx2) throw std::runtime_error("int16_avx2 needs AVX2");
    loop = [](int64_t n) { return w8::peak_int16_avx2(n, 1); };
  } else if (std::strcmp(recipe, "int8_vnni") == 0) {
    if (active_isa() < Isa::Avx512Vnni) throw std::runtime_error("int8_vnni needs AVX-512 VNNI");
    loop = [](int64_t n) { return peak_int8_vnni(n, 1); };
  } else if (std::strcmp(recipe, "int8_vnni_panel") == 0) {
    if (active_isa() < Isa::Avx512Vnni) throw std::runtime_error("int8_vnni_panel needs AVX-512 VNNI");
    loop = [](int64_t n) { return peak_int8_vnni_panel(n, 1); };
  } else if (std::strcmp(recipe, "fp32_fma512") == 0) {
    if (detected_isa() < Isa::Avx512Vnni) throw std::runtime_error("fp32_fma512 needs AVX-512");
    loop = [](int64_t n) { return peak_fp32_fma512(n, 1.f); };
  } else if (std::strcmp(recipe, "amx_int8") == 0) {
    if (active_isa() < Isa::Avx512Vnni || !amx_int8_available())
      throw std::runtime_error("amx_int8 needs AMX-INT8 (and the OS's permission to use it)");
    loop = [](int64_t n) { return peak_amx_int8(n, 1); };
  } else {
    throw std::invalid_argument(
        "unknown recipe; choose fp32_fma, int8_avx2, int16_avx2, int8_vnni, int8_vnni_panel, fp32_fma512 or "
        "amx_int8");
  }
  const int threads = at::get_num_threads();
  std::atomic<int64_t> total{0};
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) total += loop(iters);
  });
  return total.load();
}

}  // namespace compress_cpu

// Python: compress._C.compute_peak(recipe: str, iters: int) -> int (registered in module.cpp).
PyObject* py_compute_peak(PyObject*, PyObject* args) {
  const char* recipe = nullptr;
  long long iters = 0;
  if (!PyArg_ParseTuple(args, "sL", &recipe, &iters)) return nullptr;
  if (iters < 0 || iters > (1LL << 24)) {
    PyErr_SetString(PyExc_ValueError, "compute_peak: iters must be in [0, 2^24] (fp32 lanes count exactly)");
    return nullptr;
  }
  try {
    return PyLong_FromLongLong(compress_cpu::compute_peak(recipe, iters));
  } catch (const std::invalid_argument& e) {
    PyErr_Format(PyExc_ValueError, "compute_peak(%s): %s", recipe, e.what());
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "compute_peak(%s): %s", recipe, e.what());
  }
  return nullptr;
}
