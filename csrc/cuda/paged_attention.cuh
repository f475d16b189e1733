// Paged decode attention (compress::paged_decode_attention): the __host__ __device__ parts
// of the kernels in paged_attention.cu, so the host harness (tests/host_harness.cu) runs the
// kernels' own addressing, softmax and combine on the CPU and tests/csrc/test_cuda_host.py
// compares them with compress/ops/reference.py.
//
// Two kernels; set_paged_attention_kernel (kernels.h) picks one, the split kernel by default:
// * split (below, kSplit*): one block per (row, kv head, up to 8 of its query heads, 256
//   positions): the table walk and the K / V rows read once per GQA group, thread per key,
//   and a combine kernel for rows of more than one split.
// * heads (the baseline): one block per (row, query head), kPagedWarps warps: warp w takes the
//   row's keys first + w, first + w + kPagedWarps, ..., loading several before it reduces
//   the first; lane l holds head-dim elements l, l + 32, ... (up to kPagedMaxChunks). Each
//   warp keeps an online softmax (running max m, sum l, and the weighted value sum) over its
//   keys; the block then combines the warps' partials.
// Scores are kept in base 2 (q pre-scaled by log2(e) / sqrt(D)), so each update is exp2.
//
// int8 pools (kv_cache_dtype int8, compress/ops/kv_int8.py): a row is head_dim int8
// values, then its fp32 scale in the next 4 bytes (pool [NB, Hkv, BS, D + 4]); an element
// reads back as float(q) * scale, the CPU kernels' bits (csrc/cpu/kv_int8.h).
#pragma once

#include <cstdint>

#include "cpk_common.cuh"

namespace cpk {

constexpr int kPagedWarps = 8;
constexpr int kPagedMaxChunks = 8;  // head_dim <= 32 * 8
// Keys a warp loads before it reduces the first (the kernel's U): 16 row chunks in flight
// a lane whatever head_dim is (head_dim <= 64: 8 keys; <= 128: 4; <= 256: 2). The keys are
// still folded in position order, so U does not move a bit.
constexpr int paged_keys_in_flight(int chunks) { return chunks <= 2 ? 8 : chunks <= 4 ? 4 : 2; }
constexpr int kPagedMaxHeadDim = 32 * kPagedMaxChunks;
constexpr float kLog2e = 1.4426950408889634f;

// The positions a row attends to: first .. end - 1 with end = its context length (clamped
// to the table's capacity: an out-of-contract length reads nothing outside the table) and
// first = end - window when 0 < window < end.
struct PagedSpan {
  int first, end;
};
CPK_HD PagedSpan paged_span(int context_len, int window, int capacity) {
  const int end = context_len < 0 ? 0 : (context_len > capacity ? capacity : context_len);
  return {window > 0 && end > window ? end - window : 0, end};
}

// Element offset of position `pos`'s row of kv head `hk` in a pool with strides (block,
// head, slot), or -1 when the row's block table names no block of the pool there (out of
// contract: the key is left out and no memory outside the pool is read).
CPK_HD long long paged_row_offset(const int32_t* table_row, int pos, int block_size, int num_blocks, int hk,
                                  long long s_block, long long s_head, long long s_slot) {
  const int blk = table_row[pos / block_size];
  if (blk < 0 || blk >= num_blocks) return -1;
  return blk * s_block + hk * s_head + static_cast<long long>(pos % block_size) * s_slot;
}

CPK_HD float paged_exp2(float x) {
#if defined(__CUDA_ARCH__)
  return exp2f(x);
#else
  return __builtin_exp2f(x);
#endif
}

// A warp's running softmax: max m (base-2 scores), sum l of 2^(s - m). add() takes one
// score and returns (the factor to rescale the value sums by, the new key's weight).
struct OnlineSoftmax {
  float m, l;
  CPK_HD void init() {
    m = -__builtin_huge_valf();
    l = 0.f;
  }
  CPK_HD void add(float s, float* rescale, float* weight) {
    const float m_new = s > m ? s : m;
    *rescale = paged_exp2(m - m_new);  // 0 for the first key (m = -inf)
    *weight = paged_exp2(s - m_new);
    l = l * *rescale + *weight;
    m = m_new;
  }
};

// The fp32 scale that follows an int8 row's D values: its 4 bytes little-endian, read a
// byte at a time because a row of odd D + 4 bytes leaves it unaligned.
CPK_HD float paged_int8_row_scale(const int8_t* row, int D) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<uint8_t>(row[D])) |
                        static_cast<uint32_t>(static_cast<uint8_t>(row[D + 1])) << 8 |
                        static_cast<uint32_t>(static_cast<uint8_t>(row[D + 2])) << 16 |
                        static_cast<uint32_t>(static_cast<uint8_t>(row[D + 3])) << 24;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float s;
  __builtin_memcpy(&s, &bits, sizeof(s));
  return s;
#endif
}

// Combine of the warps' partials: the largest max, and each warp's factor 2^(m_w - M)
// (0 for a warp that saw no key); out[d] = sum_w f_w acc_w[d] / sum_w f_w l_w.
CPK_HD float paged_combine_max(const float* m, int warps) {
  float mx = -__builtin_huge_valf();
  for (int w = 0; w < warps; ++w) mx = m[w] > mx ? m[w] : mx;
  return mx;
}
CPK_HD float paged_combine_factor(float m_w, float m_all) {
  return m_w == -__builtin_huge_valf() ? 0.f : paged_exp2(m_w - m_all);
}

// Launch geometry: grid (rows, query heads); the grid's y dimension holds up to 65535.
constexpr int kPagedMaxHeads = 65535;

// ---- the split kernel (the default): one block per (row, kv head, group of up to
// kSplitHeads of its query heads, split of kSplitKeys positions), kSplitWarps warps ----
//
//   scores:  thread j takes the split's key j: it reads the key's whole row (16-byte loads
//            where the pool allows, several in flight) and folds q . k for each of the
//            block's query heads, d = 0, 1, ... in order (q pre-scaled by log2 e / sqrt D)
//   softmax: warp w takes heads w, w + kSplitWarps, ...: the max over the split's scores,
//            p = 2^(s - max), and the sum l (lane j adds keys j, j + 32, ... in order, then
//            the 16-8-4-2-1 butterfly, the same bits on every lane)
//   p.V:     warp w folds keys 32 w .. 32 w + 31 in order (lane l: columns l, l + 32, ...)
//            for every head; then the warps' sums are added in warp order
//   out:     a row of one split writes acc / l; more splits write (max, l, acc) and the
//            combine kernel folds them in split order (paged_combine_*)
//
// The split length is fixed, so a row's bits depend on its own span alone, never on the
// batch it runs in or the table's width.
constexpr int kSplitKeys = 256;
constexpr int kSplitHeads = 8;
constexpr int kSplitWarps = 8;
constexpr int kSplitThreads = 32 * kSplitWarps;      // a thread per key of the scores
constexpr int kSplitKeysAWarp = kSplitKeys / kSplitWarps;  // p.V: warp w's keys 32 w ..

// Splits of a span of n positions: at least one, so every row's first split writes its
// output (zeros for a row with no key).
CPK_HD int paged_splits(int n) { return n <= kSplitKeys ? 1 : (n + kSplitKeys - 1) / kSplitKeys; }

// Block number of position `pos` in a row's table, or -1 when the entry names no block of
// the pool (out of contract: the key is left out).
CPK_HD int paged_block_of(const int32_t* table_row, int pos, int block_size, int num_blocks) {
  const int blk = table_row[pos / block_size];
  return blk < 0 || blk >= num_blocks ? -1 : blk;
}

}  // namespace cpk
