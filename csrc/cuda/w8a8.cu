// int8 kernels: per-token activation quantization that splits LLM.int8()
// outlier columns in the same pass, and the W8A8 GEMM on int8 tensor cores
// (mma.sync m16n8k32 s8, int32 accumulation, 3-stage cp.async pipeline,
// split-K with exact int32 atomics) with the scale + outlier epilogue fused.
// Semantics: compress/ops/reference.py (quantize_per_token_int8, w8a8_gemm,
// w8a8_outlier_gemm).
#include <cuda_runtime.h>

#include "cpk_device.cuh"
#include "kernels.h"
#include "w8a8_tile.cuh"

namespace cpk {
namespace {

constexpr int kQuantThreads = 256;

CPK_D float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (kQuantThreads >> 5) ? red[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  return red[0];
}

// One block per row. Outlier columns are marked in a shared-memory bit mask
// (K/8 bytes: 16.5 KB at the int32 limit kMaxInt8DotK); an index out of range
// (outlier_column) marks nothing and gathers 0.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_rows_kernel(const T* __restrict__ x, int k, int ldq, const int64_t* __restrict__ idx, int c,
                         int8_t* __restrict__ q, float* __restrict__ scale, T* __restrict__ xo) {
  extern __shared__ uint32_t mask[];
  __shared__ float red[kQuantThreads / 32];
  const long long row = blockIdx.x;
  const T* xr = x + row * k;
  if (c > 0) {
    for (int i = threadIdx.x; i < outlier_mask_words(k); i += kQuantThreads) mask[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < c; i += kQuantThreads) {
      const int j = outlier_column(idx[i], k);
      if (j >= 0) atomicOr(&mask[j >> 5], 1u << (j & 31));
      xo[row * c + i] = j >= 0 ? xr[j] : Num<T>::from_float(0.f);
    }
    __syncthreads();
  }
  float amax = 0.f;
  for (int i = threadIdx.x; i < k; i += kQuantThreads)
    if (c == 0 || !outlier_mask_test(mask, i)) amax = fmaxf(amax, fabsf(Num<T>::to_float(xr[i])));
  const float s = int8_scale_from_amax(block_max(amax, red));
  int8_t* qr = q + row * ldq;
  for (int i = threadIdx.x; i < ldq; i += kQuantThreads) {
    int8_t v = 0;
    if (i < k && (c == 0 || !outlier_mask_test(mask, i))) v = int8_quantize(Num<T>::to_float(xr[i]), s);
    qr[i] = v;
  }
  if (threadIdx.x == 0) scale[row] = s;
}

template <typename OutT>
CPK_D OutT w8a8_epilogue(int acc, int row, int col, const W8A8Args& a) {
  float y = __int2float_rn(acc) * a.x_scale[row] * a.w_scale[col];
  if (a.c > 0) {  // LLM.int8(): the int8 part in the output dtype, plus the outlier columns
    const OutT* xo = static_cast<const OutT*>(a.x_outliers) + static_cast<long long>(row) * a.c;
    const float* wo = a.w_outliers + static_cast<long long>(col) * a.c;
    float s = 0.f;
    for (int i = 0; i < a.c; ++i) s = fmaf(Num<OutT>::to_float(xo[i]), wo[i], s);
    y = Num<OutT>::to_float(Num<OutT>::from_float(y)) + s;
  }
  return Num<OutT>::from_float(y);
}

template <typename OutT, int MT>
__global__ void __launch_bounds__(kW8Threads) w8a8_mma_kernel(const W8A8Args a) {
  using Tile = W8Tile<MT>;
  extern __shared__ uint4 smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m0 = blockIdx.x * Tile::kBM, n0 = blockIdx.y * kW8TileN;
  int kt_begin, kt_end;
  split_range(ceil_div(a.kq, kW8TileK), a.splits, blockIdx.z, &kt_begin, &kt_end);
  const int nk = kt_end - kt_begin;

  auto load_tile = [&](int stage, int kt) {
    uint4* sa = smem + stage * Tile::kStageChunks;
    uint4* sb = sa + Tile::kAChunks;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const RowCol c = w8_copy(tid, i);
      const int gm = m0 + c.row, gk = kt * kW8TileK + c.col * 16;
      const bool ok = gm < a.m && gk < a.kq;
      cp_async16(sa + swz128(c.row, c.col), ok ? a.xq + static_cast<long long>(gm) * a.kq + gk : a.xq, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const RowCol c = w8_copy(tid, i);
      const int gn = n0 + c.row, gk = kt * kW8TileK + c.col * 16;
      const bool ok = gn < a.n && gk < a.kq;
      cp_async16(sb + swz128(c.row, c.col), ok ? a.wq + static_cast<long long>(gn) * a.kq + gk : a.wq, ok ? 16 : 0);
    }
  };

  int acc[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0;

#pragma unroll
  for (int s = 0; s < kW8Stages - 1; ++s) {
    if (s < nk) load_tile(s, kt_begin + s);
    cp_async_commit();
  }
  for (int t = 0; t < nk; ++t) {
    cp_async_wait<kW8Stages - 2>();
    __syncthreads();
    if (t + kW8Stages - 1 < nk) load_tile((t + kW8Stages - 1) % kW8Stages, kt_begin + t + kW8Stages - 1);
    cp_async_commit();
    const uint4* sa = smem + (t % kW8Stages) * Tile::kStageChunks;
    const uint4* sb = sa + Tile::kAChunks;
#pragma unroll
    for (int ks = 0; ks < kW8TileK / 32; ++ks) {
      uint32_t af[MT][4], bf[2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const RowCol c = w8_a_ldsm(lane, mt, ks);
        ldsm_x4(af[mt], sa + swz128(c.row, c.col));
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const RowCol c = w8_b_ldsm(lane, warp, j, ks);
        ldsm_x4(bf[j], sb + swz128(c.row, c.col));
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          mma_16832_s8(acc[mt][2 * j], af[mt], bf[j][0], bf[j][2]);
          mma_16832_s8(acc[mt][2 * j + 1], af[mt], bf[j][1], bf[j][3]);
        }
    }
  }
  cp_async_wait<0>();

  OutT* __restrict__ y = static_cast<OutT*>(a.y);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const RowCol c = w8_acc_coord(warp, mt, j, lane, i);
        const int row = m0 + c.row, col = n0 + c.col;
        if (row < a.m && col < a.n) {
          if (a.splits == 1)
            y[static_cast<long long>(row) * a.n + col] = w8a8_epilogue<OutT>(acc[mt][j][i], row, col, a);
          else
            atomicAdd(a.workspace + static_cast<long long>(row) * a.n + col, acc[mt][j][i]);
        }
      }
}

template <typename OutT>
__global__ void w8a8_epilogue_kernel(const W8A8Args a) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(a.m) * a.n) return;
  const int row = static_cast<int>(i / a.n), col = static_cast<int>(i % a.n);
  static_cast<OutT*>(a.y)[i] = w8a8_epilogue<OutT>(a.workspace[i], row, col, a);
}

template <typename OutT, int MT>
cudaError_t launch_w8a8_mt(const W8A8Args& a, cudaStream_t stream) {
  constexpr int smem = W8Tile<MT>::kSmemBytes;
  static unsigned long long smem_set = 0;
  const cudaError_t attr = ensure_dynamic_smem(w8a8_mma_kernel<OutT, MT>, smem, &smem_set);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(ceil_div(a.m, W8Tile<MT>::kBM), ceil_div(a.n, kW8TileN), a.splits);
  w8a8_mma_kernel<OutT, MT><<<grid, kW8Threads, smem, stream>>>(a);
  if (a.splits > 1) {
    const long long count = static_cast<long long>(a.m) * a.n;
    w8a8_epilogue_kernel<OutT><<<static_cast<unsigned>((count + 255) / 256), 256, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename OutT>
cudaError_t launch_w8a8_typed(const W8A8Args& a, cudaStream_t stream) {
  if (a.m <= 16) return launch_w8a8_mt<OutT, 1>(a, stream);
  if (a.m <= 32) return launch_w8a8_mt<OutT, 2>(a, stream);
  return launch_w8a8_mt<OutT, 4>(a, stream);
}

template <typename T>
cudaError_t launch_quant_typed(const void* x, int m, int k, int ldq, const int64_t* idx, int c, int8_t* q,
                               float* scale, void* xo, cudaStream_t stream) {
  const int smem = quantize_rows_smem_bytes(k, c);
  if (smem > 0) {  // the static reduction buffer counts against the same 48 KiB as the mask
    cudaFuncAttributes attr{};
    cudaError_t e = cudaFuncGetAttributes(&attr, quantize_rows_kernel<T>);
    if (e != cudaSuccess) return e;
    if (smem_needs_optin(smem, static_cast<int>(attr.sharedSizeBytes))) {
      e = cudaFuncSetAttribute(quantize_rows_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
    }
  }
  quantize_rows_kernel<T><<<m, kQuantThreads, smem, stream>>>(static_cast<const T*>(x), k, ldq, idx, c, q, scale,
                                                               static_cast<T*>(xo));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_rows(DType dtype, const void* x, int m, int k, int ldq, const int64_t* outlier_idx,
                                 int c, int8_t* q, float* scale, void* x_outliers, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  if (ldq < k || (c > 0 && (outlier_idx == nullptr || x_outliers == nullptr))) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kF16:
      return launch_quant_typed<__half>(x, m, k, ldq, outlier_idx, c, q, scale, x_outliers, stream);
    case DType::kBF16:
      return launch_quant_typed<__nv_bfloat16>(x, m, k, ldq, outlier_idx, c, q, scale, x_outliers, stream);
    case DType::kF32:
      return launch_quant_typed<float>(x, m, k, ldq, outlier_idx, c, q, scale, x_outliers, stream);
    case DType::kI8: break;  // a K / V pool type only
  }
  return cudaErrorInvalidValue;
}

int w8a8_splits(int m, int n, int kq, int sms) {
  const int bm = m <= 16 ? 16 : (m <= 32 ? 32 : 64);
  return choose_splits(ceil_div(m, bm) * ceil_div(n, kW8TileN), ceil_div(kq, kW8TileK), sms, 4);
}

cudaError_t launch_w8a8_gemm(DType out_dtype, const W8A8Args& args, cudaStream_t stream) {
  if (args.m == 0 || args.n == 0) return cudaSuccess;
  if (args.kq % 16 != 0 || args.kq > round_up(kMaxInt8DotK, 16) || (args.splits > 1 && args.workspace == nullptr))
    return cudaErrorInvalidValue;
  switch (out_dtype) {
    case DType::kF16:
      return launch_w8a8_typed<__half>(args, stream);
    case DType::kBF16:
      return launch_w8a8_typed<__nv_bfloat16>(args, stream);
    case DType::kF32:
      return launch_w8a8_typed<float>(args, stream);
    case DType::kI8: break;  // a K / V pool type only
  }
  return cudaErrorInvalidValue;
}

}  // namespace cpk
