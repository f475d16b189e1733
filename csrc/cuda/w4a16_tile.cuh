// Tile geometry of the W4A16 tensor-core kernel, shared by the kernel and the
// host emulation (csrc/cuda/tests/host_harness.cu).
//
// Block: 128 threads = 4 warps, tile BM x 128 (BM = 16*MT, MT in {1, 2, 4}),
// k-tile 64. Warp w owns output columns [32w, 32w+32) of the tile (two n16
// tiles = four n8 tiles) and all BM rows (MT m16 tiles).
//
// Shared memory per pipeline stage (16-byte chunks):
//   A: BM rows x 8 chunks (64 halves), XOR-swizzled (swz128)   ->  BM*128 B
//   B: 8 n16-tiles x 32 lanes x 16 B (4 shuffled words)          ->  4096 B
#pragma once

#include "int4_layout.cuh"

namespace cpk {

constexpr int kW4Threads = 128;
constexpr int kW4Stages = 4;

template <int MT>
struct W4Tile {
  static constexpr int kBM = 16 * MT;
  static constexpr int kAChunks = kBM * 8;
  static constexpr int kBChunks = 256;
  static constexpr int kStageChunks = kAChunks + kBChunks;
  static constexpr int kSmemBytes = kW4Stages * kStageChunks * 16;
};

// i-th (0 <= i < MT) A chunk copied by thread tid: row and 16-byte chunk in the tile.
CPK_HD RowCol w4_a_copy(int tid, int i) {
  const int idx = tid + i * kW4Threads;
  return {idx >> 3, idx & 7};
}
// i-th (0 <= i < 2) B chunk copied by thread tid: n16 tile in the block and lane chunk.
CPK_HD RowCol w4_b_copy(int tid, int i) {
  const int idx = tid + i * kW4Threads;
  return {idx >> 5, idx & 31};
}
// Output coordinate of accumulator (mt, nt8, i) of lane in warp, relative to the block.
CPK_HD RowCol w4_acc_coord(int warp, int mt, int nt8, int lane, int i) {
  const RowCol c = mma_c(lane, i);
  return {mt * 16 + c.row, warp * 32 + nt8 * 8 + c.col};
}
// Column (relative to the block) whose scale / zero n8 sub-tile h of n16 tile j uses.
CPK_HD int w4_scale_col(int warp, int j, int h, int lane) { return warp * 32 + j * 16 + h * 8 + (lane >> 2); }

// Rows per block: 16 * MT, MT = 1 / 2 / 4 for M <= 16 / <= 32 / more.
CPK_HD int w4_block_rows(int m) { return m <= 16 ? 16 : (m <= 32 ? 32 : 64); }

// Batch invariance: a row's result depends only on its own activations and on
// the split-K partition (each split sums its k-tiles in order, the reduce adds the
// splits in order; the other rows of the batch and MT do not enter). Up to
// kW4InvariantRows rows the grid has one block row, so the split count below
// depends on N, K and the SM count only: a decode batch of up to 64 rows gives
// every row the bits it gets alone. Above that the split count falls with M (no
// split-K once the grid fills the GPU), and a row may differ from its result
// alone by the fp32 rounding of the other partition (a last-bit difference after
// rounding to fp16 / bf16; tests/csrc/test_cuda_ops.py holds it to 2 ulp).
constexpr int kW4InvariantRows = 64;
CPK_HD int w4_splits(int m, int np, int kp, int sms) {
  return choose_splits(ceil_div(m, w4_block_rows(m)) * (np / kW4TileN), kp / kW4TileK, sms, 4);
}

}  // namespace cpk
