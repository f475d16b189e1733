// compress::paged_decode_attention on CUDA: one query per row over a paged KV cache.
// Reference: compress/ops/reference.py::paged_decode_attention; geometry, softmax and
// combine helpers in paged_attention.cuh (shared with the host harness).
//
// The split kernel (the default; paged_attention.cuh says what each phase does): grid
// (rows, kv heads x groups of up to kSplitHeads query heads, splits of kSplitKeys
// positions), kSplitThreads threads. A row of more than one split leaves (max, sum, V sums)
// per split in the workspace and the combine kernel, grid (rows, query heads), writes it.
//
// The heads kernel (the baseline): grid (rows, query heads), block kPagedWarps warps. Warp w
// walks the row's positions first + w, first + w + kPagedWarps, ...; U of them a pass: the
// lanes load their head-dim elements of U keys' K and V rows (all in flight before the
// first dot's warp reduction), then fold the keys in position order into the warp's online
// softmax (fp32, base 2) and rescale-accumulate V. The warps' (max, sum, V sums) meet in
// shared memory and the block writes the row's output in q's dtype.
//
// q / out: float16, bfloat16 or float32; pools: any of the three, or int8 rows with their
// scales (each element float(q) * scale, paged_attention.cuh).
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cpk_device.cuh"
#include "kernels.h"
#include "paged_attention.cuh"

namespace cpk {
namespace {

// A pool element as fp32: the float types as they are, int8 as float(q) * the row's scale.
template <typename TKV>
CPK_D float kv_value(TKV v, float scale) {
  if constexpr (std::is_same_v<TKV, int8_t>) return static_cast<float>(v) * scale;
  else return Num<TKV>::to_float(v);
}

template <typename TKV>
CPK_D float kv_scale(const TKV* row, int D) {
  if constexpr (std::is_same_v<TKV, int8_t>) return paged_int8_row_scale(row, D);
  else return 1.f;
}

CPK_D float warp_sum(float v) {
  CPK_UNROLL for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// C = head-dim chunks of 32 a lane holds (compile time, so the registers are those of the
// head_dim the launch has), U = keys a warp has in flight (paged_keys_in_flight).
template <typename TQ, typename TKV, int C>
__global__ void __launch_bounds__(32 * kPagedWarps) paged_decode_attention_kernel(const PagedAttnArgs a) {
  constexpr int U = paged_keys_in_flight(C);
  const int row = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int D = a.head_dim, hk = h / (a.n_heads / a.n_kv_heads);
  const long long qo = (static_cast<long long>(row) * a.n_heads + h) * D;
  const TQ* q = static_cast<const TQ*>(a.q) + qo;
  const TKV* kp = static_cast<const TKV*>(a.k_pool);
  const TKV* vp = static_cast<const TKV*>(a.v_pool);
  const float qscale = a.scale * kLog2e;

  float qr[C], acc[C];
  CPK_UNROLL for (int i = 0; i < C; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < D ? Num<TQ>::to_float(q[d]) * qscale : 0.f;
    acc[i] = 0.f;
  }
  const PagedSpan span = paged_span(a.context_lens[row], a.window, a.table_cols * a.block_size);
  const int32_t* table = a.block_tables + static_cast<long long>(row) * a.table_cols;
  OnlineSoftmax sm;
  sm.init();
  // Each pass loads U keys' K and V rows (all in flight, a key's latency paid once per
  // pass), then folds them into the softmax in position order.
  for (int pos0 = span.first + warp; pos0 < span.end; pos0 += kPagedWarps * U) {
    float kr[U][C], vr[U][C];
    bool ok[U];
    CPK_UNROLL for (int u = 0; u < U; ++u) {
      const int pos = pos0 + u * kPagedWarps;
      long long ko = -1, vo = -1;
      if (pos < span.end) {
        ko = paged_row_offset(table, pos, a.block_size, a.num_blocks, hk, a.k_stride[0], a.k_stride[1],
                              a.k_stride[2]);
        vo = paged_row_offset(table, pos, a.block_size, a.num_blocks, hk, a.v_stride[0], a.v_stride[1],
                              a.v_stride[2]);
      }
      ok[u] = ko >= 0;  // the same for every lane of the warp
      const float ks = ok[u] ? kv_scale(kp + ko, D) : 0.f, vs = ok[u] ? kv_scale(vp + vo, D) : 0.f;
      CPK_UNROLL for (int i = 0; i < C; ++i) {
        const int d = lane + 32 * i;
        kr[u][i] = ok[u] && d < D ? kv_value(kp[ko + d], ks) : 0.f;
        vr[u][i] = ok[u] && d < D ? kv_value(vp[vo + d], vs) : 0.f;
      }
    }
    CPK_UNROLL for (int u = 0; u < U; ++u) {
      if (!ok[u]) continue;  // past the span, or a block outside the pool: left out
      float part = 0.f;
      CPK_UNROLL for (int i = 0; i < C; ++i) part = fmaf(qr[i], kr[u][i], part);
      float rescale, weight;
      sm.add(warp_sum(part), &rescale, &weight);
      CPK_UNROLL for (int i = 0; i < C; ++i) acc[i] = fmaf(weight, vr[u][i], acc[i] * rescale);
    }
  }

  __shared__ float s_m[kPagedWarps], s_l[kPagedWarps];
  __shared__ float s_acc[kPagedWarps][32 * C];
  if (lane == 0) s_m[warp] = sm.m, s_l[warp] = sm.l;
  CPK_UNROLL for (int i = 0; i < C; ++i) {
    const int d = lane + 32 * i;
    if (d < D) s_acc[warp][d] = acc[i];
  }
  __syncthreads();
  const float m_all = paged_combine_max(s_m, kPagedWarps);
  float f[kPagedWarps], denom = 0.f;
  CPK_UNROLL for (int w = 0; w < kPagedWarps; ++w) {
    f[w] = paged_combine_factor(s_m[w], m_all);
    denom += f[w] * s_l[w];
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;  // no key (out of contract): zeros
  TQ* out = static_cast<TQ*>(a.out) + qo;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.f;
    CPK_UNROLL for (int w = 0; w < kPagedWarps; ++w) sum = fmaf(f[w], s_acc[w][d], sum);
    out[d] = Num<TQ>::from_float(sum * inv);
  }
}

// ---- the split kernel -------------------------------------------------------

// Element i of the 32-bit words w, as fp32.
template <typename TKV>
CPK_D float elem_of_words(const uint32_t* w, int i) {
  if constexpr (std::is_same_v<TKV, float>) return __uint_as_float(w[i]);
  else if constexpr (std::is_same_v<TKV, int8_t>) return static_cast<float>(static_cast<int8_t>(w[i / 4] >> (8 * (i % 4))));
  else {
    const unsigned short b = static_cast<unsigned short>(w[i / 2] >> (16 * (i % 2)));
    if constexpr (std::is_same_v<TKV, __half>) return __half2float(__ushort_as_half(b));
    else return __bfloat162float(__ushort_as_bfloat16(b));
  }
}

// kLoadBytes / sizeof(TKV) elements from p (kLoadBytes-aligned) in one load, as fp32.
template <typename TKV, int kLoadBytes>
CPK_D void load_elems(const TKV* p, float* out) {
  if constexpr (kLoadBytes == static_cast<int>(sizeof(TKV))) {
    out[0] = kv_value(*p, 1.f);  // int8: float(q), the row's scale applied by the caller
  } else {
    constexpr int N = kLoadBytes / static_cast<int>(sizeof(TKV));
    uint32_t w[kLoadBytes / 4];
    if constexpr (kLoadBytes == 16) {
      const uint4 b = *reinterpret_cast<const uint4*>(p);
      w[0] = b.x, w[1] = b.y, w[2] = b.z, w[3] = b.w;
    } else {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
    CPK_UNROLL for (int i = 0; i < N; ++i) out[i] = elem_of_words<TKV>(w, i);
  }
}

// An int8 row's scale: one aligned 4-byte load when rows are 4-byte aligned and D % 4 == 0
// (kLoadBytes >= 4 promises both), else a byte at a time.
template <int kLoadBytes>
CPK_D float int8_row_scale(const int8_t* row, int D) {
  if constexpr (kLoadBytes >= 4) return *reinterpret_cast<const float*>(row + D);
  else return paged_int8_row_scale(row, D);
}

CPK_D float load_q(const void* q, DType t, long long i) {
  if (t == DType::kF16) return __half2float(static_cast<const __half*>(q)[i]);
  if (t == DType::kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(q)[i]);
  return static_cast<const float*>(q)[i];
}
CPK_D void store_out(void* out, DType t, long long i, float v) {
  if (t == DType::kF16) static_cast<__half*>(out)[i] = __float2half_rn(v);
  else if (t == DType::kBF16) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  else static_cast<float*>(out)[i] = v;
}

// Splits the launch provides for: every row's span fits in the table's capacity, or in
// the window when there is one.
int launch_splits(const PagedAttnArgs& a) {
  const int cap = a.table_cols * a.block_size;   // < 2^31 (op_checks.h)
  const PagedSpan longest = paged_span(cap, a.window, cap);
  return paged_splits(longest.end - longest.first);
}

// A split's (max, sum) and V sums for its row and query head h: ml [rows, n_heads, splits, 2]
// after acc [rows, n_heads, splits, head_dim] in the workspace.
CPK_D float* split_acc(const PagedAttnArgs& a, int splits, int row, int h, int split) {
  return a.workspace + ((static_cast<long long>(row) * a.n_heads + h) * splits + split) * a.head_dim;
}
CPK_D float* split_ml(const PagedAttnArgs& a, int splits, int row, int h, int split) {
  const long long acc_floats = static_cast<long long>(a.rows) * a.n_heads * splits * a.head_dim;
  return a.workspace + acc_floats + ((static_cast<long long>(row) * a.n_heads + h) * splits + split) * 2;
}

// kChunks: head-dim columns of 32 a lane holds in p.V (2 / 4 / 8: head_dim <= 64 / 128 /
// 256); kLoadBytes: the scores' row loads.
template <typename TKV, int kLoadBytes, int kChunks>
__global__ void __launch_bounds__(kSplitThreads, 2) paged_split_kernel(const PagedAttnArgs a, const DType q_dtype,
                                                                     const int splits) {
  constexpr bool kInt8 = std::is_same_v<TKV, int8_t>;
  constexpr int kVec = kLoadBytes / static_cast<int>(sizeof(TKV));
  constexpr int kRowLoads = kVec >= 16 ? 2 : 4;  // K loads in flight a thread
  constexpr int kKeysAPass = 16 / kChunks;  // V rows in flight a warp: 16 loads a lane
  const int row = blockIdx.x, split = blockIdx.z, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int D = a.head_dim, group = a.n_heads / a.n_kv_heads;
  const int groups_per_kv = (group + kSplitHeads - 1) / kSplitHeads;
  const int hk = blockIdx.y / groups_per_kv;
  const int h0 = hk * group + (blockIdx.y % groups_per_kv) * kSplitHeads;
  const int heads = min(kSplitHeads, (hk + 1) * group - h0);
  const PagedSpan span = paged_span(a.context_lens[row], a.window, a.table_cols * a.block_size);
  const int row_splits = paged_splits(span.end - span.first);
  if (split >= row_splits) return;
  const int first = span.first + split * kSplitKeys;
  const int n = max(0, min(kSplitKeys, span.end - first));
  const TKV* kp = static_cast<const TKV*>(a.k_pool);
  const TKV* vp = static_cast<const TKV*>(a.v_pool);
  const int32_t* table = a.block_tables + static_cast<long long>(row) * a.table_cols;

  // s_q holds q until the scores are done, then the warps' V sums meet in it
  __shared__ __align__(16) float s_q[kSplitHeads][kPagedMaxHeadDim];
  __shared__ float s_p[kSplitHeads][kSplitKeys];
  __shared__ long long s_voff[kSplitKeys];
  __shared__ float s_vscale[kInt8 ? kSplitKeys : 1];  // int8 pools: each key's V row scale
  __shared__ float s_m[kSplitHeads], s_l[kSplitHeads];

  const float qscale = a.scale * kLog2e;
  for (int i = tid; i < heads * D; i += kSplitThreads)
    s_q[i / D][i % D] = load_q(a.q, q_dtype, (static_cast<long long>(row) * a.n_heads + h0) * D + i) * qscale;
  __syncthreads();

  // scores: thread j takes key j, its row kRowLoads loads at a time, d in order
  if (tid < n) {
    const int j = tid, pos = first + j;
    const int blk = paged_block_of(table, pos, a.block_size, a.num_blocks);
    float sc[kSplitHeads];
    CPK_UNROLL for (int g = 0; g < kSplitHeads; ++g) sc[g] = 0.f;
    long long vo = -1;
    if (blk >= 0) {
      const long long slot = pos % a.block_size;
      const TKV* krow = kp + blk * a.k_stride[0] + hk * a.k_stride[1] + slot * a.k_stride[2];
      vo = blk * a.v_stride[0] + hk * a.v_stride[1] + slot * a.v_stride[2];
      float kscale = 1.f;
      if constexpr (kInt8) {
        kscale = int8_row_scale<kLoadBytes>(krow, D);
        s_vscale[j] = int8_row_scale<kLoadBytes>(vp + vo, D);
      }
      for (int c0 = 0; c0 < D; c0 += kRowLoads * kVec) {
        float k[kRowLoads][kVec];
        CPK_UNROLL for (int u = 0; u < kRowLoads; ++u)
          if (c0 + u * kVec < D) load_elems<TKV, kLoadBytes>(krow + c0 + u * kVec, k[u]);
        CPK_UNROLL for (int u = 0; u < kRowLoads; ++u) {
          const int c = c0 + u * kVec;
          if (c >= D) break;
          if constexpr (kInt8) {
            CPK_UNROLL for (int e = 0; e < kVec; ++e) k[u][e] *= kscale;
          }
          CPK_UNROLL for (int g = 0; g < kSplitHeads; ++g) {
            if (g < heads) {
              CPK_UNROLL for (int e = 0; e < kVec; ++e) sc[g] = fmaf(s_q[g][c + e], k[u][e], sc[g]);
            }
          }
        }
      }
    }
    CPK_UNROLL for (int g = 0; g < kSplitHeads; ++g)
      if (g < heads) s_p[g][j] = blk >= 0 ? sc[g] : -__builtin_huge_valf();
    s_voff[j] = vo;
  }
  __syncthreads();

  // softmax over the split: a warp per head
  for (int g = warp; g < heads; g += kSplitWarps) {
    float mx = -__builtin_huge_valf();
    for (int j = lane; j < n; j += 32) mx = fmaxf(mx, s_p[g][j]);
    CPK_UNROLL for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float p = mx == -__builtin_huge_valf() ? 0.f : paged_exp2(s_p[g][j] - mx);
      s_p[g][j] = p;
      sum += p;
    }
    CPK_UNROLL for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) s_m[g] = mx, s_l[g] = sum;
  }
  __syncthreads();

  // p.V: warp w takes keys 32 w .. 32 w + 31 in order, lane l columns l, l + 32, ... for
  // every head; kKeysAPass V rows loaded before they are folded. A key outside the pool
  // has p = 0 and v = 0 here: acc + 0 * 0 = acc (acc starts at +0, so it is never -0).
  float acc[kChunks][kSplitHeads];
  CPK_UNROLL for (int c = 0; c < kChunks; ++c)
    CPK_UNROLL for (int g = 0; g < kSplitHeads; ++g) acc[c][g] = 0.f;
  const int j_end = min(n, (warp + 1) * kSplitKeysAWarp);
  for (int j0 = warp * kSplitKeysAWarp; j0 < j_end; j0 += kKeysAPass) {
    float v[kKeysAPass][kChunks];
    CPK_UNROLL for (int u = 0; u < kKeysAPass; ++u) {
      const int j = j0 + u;
      const long long vo = j < j_end ? s_voff[j] : -1;
      const float vs = kInt8 && vo >= 0 ? s_vscale[kInt8 ? j : 0] : 1.f;
      CPK_UNROLL for (int c = 0; c < kChunks; ++c) {
        const int d = lane + 32 * c;
        v[u][c] = vo >= 0 && d < D ? kv_value(vp[vo + d], vs) : 0.f;
      }
    }
    CPK_UNROLL for (int u = 0; u < kKeysAPass; ++u) {
      const int j = j0 + u;
      if (j >= j_end) break;
      CPK_UNROLL for (int g = 0; g < kSplitHeads; ++g) {
        if (g < heads) {
          const float p = s_p[g][j];
          CPK_UNROLL for (int c = 0; c < kChunks; ++c) acc[c][g] = fmaf(p, v[u][c], acc[c][g]);
        }
      }
    }
  }
  // the warps' sums, added in warp order into s_q (free since the scores)
  for (int w = 0; w < kSplitWarps; ++w) {
    if (warp == w) {
      CPK_UNROLL for (int g = 0; g < kSplitHeads; ++g) {
        if (g >= heads) continue;
        CPK_UNROLL for (int c = 0; c < kChunks; ++c) {
          const int d = lane + 32 * c;
          if (d < D) s_q[g][d] = w == 0 ? acc[c][g] : s_q[g][d] + acc[c][g];
        }
      }
    }
    __syncthreads();
  }
  for (int i = tid; i < heads * D; i += kSplitThreads) {
    const int g = i / D, d = i % D, h = h0 + g;
    if (row_splits == 1) {
      const float inv = s_l[g] > 0.f ? 1.f / s_l[g] : 0.f;  // no key (out of contract): zeros
      store_out(a.out, q_dtype, (static_cast<long long>(row) * a.n_heads + h) * D + d, s_q[g][d] * inv);
    } else {
      split_acc(a, splits, row, h, split)[d] = s_q[g][d];
      if (d == 0) {
        float* ml = split_ml(a, splits, row, h, split);
        ml[0] = s_m[g], ml[1] = s_l[g];
      }
    }
  }
}

// Rows of more than one split: out = sum_s f_s acc_s / sum_s f_s l_s, f_s = 2^(m_s - max),
// splits folded in order. grid (rows, query heads).
__global__ void __launch_bounds__(kSplitThreads) paged_split_combine_kernel(const PagedAttnArgs a,
                                                                             const DType q_dtype, const int splits) {
  const int row = blockIdx.x, h = blockIdx.y;
  const PagedSpan span = paged_span(a.context_lens[row], a.window, a.table_cols * a.block_size);
  const int n = paged_splits(span.end - span.first);
  if (n == 1) return;  // written by its one split
  float m_all = -__builtin_huge_valf(), denom = 0.f;
  for (int s = 0; s < n; ++s) m_all = fmaxf(m_all, split_ml(a, splits, row, h, s)[0]);
  for (int s = 0; s < n; ++s) {
    const float* ml = split_ml(a, splits, row, h, s);
    denom = fmaf(paged_combine_factor(ml[0], m_all), ml[1], denom);
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  const long long o = (static_cast<long long>(row) * a.n_heads + h) * a.head_dim;
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < n; ++s)
      sum = fmaf(paged_combine_factor(split_ml(a, splits, row, h, s)[0], m_all), split_acc(a, splits, row, h, s)[d],
                 sum);
    store_out(a.out, q_dtype, o + d, sum * inv);
  }
}

// The widest load (16 or 4 bytes, else one element) every K row allows: the pool's base, its
// strides and head_dim's bytes all multiples of it.
int split_load_bytes(const PagedAttnArgs& a, int elem_bytes) {
  for (const int b : {16, 4}) {
    if (b < elem_bytes) continue;
    bool ok = reinterpret_cast<uintptr_t>(a.k_pool) % b == 0 && reinterpret_cast<uintptr_t>(a.v_pool) % b == 0 &&
              (static_cast<long long>(a.head_dim) * elem_bytes) % b == 0;
    for (int i = 0; i < 3; ++i) ok = ok && (a.k_stride[i] * elem_bytes) % b == 0 && (a.v_stride[i] * elem_bytes) % b == 0;
    if (ok) return b;
  }
  return elem_bytes;
}

template <typename TKV, int kLoadBytes>
cudaError_t launch_split_typed(DType q_dtype, const PagedAttnArgs& a, int splits, cudaStream_t stream) {
  const int group = a.n_heads / a.n_kv_heads;
  const dim3 grid(static_cast<unsigned>(a.rows),
                  static_cast<unsigned>(a.n_kv_heads * ((group + kSplitHeads - 1) / kSplitHeads)),
                  static_cast<unsigned>(splits));
  const int chunks = (a.head_dim + 31) / 32;
  if (chunks <= 2) paged_split_kernel<TKV, kLoadBytes, 2><<<grid, kSplitThreads, 0, stream>>>(a, q_dtype, splits);
  else if (chunks <= 4) paged_split_kernel<TKV, kLoadBytes, 4><<<grid, kSplitThreads, 0, stream>>>(a, q_dtype, splits);
  else paged_split_kernel<TKV, kLoadBytes, 8><<<grid, kSplitThreads, 0, stream>>>(a, q_dtype, splits);
  if (splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(a.rows), static_cast<unsigned>(a.n_heads));
    paged_split_combine_kernel<<<cgrid, kSplitThreads, 0, stream>>>(a, q_dtype, splits);
  }
  return cudaGetLastError();
}

template <typename TKV>
cudaError_t launch_split(DType q_dtype, const PagedAttnArgs& a, cudaStream_t stream) {
  const int splits = a.splits;   // plan_paged_decode_attention's
  if (splits < 1 || splits > 65535 || (splits > 1 && a.workspace == nullptr)) return cudaErrorInvalidValue;
  switch (split_load_bytes(a, sizeof(TKV))) {
    case 16: return launch_split_typed<TKV, 16>(q_dtype, a, splits, stream);
    case 4:
      if constexpr (sizeof(TKV) <= 4) return launch_split_typed<TKV, 4>(q_dtype, a, splits, stream);
      break;
    default: break;
  }
  return launch_split_typed<TKV, sizeof(TKV)>(q_dtype, a, splits, stream);
}

// ---- the heads kernel's launch --------------------------------------------------

template <typename TQ, typename TKV>
cudaError_t launch_typed(const PagedAttnArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.rows), static_cast<unsigned>(a.n_heads));
  const int chunks = (a.head_dim + 31) / 32;
  if (chunks <= 2) paged_decode_attention_kernel<TQ, TKV, 2><<<grid, 32 * kPagedWarps, 0, stream>>>(a);
  else if (chunks <= 4) paged_decode_attention_kernel<TQ, TKV, 4><<<grid, 32 * kPagedWarps, 0, stream>>>(a);
  else paged_decode_attention_kernel<TQ, TKV, kPagedMaxChunks><<<grid, 32 * kPagedWarps, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename TQ>
cudaError_t launch_kv(DType kv_dtype, const PagedAttnArgs& a, cudaStream_t stream) {
  switch (kv_dtype) {
    case DType::kF16: return launch_typed<TQ, __half>(a, stream);
    case DType::kBF16: return launch_typed<TQ, __nv_bfloat16>(a, stream);
    case DType::kF32: return launch_typed<TQ, float>(a, stream);
    case DType::kI8: return launch_typed<TQ, int8_t>(a, stream);
  }
  return cudaErrorInvalidValue;
}

std::atomic<int> g_kernel{static_cast<int>(PagedKernel::kSplit)};

}  // namespace

void set_paged_attention_kernel(PagedKernel kernel) { g_kernel.store(static_cast<int>(kernel)); }
PagedKernel paged_attention_kernel() { return static_cast<PagedKernel>(g_kernel.load()); }

long long plan_paged_decode_attention(PagedAttnArgs& a) {
  a.splits = paged_attention_kernel() == PagedKernel::kSplit && a.table_cols >= 0 && a.block_size >= 1
                 ? launch_splits(a) : 0;
  return a.splits <= 1 || a.rows <= 0 ? 0 : static_cast<long long>(a.rows) * a.n_heads * a.splits * (a.head_dim + 2);
}

cudaError_t launch_paged_decode_attention(DType q_dtype, DType kv_dtype, const PagedAttnArgs& a,
                                          cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (a.rows < 0 || a.head_dim < 1 || a.head_dim > kPagedMaxHeadDim || a.n_kv_heads < 1 ||
      a.n_heads % a.n_kv_heads != 0 || a.n_heads < 1 || a.n_heads > kPagedMaxHeads || a.block_size < 1 ||
      a.table_cols < 0 || a.num_blocks < 0 || a.window < 0 || q_dtype == DType::kI8)
    return cudaErrorInvalidValue;
  if (a.splits > 0) {   // the split kernel (plan_paged_decode_attention chose it)
    switch (kv_dtype) {
      case DType::kF16: return launch_split<__half>(q_dtype, a, stream);
      case DType::kBF16: return launch_split<__nv_bfloat16>(q_dtype, a, stream);
      case DType::kF32: return launch_split<float>(q_dtype, a, stream);
      case DType::kI8: return launch_split<int8_t>(q_dtype, a, stream);
    }
    return cudaErrorInvalidValue;
  }
  switch (q_dtype) {
    case DType::kF16: return launch_kv<__half>(kv_dtype, a, stream);
    case DType::kBF16: return launch_kv<__nv_bfloat16>(kv_dtype, a, stream);
    case DType::kF32: return launch_kv<float>(kv_dtype, a, stream);
    case DType::kI8: break;  // int8 is a pool type, not q's
  }
  return cudaErrorInvalidValue;
}

}  // namespace cpk
