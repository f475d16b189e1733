// W4A16 kernels: load-time shuffle into mma fragment order, a dequantize
// fallback, and the tensor-core GEMM (mma.sync m16n8k16, lop3 magic-number
// dequant, 4-stage cp.async pipeline, split-K). Layouts: int4_layout.cuh,
// w4a16_tile.cuh; semantics: compress/ops/reference.py::w4a16_gemm.
#include <cuda_runtime.h>

#include <type_traits>

#include "cpk_device.cuh"
#include "kernels.h"
#include "w4a16_tile.cuh"

namespace cpk {
namespace {

__global__ void w4a16_shuffle_kernel(const int32_t* __restrict__ qweight, int n, int k, int kp, long long words,
                                     int32_t* __restrict__ out) {
  const long long w = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w < words) out[w] = static_cast<int32_t>(w4_shuffle_word(qweight, n, k, kp, w));
}

template <typename T>
__global__ void w4a16_dequant_kernel(const int32_t* __restrict__ qweight, const T* __restrict__ scales,
                                     const uint8_t* __restrict__ zeros, int n, int k, int group_size,
                                     T* __restrict__ out) {
  const long long w = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int kw = k / 8;
  if (w >= static_cast<long long>(n) * kw) return;
  const int row = static_cast<int>(w / kw), col0 = static_cast<int>(w % kw) * 8;
  const uint32_t q = static_cast<uint32_t>(qweight[w]);
  const int groups = k / group_size;
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    const int col = col0 + p;
    const int g = col / group_size;
    const float s = Num<T>::to_float(scales[static_cast<long long>(row) * groups + g]);
    const float z = static_cast<float>(zeros[static_cast<long long>(row) * groups + g]);
    const float u = static_cast<float>((q >> (4 * p)) & 0xfu);
    out[static_cast<long long>(row) * k + col] = Num<T>::from_float((u - z) * s);
  }
}

template <bool kBf16, int MT>
__global__ void __launch_bounds__(kW4Threads) w4a16_mma_kernel(const W4A16Args a) {
  using T = typename std::conditional<kBf16, __nv_bfloat16, __half>::type;
  using Tile = W4Tile<MT>;
  extern __shared__ uint4 smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m0 = blockIdx.x * Tile::kBM;
  const int n0 = blockIdx.y * kW4TileN;
  const int kblocks = a.kp / kW4TileK;
  int kt_begin, kt_end;
  split_range(kblocks, a.splits, blockIdx.z, &kt_begin, &kt_end);
  const int nk = kt_end - kt_begin;
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ scales = static_cast<const T*>(a.scales_t);

  auto load_tile = [&](int stage, int kt) {
    uint4* sa = smem + stage * Tile::kStageChunks;
    uint4* sb = sa + Tile::kAChunks;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const RowCol c = w4_a_copy(tid, i);
      const int gm = m0 + c.row, gk = kt * kW4TileK + c.col * 8;
      const bool ok = gm < a.m && gk < a.k;
      const T* src = ok ? x + static_cast<long long>(gm) * a.k + gk : x;
      cp_async16(sa + swz128(c.row, c.col), src, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const RowCol c = w4_b_copy(tid, i);
      const long long word = ((static_cast<long long>(n0 / 16 + c.row) * kblocks + kt) * 32 + c.col) * 4;
      cp_async16(sb + c.row * 32 + c.col, a.qshuf + word, 16);
    }
  };

  float acc[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

#pragma unroll
  for (int s = 0; s < kW4Stages - 1; ++s) {
    if (s < nk) load_tile(s, kt_begin + s);
    cp_async_commit();
  }

  int cur_group = -1;
  uint32_t sc[2][2], zc[2][2];
  for (int t = 0; t < nk; ++t) {
    cp_async_wait<kW4Stages - 2>();
    __syncthreads();
    if (t + kW4Stages - 1 < nk) load_tile((t + kW4Stages - 1) % kW4Stages, kt_begin + t + kW4Stages - 1);
    cp_async_commit();

    const uint4* sa = smem + (t % kW4Stages) * Tile::kStageChunks;
    const uint4* sb = sa + Tile::kAChunks;
    uint4 bw[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) bw[j] = sb[(warp * 2 + j) * 32 + lane];

#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const int group = ((kt_begin + t) * kW4TileK + ks * 16) / a.group_size;
      if (group != cur_group) {
        cur_group = group;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const long long off = static_cast<long long>(group) * a.np + n0 + w4_scale_col(warp, j, h, lane);
            sc[j][h] = Num<T>::splat_bits(scales[off]);
            zc[j][h] = a.zeros_t[off];
          }
      }
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(af[mt], sa + swz128(mt * 16 + ldsm_x4_row(lane), ks * 2 + ldsm_x4_chunk(lane)));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t q = ks == 0 ? bw[j].x : ks == 1 ? bw[j].y : ks == 2 ? bw[j].z : bw[j].w;
        uint32_t b[4];
        w4_dequant<kBf16>(q, sc[j][0], sc[j][1], zc[j][0], zc[j][1], b);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<kBf16>(acc[mt][2 * j], af[mt], b[0], b[1]);
          mma_16816<kBf16>(acc[mt][2 * j + 1], af[mt], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  T* __restrict__ y = static_cast<T*>(a.y);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const RowCol c = w4_acc_coord(warp, mt, j, lane, i);
        const int row = m0 + c.row, col = n0 + c.col;
        if (row < a.m && col < a.n) {
          if (a.splits == 1)
            y[static_cast<long long>(row) * a.n + col] = Num<T>::from_float(acc[mt][j][i]);
          else
            a.workspace[(static_cast<long long>(blockIdx.z) * a.m + row) * a.n + col] = acc[mt][j][i];
        }
      }
}

template <typename T>
__global__ void splitk_reduce_kernel(const float* __restrict__ ws, int splits, long long count, T* __restrict__ y) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float s = 0.f;
  for (int z = 0; z < splits; ++z) s += ws[z * count + i];
  y[i] = Num<T>::from_float(s);
}

template <bool kBf16, int MT>
cudaError_t launch_mma(const W4A16Args& a, cudaStream_t stream) {
  using T = typename std::conditional<kBf16, __nv_bfloat16, __half>::type;
  constexpr int smem = W4Tile<MT>::kSmemBytes;
  static unsigned long long smem_set = 0;
  const cudaError_t attr = ensure_dynamic_smem(w4a16_mma_kernel<kBf16, MT>, smem, &smem_set);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(ceil_div(a.m, W4Tile<MT>::kBM), a.np / kW4TileN, a.splits);
  w4a16_mma_kernel<kBf16, MT><<<grid, kW4Threads, smem, stream>>>(a);
  if (a.splits > 1) {
    const long long count = static_cast<long long>(a.m) * a.n;
    splitk_reduce_kernel<T><<<static_cast<unsigned>((count + 255) / 256), 256, 0, stream>>>(
        a.workspace, a.splits, count, static_cast<T*>(a.y));
  }
  return cudaGetLastError();
}

template <bool kBf16>
cudaError_t launch_mma_dtype(const W4A16Args& a, cudaStream_t stream) {
  const int bm = w4_block_rows(a.m);
  if (bm == 16) return launch_mma<kBf16, 1>(a, stream);
  if (bm == 32) return launch_mma<kBf16, 2>(a, stream);
  return launch_mma<kBf16, 4>(a, stream);
}

}  // namespace

cudaError_t launch_w4a16_shuffle(const int32_t* qweight, int n, int k, int32_t* out, cudaStream_t stream) {
  const int np = w4_padded_n(n), kp = w4_padded_k(k);
  const long long words = static_cast<long long>(np) * kp / 8;
  if (words == 0) return cudaSuccess;
  w4a16_shuffle_kernel<<<static_cast<unsigned>((words + 255) / 256), 256, 0, stream>>>(qweight, n, k, kp, words, out);
  return cudaGetLastError();
}

cudaError_t launch_w4a16_dequant(DType dtype, const int32_t* qweight, const void* scales, const uint8_t* zeros,
                                 int n, int k, int group_size, void* out, cudaStream_t stream) {
  if (group_size <= 0 || k % group_size != 0 || k % 8 != 0) return cudaErrorInvalidValue;
  const long long words = static_cast<long long>(n) * (k / 8);
  if (words == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((words + 255) / 256);
  switch (dtype) {
    case DType::kF16:
      w4a16_dequant_kernel<__half><<<blocks, 256, 0, stream>>>(qweight, static_cast<const __half*>(scales), zeros, n,
                                                               k, group_size, static_cast<__half*>(out));
      break;
    case DType::kBF16:
      w4a16_dequant_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(
          qweight, static_cast<const __nv_bfloat16*>(scales), zeros, n, k, group_size,
          static_cast<__nv_bfloat16*>(out));
      break;
    case DType::kF32:
      w4a16_dequant_kernel<float><<<blocks, 256, 0, stream>>>(qweight, static_cast<const float*>(scales), zeros, n,
                                                              k, group_size, static_cast<float*>(out));
      break;
    case DType::kI8: return cudaErrorInvalidValue;  // a K / V pool type only
  }
  return cudaGetLastError();
}

int w4a16_splits(int m, int np, int kp, int sms) { return w4_splits(m, np, kp, sms); }

cudaError_t launch_w4a16_gemm(DType dtype, const W4A16Args& args, cudaStream_t stream) {
  if (args.m == 0 || args.n == 0) return cudaSuccess;
  if (args.group_size <= 0 || args.group_size % 16 != 0 || args.np % kW4TileN != 0 || args.kp % kW4TileK != 0 ||
      args.k % 8 != 0)
    return cudaErrorInvalidValue;
  if (dtype == DType::kF16) return launch_mma_dtype<false>(args, stream);
  if (dtype == DType::kBF16) return launch_mma_dtype<true>(args, stream);
  return cudaErrorInvalidValue;
}

}  // namespace cpk
