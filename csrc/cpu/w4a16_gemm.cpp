// compress::w4a16_gemm on CPU: x [M, K] (fp32 / bf16 / fp16) @ dequant(int4 W [N, K])^T.
// Reference: compress/ops/reference.py::w4a16_gemm. Layout notes: csrc/cpu/README.md.
//
// Method (as llama.cpp does for Q4 x Q8): activations are quantized to int8 per block
// of 32 along K (symmetric, round-half-even), the dot products run in integers
// (u8 nibble x s8 activation -> int32 per block), and per block the int32 sum is scaled
// by (activation block scale x weight group scale). The zero point is folded out:
//   y = sum_g s_g * (sum_{b in g} sx_b * dot_b  -  z_g * X_g),  X_g = sum_{b in g} sx_b * sum(q_b)
// The canonical packing (8 nibbles per int32, k ascending from the low bits) already
// gives the kernel what it wants: in a 32-byte run covering k0..k0+63, the low nibbles
// are the even k and the high nibbles the odd k. So the weights are used in place
// (no repack) and the activations are permuted instead, once per call:
// chunk c of row m holds [q(k0+0), q(k0+2), ..., q(k0+62) | q(k0+1), ..., q(k0+63)].
// Group sizes that are not a multiple of 32 take an exact fp32 dequantize path.
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <vector>

#include "cpu/amx_common.h"
#include "cpu/kernel_common.h"
#include "cpu/ops.h"
#include "cpu/w4a16_common.h"

namespace compress_cpu {
namespace {

using namespace w4;

void quantize_activations(const at::Tensor& x, int64_t G, int64_t KC, int8_t* xq, float* xs, float* xg) {
  const int64_t M = x.size(0), K = x.size(1), NG = K / G;
  const bool avx2 = active_isa() >= Isa::Avx2;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(x.scalar_type() == at::kFloat ? 0 : K);
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x.scalar_type() == at::kFloat ? x.data_ptr<float>() + m * K : buf.data();
      if (!buf.empty()) row_to_float(x, m, buf.data());
      quantize_row(row, K, G, KC, avx2, xq + m * KC * kChunk, xs + m * KC * 8, xg + m * NG);
    }
  });
}

// ---- AVX2 ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace avx2 {
#define W4_VNNI 0
#include "cpu/w4a16_tile.inc"
#undef W4_VNNI
}  // namespace avx2

void w4_avx2(const W4Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if (a.G == 32) avx2::w4_block_avx<true>(a, m0, m1, n0, n1);
  else avx2::w4_block_avx<false>(a, m0, m1, n0, n1);
}
#pragma GCC pop_options

// ---- AVX-512 VNNI (256-bit vpdpbusd: same tiles, one instruction per half-chunk) ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define W4_VNNI 1
#include "cpu/w4a16_tile.inc"
#undef W4_VNNI
}  // namespace vnni

void w4_avx512vnni(const W4Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if (a.G == 32) vnni::w4_block_avx<true>(a, m0, m1, n0, n1);
  else vnni::w4_block_avx<false>(a, m0, m1, n0, n1);
}
#pragma GCC pop_options

// ---- AMX-BF16 (on top of the AVX-512 VNNI level), many rows -------------------------
// Not in the SIMDe build of csrc/cpu/tests/check_vnni_emulated.sh (no AMX to emulate,
// and no vcvtne2ps2bf16 in SIMDe); there amx_bf16_available() is false.
#ifndef COMPRESS_ISA_EMULATION
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#include "cpu/w4a16_amx.inc"
#pragma GCC pop_options

// The whole op on the AMX tiles (K % 64 == 0, a tile group size): bf16 activations in
// the B layout, then 32-column panels from a shared counter, dequantized and multiplied.
at::Tensor w4a16_run_amx(const at::Tensor& x, const W4Args& args, at::Tensor* out) {
  const int64_t M = args.M, K = args.K, N = args.N;
  const Scratch work(Scratch::kW4, w4_amx_activation_bytes(M, K));
  uint16_t* xb = reinterpret_cast<uint16_t*>(work.data());
  at::parallel_for(0, w4_amx_padded_rows(M) / 16, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> row(K);
    std::vector<uint16_t> perm(K);
    w4_amx_build_activations(x, b0, b1, xb, row.data(), perm.data());
  });
  at::Tensor y = out ? *out : at::empty({M, N}, x.options().dtype(at::kFloat));
  W4Args a = args;
  a.y = y.data_ptr<float>();
  parallel_grabs(ceil_div(N, kW4AmxCols), kW4AmxPanelsPerGrab, [&](const auto& take) {
    const Scratch mine(Scratch::kW4Panel, w4_amx_thread_bytes(K));
    amx_load_config_16x64();
    for (int64_t p0, p1; take(p0, p1);) w4_block_amx(a, xb, p0, p1, mine.data());
    amx_release();
  });
  return float_to_activation_dtype(y, x.scalar_type());
}
#endif  // COMPRESS_ISA_EMULATION

std::atomic<int64_t> w4_amx_rows{kW4AmxMinRows};

// Exact fallback for the group sizes the tiles do not take (neither 32 nor a multiple of
// 64): dequantize n-blocks to fp32 (w = u * s - s * z) and multiply with at::mm.
at::Tensor w4_dequant_mm(const at::Tensor& x, const at::Tensor& qweight, const float* s, const uint8_t* z,
                         int64_t G, int64_t N4) {
  const int64_t N = qweight.size(0), K = x.size(1), NG = K / G;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor out = at::empty({x.size(0), N}, xf.options());
  W4Args rows{};
  rows.K = K, rows.N4 = N4, rows.w = reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>());
  const int64_t nb = std::max<int64_t>(1, (4 << 20) / (K * 4));
  at::Tensor wf = at::empty({std::min(nb, N), K}, xf.options());
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t n1 = std::min(N, n0 + nb);
    float* dst = wf.data_ptr<float>();
    at::parallel_for(n0, n1, 1, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        const uint8_t* w = w4_row(rows, n);
        const int64_t cs = w4_chunk_stride(rows, n);
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t byte = w[(k / kChunk) * cs + (k % kChunk) / 2];
          const int u = (k & 1) ? (byte >> 4) : (byte & 0xF);
          const int64_t g = n * NG + k / G;
          dst[(n - n0) * K + k] = static_cast<float>(u) * s[g] - s[g] * static_cast<float>(z[g]);
        }
      }
    });
    out.narrow(1, n0, n1 - n0).copy_(at::mm(xf, wf.narrow(0, 0, n1 - n0).t()));
  }
  return out;
}

// The shared body of the entry points; `scale` is fp32 and `zeros` uint8, both [N, NG].
// `tiled`: qweight is in the prepared row tiling (w4a16_gemm_prepared), else canonical.
// `out`: where to write y (fp32 x only; w4a16_gemm_prepared_into), else a new tensor.
at::Tensor w4a16_run(const at::Tensor& x_in, const at::Tensor& qweight_in,
                     const at::Tensor& scale, const at::Tensor& zeros, int64_t G, bool tiled,
                     at::Tensor* out = nullptr) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0), NG = K / G;
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous();
  if (M == 0 || N == 0) return out ? out->zero_() : at::zeros({M, N}, x.options());
  const float* s = scale.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  const int64_t N4 = tiled && K % kChunk == 0 ? N - N % kTileRows : 0;
  // The tiles take groups of 32 (two to a 64-k chunk) or of a multiple of 64 (whole
  // chunks); other sizes (16, 96, 160, ...) go through the exact dequantizing path.
  if (G % kBlock != 0 || (G != kBlock && G % kChunk != 0)) {
    at::Tensor y = w4_dequant_mm(x, qweight, s, z, G, N4);
    return out ? out->copy_(y) : float_to_activation_dtype(y, x.scalar_type());
  }

  const int64_t KC = ceil_div(K, kChunk);
#ifndef COMPRESS_ISA_EMULATION
  if (active_isa() == Isa::Avx512Vnni && K % kChunk == 0 && M >= std::max<int64_t>(2, w4::amx_min_rows()) &&
      amx_bf16_available()) {
    const W4Args a{M, N, K, G, KC, NG, N4, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()), s, z,
                   nullptr, nullptr, nullptr, nullptr};
    return w4a16_run_amx(x, a, out);
  }
#endif
  // One workspace for the quantized activations (int8 [M, KC*64]), their lane scales
  // (fp32 [M, KC*8]) and group sums (fp32 [M, NG]): a decode step makes ~100 of these calls.
  const int64_t xq_bytes = M * KC * kChunk, xs_floats = M * KC * 8;
  const Scratch work(Scratch::kW4, xq_bytes + 4 * (xs_floats + M * NG));
  int8_t* xq = reinterpret_cast<int8_t*>(work.data());
  float* xs = reinterpret_cast<float*>(work.data() + xq_bytes);  // xq_bytes % 64 == 0
  float* xg = xs + xs_floats;
  quantize_activations(x, G, KC, xq, xs, xg);

  at::Tensor y = out ? *out : at::empty({M, N}, x.options().dtype(at::kFloat));
  W4Args a{M, N, K, G, KC, NG, N4, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()), s, z,
           xq, xs, xg, y.data_ptr<float>()};
  void (*kernel)(const W4Args&, int64_t, int64_t, int64_t, int64_t) = w4_scalar;
  switch (active_isa()) {
    case Isa::Avx512Vnni: kernel = w4_avx512vnni; break;
    case Isa::Avx2: kernel = w4_avx2; break;
    default: break;
  }
  // n-blocks of ~128 KiB of packed weights (L2), m-blocks of 64 rows.
  const int64_t nb = std::max<int64_t>(8, ((128 << 10) / std::max<int64_t>(1, K / 2)) / 8 * 8);
  parallel_tiles(M, N, 64, nb, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) { kernel(a, m0, m1, n0, n1); });
  return float_to_activation_dtype(y, x.scalar_type());
}

void check_w4_args(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const at::Tensor& zeros, int64_t G) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt, op, ": qweight must be int32 [N, K/8]");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * 8 == K, op, ": qweight [N, K/8] does not match K=", K);
  TORCH_CHECK(G > 0 && K % G == 0, op, ": group_size ", G, " must divide K=", K);
  TORCH_CHECK(scales.numel() == N * (K / G) && zeros.numel() == N * (K / G), op,
              ": scales/zeros must be [N, K/group_size]");
}

// The prepared entry points take the load-time fp32 scales and uint8 zero points.
void check_prepared_metadata(const char* op, const at::Tensor& scale, const at::Tensor& zeros) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && zeros.scalar_type() == at::kByte && scale.is_contiguous() &&
                  zeros.is_contiguous(),
              op, ": scale must be contiguous float32 and zeros contiguous uint8 (see w4a16_prepare_cpu), got ",
              scale.scalar_type(), " and ", zeros.scalar_type());
}

}  // namespace

int64_t w4::set_amx_min_rows(int64_t rows) { return w4_amx_rows.exchange(rows); }
int64_t w4::amx_min_rows() { return w4_amx_rows.load(std::memory_order_relaxed); }

// Canonical checkpoint tensors (scales fp32/fp16/bf16, zeros uint8): converted to the
// kernel's fp32 (scale, scale * zero) per call. The runtime prepares once at load time
// (reference.w4a16_prepare_cpu: row-tiled qweight, fp32 scales) and calls
// w4a16_gemm_prepared instead.
at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size) {
  check_w4_args("w4a16_gemm", x, qweight, scales, zeros, group_size);
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  return w4a16_run(x, qweight, sf, zeros.to(at::kByte).contiguous(), group_size, /*tiled=*/false);
}

at::Tensor w4a16_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const at::Tensor& zeros, int64_t group_size) {
  check_w4_args("w4a16_gemm_prepared", x, qweight, scale, zeros, group_size);
  check_prepared_metadata("w4a16_gemm_prepared", scale, zeros);
  return w4a16_run(x, qweight, scale, zeros, group_size, /*tiled=*/true);
}

at::Tensor& w4a16_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                     const at::Tensor& zeros, int64_t group_size, at::Tensor& out) {
  check_w4_args("w4a16_gemm_prepared_into", x, qweight, scale, zeros, group_size);
  check_prepared_metadata("w4a16_gemm_prepared_into", scale, zeros);
  check_float_out("w4a16_gemm_prepared_into", x, qweight.size(0), out);
  w4a16_run(x, qweight, scale, zeros, group_size, /*tiled=*/true, &out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w4a16_gemm", &compress_cpu::w4a16_gemm);
  m.impl("w4a16_gemm_prepared", &compress_cpu::w4a16_gemm_prepared);
}
