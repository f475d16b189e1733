// What the two ops on the weight-row-lane layout share (w4a8_lanes.cpp: int8 activation
// blocks; w4a16_lanes.cpp: float activations): the layout's constants, the argument
// checks, the prefetch of a tile's group metadata and the split into passes over the
// weights. The layout: reference.w4a8_prepare_lanes (per tile of 16 rows, per 64-k chunk,
// word j of the 16 rows side by side; fp32 scales and uint8 zero points [tiles, K/G, 16],
// a tile's metadata contiguous; rows past N zero). N is an argument of the ops.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu/kernel_common.h"
#include "cpu/simd_common.h"

namespace compress_cpu {
namespace lanes {

constexpr int64_t kLaneRows = 16;            // weight rows a tile (zmm lanes)
constexpr int64_t kTileChunkBytes = 8 * 64;  // one 64-k chunk of a tile: 8 words x 16 rows
// Bytes of the weight stream the tiles prefetch ahead (prefetcht0; 1-8 KiB and an extra
// prefetcht1 16-32 KiB ahead measured alike on the 345M model's shapes).
constexpr int64_t kPrefetchAhead = 4096;
// Activation bytes a pass over the weights takes: every tile reads all of a pass's rows,
// which should stay in L2 (int8 op at 512-row prefill steps: 1.15x against one pass over
// all rows, K = 2816 rows had left L2; 128 / 512 KiB 1.09x / 1.11x).
constexpr int64_t kActBudget = 256 << 10;

// Fewest activation rows for which the int8 op on AVX-512 VNNI runs two tiles a call
// (w4a8_lanes.cpp; the same bits as one a call; default 12); set returns the previous value.
int64_t set_pair_min_rows(int64_t rows);
int64_t pair_min_rows();

// Fewest activation rows for which the int8 op takes the AMX-INT8 tiles
// (w4a8_lanes_amx.inc; the same bits as the AVX-512 tiles) where the CPU and OS allow
// AMX; set returns the previous value.
constexpr int64_t kAmxMinRows = 64;
int64_t set_amx_min_rows(int64_t rows);
int64_t amx_min_rows();

// Group sizes an op takes: the int8 op's blocks (32, or a multiple of 64), or any multiple
// of 8 (whole words) for the float op.
enum class Groups { kInt8Blocks, kWords };

// Errors name `op` and the argument (w4a8_lanes.cpp).
void check_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                const at::Tensor& zeros, int64_t G, int64_t n, Groups groups);

// Tile t's group metadata (NG x 64 bytes of scales, NG x 16 of zero points), prefetched
// while the tile before it runs. With the metadata as [K/G, N] (a line per group, N * 4
// bytes apart) the int8 op had run at 0.78x the row-tiled kernels at M = 1 on 7B shapes
// even so.
inline void prefetch_tile_metadata(const float* s, const uint8_t* z, int64_t NG, int64_t t) {
  const char* sp = reinterpret_cast<const char*>(s + t * NG * kLaneRows);
  const char* zp = reinterpret_cast<const char*>(z + t * NG * kLaneRows);
  for (int64_t b = 0; b < NG * kLaneRows * 4; b += 64) _mm_prefetch(sp + b, _MM_HINT_T0);
  for (int64_t b = 0; b < NG * kLaneRows; b += 64) _mm_prefetch(zp + b, _MM_HINT_T0);
}

// Rows [0, M) in passes of kActBudget bytes of activations (`row_bytes` a row), a multiple
// of `unit` rows (a tile call's); per pass the T tiles in contiguous runs per thread, so at
// few rows each thread streams one run of weights, the runs' tails taken over by a thread
// that is done (parallel_parts_stealing): run(m0, rows, t0, t1).
template <typename Run>
void for_passes(int64_t M, int64_t row_bytes, int64_t unit, int64_t T, const Run& run) {
  const int64_t rows_per_pass = std::max<int64_t>(unit, kActBudget / row_bytes / unit * unit);
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_pass) {
    const int64_t rows = std::min(rows_per_pass, M - m0);
    const auto tiles = [&](int64_t t0, int64_t t1) { run(m0, rows, t0, t1); };
    if (parts::g_stealing.load(std::memory_order_relaxed))   // pairs of tiles, ~8 takes a thread
      parallel_parts_stealing(T, 2, std::max<int64_t>(2, ceil_div(T, 16 * at::get_num_threads()) * 2), tiles);
    else
      at::parallel_for(0, T, 1, tiles);
  }
}

// The AVX2 forms' order of work on tiles t0 .. t1: each tile's rows 0-7, then 8-15 (a ymm
// holds 8 lanes), activation rows in pairs then a last single one:
// run(t, half, m0, pair), after prefetching the next tile's metadata.
template <typename Run>
void for_half_tiles(int64_t T, int64_t M, const float* s, const uint8_t* z, int64_t NG, int64_t t0, int64_t t1,
                    const Run& run) {
  for (int64_t t = t0; t < t1; ++t) {
    if (t + 1 < T) prefetch_tile_metadata(s, z, NG, t + 1);
    for (int64_t half = 0; half < 2; ++half) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) run(t, half, m, true);
      if (m < M) run(t, half, m, false);
    }
  }
}

// A half tile's 8 sums into y[0 .. cols) (cols <= 8: the last tile's rows past N stay out).
COMPRESS_TARGET("avx2") inline void store_half_tile(float* y, __m256 v, int64_t cols) {
  if (cols == 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(y, tmp, cols * sizeof(float));
}

}  // namespace lanes
}  // namespace compress_cpu
