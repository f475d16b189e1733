// Tile geometry of the W8A8 int8 tensor-core kernel, shared by the kernel and
// the host emulation.
//
// Block: 128 threads = 4 warps, tile BM x 128 (BM = 16*MT), k-tile 128 int8.
// Warp w owns columns [32w, 32w+32) (four n8 tiles) and all BM rows.
// Both operands are row-major int8 with k contiguous: x_q [M, K] is the mma A
// operand ("row"), and W [N, K] row-major is exactly B [K, N] "col", so the
// weights need no load-time shuffle. Shared memory per stage (16-byte chunks,
// 128-byte rows, XOR-swizzled with swz128):
//   A: BM rows x 8 chunks     B: 128 rows (n) x 8 chunks
// One ldmatrix.x4 on 16 B-rows x 32 bytes yields (b0, b0', b1, b1') for the two
// n8 tiles of an n16 tile: regs 0/2 -> n8 tile 0, regs 1/3 -> n8 tile 1.
#pragma once

#include "cpk_common.cuh"

namespace cpk {

constexpr int kW8Threads = 128;
constexpr int kW8Stages = 3;
constexpr int kW8TileN = 128;
constexpr int kW8TileK = 128;

template <int MT>
struct W8Tile {
  static constexpr int kBM = 16 * MT;
  static constexpr int kAChunks = kBM * 8;
  static constexpr int kBChunks = kW8TileN * 8;
  static constexpr int kStageChunks = kAChunks + kBChunks;
  static constexpr int kSmemBytes = kW8Stages * kStageChunks * 16;
};

// i-th chunk copied by thread tid (A: 0 <= i < MT, B: 0 <= i < 8): tile row, chunk.
CPK_HD RowCol w8_copy(int tid, int i) {
  const int idx = tid + i * kW8Threads;
  return {idx >> 3, idx & 7};
}
// ldmatrix.x4 source chunk (row, chunk before swizzle) for A m16 tile mt, k32 step ks.
CPK_HD RowCol w8_a_ldsm(int lane, int mt, int ks) { return {mt * 16 + ldsm_x4_row(lane), ks * 2 + ldsm_x4_chunk(lane)}; }
// ... for B n16 tile j of warp.
CPK_HD RowCol w8_b_ldsm(int lane, int warp, int j, int ks) {
  return {warp * 32 + j * 16 + ldsm_x4_row(lane), ks * 2 + ldsm_x4_chunk(lane)};
}
// Output coordinate of accumulator (mt, nt8, i), relative to the block.
CPK_HD RowCol w8_acc_coord(int warp, int mt, int nt8, int lane, int i) {
  const RowCol c = mma_c(lane, i);
  return {mt * 16 + c.row, warp * 32 + nt8 * 8 + c.col};
}

}  // namespace cpk
