// compress::paged_decode_attention on CUDA: one query per row over a paged KV cache.
// Reference: compress/ops/reference.py::paged_decode_attention; geometry, online softmax
// and combine in paged_attention.cuh (shared with the host harness).
//
// grid (rows, query heads), block kPagedWarps warps. Warp w walks the row's positions
// first + w, first + w + kPagedWarps, ...; U of them a pass: the lanes load their head-dim
// elements of U keys' K and V rows (all in flight before the first dot's warp reduction:
// a decode step is bound by the loads' latency, not by HBM's bandwidth), then fold the
// keys in position order into the warp's online softmax (fp32, base 2) and
// rescale-accumulate V.
// The warps' (max, sum, V sums) meet in shared memory and the block writes the row's
// output in q's dtype. q / out: float16, bfloat16 or float32; pools: any of the three, or
// int8 rows with their scales (each element float(q) * scale, paged_attention.cuh).
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

}  // namespace

cudaError_t launch_paged_decode_attention(DType q_dtype, DType kv_dtype, const PagedAttnArgs& a,
                                          cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (a.rows < 0 || a.head_dim < 1 || a.head_dim > kPagedMaxHeadDim || a.n_kv_heads < 1 ||
      a.n_heads % a.n_kv_heads != 0 || a.n_heads < 1 || a.n_heads > kPagedMaxHeads || a.block_size < 1 ||
      a.table_cols < 0 || a.num_blocks < 0 || a.window < 0)
    return cudaErrorInvalidValue;
  switch (q_dtype) {
    case DType::kF16: return launch_kv<__half>(kv_dtype, a, stream);
    case DType::kBF16: return launch_kv<__nv_bfloat16>(kv_dtype, a, stream);
    case DType::kF32: return launch_kv<float>(kv_dtype, a, stream);
    case DType::kI8: break;  // int8 is a pool type, not q's
  }
  return cudaErrorInvalidValue;
}

}  // namespace cpk
