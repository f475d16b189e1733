// What the two ops on the weight-row-lane layout share (w4a8_lanes.cpp: int8 activation
// blocks; w4a16_lanes.cpp: float activations): the layout's constants, the argument
// checks, the prefetch of a tile's group metadata and the split into passes over the
// weights. The layout: reference.w4a8_prepare_lanes (per tile of 16 rows, per 64-k chunk,
// word j of the 16 rows side by side; fp32 scales and uint8 zero points [K/G, N]).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "cpu/kernel_common.h"

namespace compress_cpu {
namespace lanes {

constexpr int64_t kLaneRows = 16;            // weight rows a tile (zmm lanes)
constexpr int64_t kTileChunkBytes = 8 * 64;  // one 64-k chunk of a tile: 8 words x 16 rows

// Group sizes an op takes: the int8 op's blocks (32, or a multiple of 64), or any multiple
// of 8 (whole words) for the float op.
enum class Groups { kInt8Blocks, kWords };

// Errors name `op` and the argument (w4a8_lanes.cpp).
void check_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                const at::Tensor& zeros, int64_t G, Groups groups);

// The group metadata lines of the tile whose first row is `row` (one line per group of
// each [NG, N] tensor, N * 4 and N bytes apart: a stride the hardware prefetcher does not
// follow; without this the int8 op ran at 0.63-0.91x the row-tiled kernels at 1-16 rows).
inline void prefetch_tile_metadata(const float* s, const uint8_t* z, int64_t N, int64_t NG, int64_t row) {
  for (int64_t g = 0; g < NG; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(s + g * N + row), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(z + g * N + row), _MM_HINT_T0);
  }
}

// Rows [0, M) in passes of `rows_per_pass` (their activations stay in L2 while every tile
// reads them); per pass the T tiles in contiguous runs per thread, so at few rows each
// thread streams one run of weights: run(m0, rows, t0, t1).
template <typename Run>
void for_passes(int64_t M, int64_t rows_per_pass, int64_t T, const Run& run) {
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_pass) {
    const int64_t rows = std::min(rows_per_pass, M - m0);
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) { run(m0, rows, t0, t1); });
  }
}

}  // namespace lanes
}  // namespace compress_cpu
