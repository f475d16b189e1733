// Device-only wrappers: cp.async, ldmatrix, mma.sync, dtype conversion.
// sm_80+ (Ampere, Ada, Hopper).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cpk_common.cuh"

namespace cpk {

// Raises a kernel's dynamic shared-memory limit to `bytes`, once per device
// (host side; the attribute is per device context).
template <typename Kernel>
inline cudaError_t ensure_dynamic_smem(Kernel kernel, int bytes, unsigned long long* done_mask) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const unsigned long long bit = 1ull << (dev & 63);
  if (__atomic_load_n(done_mask, __ATOMIC_ACQUIRE) & bit) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) __atomic_fetch_or(done_mask, bit, __ATOMIC_ACQ_REL);
  return e;
}

CPK_D uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16-byte global -> shared copy; src_bytes = 0 zero-fills the destination.
CPK_D void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
CPK_D void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
CPK_D void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

CPK_D void ldsm_x4(uint32_t r[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// D = A * B + D, m16n8k16, fp32 accumulate.
template <bool kBf16>
CPK_D void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// D = A * B + D, m16n8k32, s8 x s8 -> s32.
CPK_D void mma_16832_s8(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
struct Num;
template <>
struct Num<__half> {
  static CPK_D float to_float(__half v) { return __half2float(v); }
  static CPK_D __half from_float(float v) { return __float2half_rn(v); }
  static CPK_D uint32_t splat_bits(__half v) {
    const uint32_t b = __half_as_ushort(v);
    return b * 0x10001u;
  }
};
template <>
struct Num<__nv_bfloat16> {
  static CPK_D float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static CPK_D __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static CPK_D uint32_t splat_bits(__nv_bfloat16 v) {
    const uint32_t b = __bfloat16_as_ushort(v);
    return b * 0x10001u;
  }
};
template <>
struct Num<float> {
  static CPK_D float to_float(float v) { return v; }
  static CPK_D float from_float(float v) { return v; }
};

}  // namespace cpk
