// The paged decode attention kernels (paged_attention.cu) emulated on the host with their
// own helpers (paged_attention.cuh), in each kernel's order of operations, and their C
// entry points for tests/csrc/test_cuda_host.py. Included by host_harness.cu.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../paged_attention.cuh"

using namespace cpk;

// The paged attention kernel (paged_attention.cu) for every (row, head) block, run by its
// own helpers: each of the kPagedWarps warps walks its positions with paged_row_offset
// and its OnlineSoftmax (the lanes' partial dots summed in the kernel's butterfly order),
// then the block combines the warps. Pools contiguous [num_blocks, n_kv_heads,
// block_size, head_dim] (float) or [.., head_dim + 4] (int8 rows, each element read as
// float(q) * paged_int8_row_scale, as the kernel reads it); q, out [rows, n_heads, head_dim].
template <typename TKV>
static void paged_attention_emulated(const float* q, const TKV* k_pool, const TKV* v_pool, const int32_t* tables,
                                     const int32_t* lens, int rows, int n_heads, int n_kv_heads, int head_dim,
                                     int num_blocks, int block_size, int table_cols, int window, float* out) {
  constexpr bool kInt8 = std::is_same_v<TKV, int8_t>;
  const int D = head_dim;
  const long long s_slot = kInt8 ? D + 4 : D, s_head = static_cast<long long>(block_size) * s_slot,
                  s_block = n_kv_heads * s_head;
  auto value = [&](const TKV* row, int d) {
    if constexpr (kInt8) return static_cast<float>(row[d]) * paged_int8_row_scale(row, D);
    else return static_cast<float>(row[d]);
  };
  const float qscale = (1.f / __builtin_sqrtf(static_cast<float>(D))) * kLog2e;   // the kernels' a.scale * kLog2e
  for (int row = 0; row < rows; ++row)
    for (int h = 0; h < n_heads; ++h) {
      const int hk = h / (n_heads / n_kv_heads);
      const float* qr = q + (static_cast<long long>(row) * n_heads + h) * D;
      const PagedSpan span = paged_span(lens[row], window, table_cols * block_size);
      const int32_t* table = tables + static_cast<long long>(row) * table_cols;
      float m[kPagedWarps], l[kPagedWarps];
      std::vector<float> acc(static_cast<size_t>(kPagedWarps) * D, 0.f);
      for (int w = 0; w < kPagedWarps; ++w) {
        OnlineSoftmax sm;
        sm.init();
        for (int pos = span.first + w; pos < span.end; pos += kPagedWarps) {
          const long long off = paged_row_offset(table, pos, block_size, num_blocks, hk, s_block, s_head, s_slot);
          if (off < 0) continue;
          float lane_part[32];
          for (int lane = 0; lane < 32; ++lane) {
            float p = 0.f;
            for (int i = 0; i < kPagedMaxChunks; ++i) {
              const int d = lane + 32 * i;
              if (d < D) p = __builtin_fmaf(qr[d] * qscale, value(k_pool + off, d), p);
            }
            lane_part[lane] = p;
          }
          for (int o = 16; o > 0; o >>= 1) {  // __shfl_xor_sync butterfly: every lane ends with the same sum
            float next[32];
            for (int lane = 0; lane < 32; ++lane) next[lane] = lane_part[lane] + lane_part[lane ^ o];
            std::memcpy(lane_part, next, sizeof(next));
          }
          float rescale, weight;
          sm.add(lane_part[0], &rescale, &weight);
          for (int d = 0; d < D; ++d)
            acc[w * D + d] = __builtin_fmaf(weight, value(v_pool + off, d), acc[w * D + d] * rescale);
        }
        m[w] = sm.m, l[w] = sm.l;
      }
      const float m_all = paged_combine_max(m, kPagedWarps);
      float f[kPagedWarps], denom = 0.f;
      for (int w = 0; w < kPagedWarps; ++w) {
        f[w] = paged_combine_factor(m[w], m_all);
        denom += f[w] * l[w];
      }
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      float* o = out + (static_cast<long long>(row) * n_heads + h) * D;
      for (int d = 0; d < D; ++d) {
        float sum = 0.f;
        for (int w = 0; w < kPagedWarps; ++w) sum = __builtin_fmaf(f[w], acc[w * D + d], sum);
        o[d] = sum * inv;
      }
    }
}

// The split kernel (paged_attention.cu) for every (row, kv head, group of up to kSplitHeads
// query heads, split) block, in its own order: scores d = 0, 1, ... per key; each head's max
// and its lanes' sums over keys j, j + 32, ... then the butterfly; p.V per warp over its 32
// keys in order, the warps' sums added in warp order; a row of one split writes acc / l,
// more splits go through the combine's fold in split order.
// Pools and q / out as paged_attention_emulated's.
template <typename TKV>
static void paged_attention_split_emulated(const float* q, const TKV* k_pool, const TKV* v_pool,
                                           const int32_t* tables, const int32_t* lens, int rows, int n_heads,
                                           int n_kv_heads, int head_dim, int num_blocks, int block_size,
                                           int table_cols, int window, float* out) {
  constexpr bool kInt8 = std::is_same_v<TKV, int8_t>;
  const int D = head_dim, group = n_heads / n_kv_heads;
  const long long s_slot = kInt8 ? D + 4 : D, s_head = static_cast<long long>(block_size) * s_slot,
                  s_block = n_kv_heads * s_head;
  auto value = [&](const TKV* row, int d) {
    if constexpr (kInt8) return static_cast<float>(row[d]) * paged_int8_row_scale(row, D);
    else return static_cast<float>(row[d]);
  };
  const float qscale = (1.f / __builtin_sqrtf(static_cast<float>(D))) * kLog2e;
  const float neg_inf = -__builtin_huge_valf();
  for (int row = 0; row < rows; ++row) {
    const PagedSpan span = paged_span(lens[row], window, table_cols * block_size);
    const int splits = paged_splits(span.end - span.first);
    const int32_t* table = tables + static_cast<long long>(row) * table_cols;
    for (int h = 0; h < n_heads; ++h) {
      const int hk = h / group;
      const float* qr = q + (static_cast<long long>(row) * n_heads + h) * D;
      std::vector<float> m(splits), l(splits), acc(static_cast<size_t>(splits) * D, 0.f);
      for (int split = 0; split < splits; ++split) {
        const int first = span.first + split * kSplitKeys;
        const int n = std::max(0, std::min(kSplitKeys, span.end - first));
        std::vector<float> p(n);
        std::vector<long long> voff(n);
        for (int j = 0; j < n; ++j) {
          const int pos = first + j;
          const int blk = paged_block_of(table, pos, block_size, num_blocks);
          voff[j] = blk < 0 ? -1 : blk * s_block + hk * s_head + static_cast<long long>(pos % block_size) * s_slot;
          float sc = 0.f;
          if (blk >= 0)
            for (int d = 0; d < D; ++d) sc = __builtin_fmaf(qr[d] * qscale, value(k_pool + voff[j], d), sc);
          p[j] = blk >= 0 ? sc : neg_inf;
        }
        float mx = neg_inf;
        for (int j = 0; j < n; ++j) mx = p[j] > mx ? p[j] : mx;
        float lane_sum[32] = {};
        for (int j = 0; j < n; ++j) {
          p[j] = mx == neg_inf ? 0.f : paged_exp2(p[j] - mx);
          lane_sum[j % 32] += p[j];
        }
        for (int o = 16; o > 0; o >>= 1) {  // __shfl_xor_sync butterfly
          float next[32];
          for (int lane = 0; lane < 32; ++lane) next[lane] = lane_sum[lane] + lane_sum[lane ^ o];
          std::memcpy(lane_sum, next, sizeof(next));
        }
        m[split] = mx, l[split] = lane_sum[0];
        std::vector<float> warp_acc(D);
        for (int w = 0; w < kSplitWarps; ++w) {  // warp w: keys 32 w .. 32 w + 31, then added in warp order
          std::fill(warp_acc.begin(), warp_acc.end(), 0.f);
          for (int j = w * kSplitKeysAWarp; j < std::min(n, (w + 1) * kSplitKeysAWarp); ++j) {
            if (voff[j] < 0) continue;
            for (int d = 0; d < D; ++d) warp_acc[d] = __builtin_fmaf(p[j], value(v_pool + voff[j], d), warp_acc[d]);
          }
          for (int d = 0; d < D; ++d) acc[split * D + d] = w == 0 ? warp_acc[d] : acc[split * D + d] + warp_acc[d];
        }
      }
      float* o = out + (static_cast<long long>(row) * n_heads + h) * D;
      if (splits == 1) {
        const float inv = l[0] > 0.f ? 1.f / l[0] : 0.f;
        for (int d = 0; d < D; ++d) o[d] = acc[d] * inv;
        continue;
      }
      float m_all = neg_inf, denom = 0.f;
      for (int s = 0; s < splits; ++s) m_all = m[s] > m_all ? m[s] : m_all;
      for (int s = 0; s < splits; ++s) denom = __builtin_fmaf(paged_combine_factor(m[s], m_all), l[s], denom);
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      for (int d = 0; d < D; ++d) {
        float sum = 0.f;
        for (int s = 0; s < splits; ++s) sum = __builtin_fmaf(paged_combine_factor(m[s], m_all), acc[s * D + d], sum);
        o[d] = sum * inv;
      }
    }
  }
}

// C entry points: name, emulator, pool element type (float pools, or int8 rows [D + 4]).
#define CPK_PAGED_ENTRY(name, emulator, T)                                                                     \
  void name(const float* q, const T* k_pool, const T* v_pool, const int32_t* tables, const int32_t* lens,     \
            int rows, int n_heads, int n_kv_heads, int head_dim, int num_blocks, int block_size,              \
            int table_cols, int window, float* out) {                                                         \
    emulator(q, k_pool, v_pool, tables, lens, rows, n_heads, n_kv_heads, head_dim, num_blocks, block_size,    \
             table_cols, window, out);                                                                        \
  }

extern "C" {

CPK_PAGED_ENTRY(cpk_paged_attention_emulated, paged_attention_emulated, float)
CPK_PAGED_ENTRY(cpk_paged_attention_emulated_int8, paged_attention_emulated, int8_t)
CPK_PAGED_ENTRY(cpk_paged_attention_split_emulated, paged_attention_split_emulated, float)
CPK_PAGED_ENTRY(cpk_paged_attention_split_emulated_int8, paged_attention_split_emulated, int8_t)

// paged_int8_row_scale of a row of D values at `row` (any alignment)
float cpk_paged_int8_row_scale(const int8_t* row, int D) { return paged_int8_row_scale(row, D); }

}  // extern "C"
