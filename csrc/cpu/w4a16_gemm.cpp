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

#include <cmath>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/ops.h"

namespace compress_cpu {
namespace {

constexpr int64_t kBlock = 32;  // activation quantization block along K
constexpr int64_t kChunk = 64;  // K per inner step (32 bytes of packed weights)

struct W4Args {
  int64_t M, N, K, G, KC, NG;  // KC: 64-chunks (ceil), NG: groups
  const uint8_t* w;            // qweight bytes, row stride K / 2
  const float* s;              // scales fp32 [N, NG]
  const float* sz;             // scaled zero points s * z, fp32 [N, NG]
  const int8_t* xq;  // [M, KC * 64] permuted int8 activations
  const float* xs;   // [M, KC * 8] lane scales: 4 x sx(block 2c), 4 x sx(block 2c + 1)
  const float* xg;   // [M, NG] X_g
  float* y;          // [M, N]
};

// ---- activation quantization (shared by every ISA so that their numerics agree) ----
void quantize_activations(const at::Tensor& x, int64_t G, int64_t KC, int8_t* xq, float* xs, float* xg) {
  const int64_t M = x.size(0), K = x.size(1), NG = K / G;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(KC * kChunk, 0.f);
    for (int64_t m = m0; m < m1; ++m) {
      row_to_float(x, m, row.data());
      int8_t* q = xq + m * KC * kChunk;
      float* lane = xs + m * KC * 8;
      float* gsum = xg + m * NG;
      std::fill(gsum, gsum + NG, 0.f);
      std::fill(q, q + KC * kChunk, int8_t(0));
      std::fill(lane, lane + KC * 8, 0.f);
      for (int64_t b = 0; b * kBlock < K; ++b) {
        const float* v = row.data() + b * kBlock;
        float amax = 0.f;
        for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float sx = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        const int64_t c = b / 2, half = b % 2;
        int32_t qsum = 0;
        for (int j = 0; j < kBlock; ++j) {
          const int32_t qi = static_cast<int32_t>(round_half_even(v[j] * inv));
          qsum += qi;
          // position of k = 64c + 32 half + j inside the chunk: even k -> low half
          const int64_t kk = half * kBlock + j;
          q[c * kChunk + (kk & 1) * 32 + (kk >> 1)] = static_cast<int8_t>(qi);
        }
        for (int l = 0; l < 4; ++l) lane[c * 8 + half * 4 + l] = sx;
        gsum[(b * kBlock) / G] += sx * static_cast<float>(qsum);
      }
    }
  });
}

// ---- scalar -------------------------------------------------------------------------
void w4_scalar(const W4Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t row_bytes = a.K / 2, blocks_per_group = a.G / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* q = a.xq + m * a.KC * kChunk;
    const float* lane = a.xs + m * a.KC * 8;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = a.w + n * row_bytes;
      float acc = 0.f, corr = 0.f;
      for (int64_t g = 0; g < a.NG; ++g) {
        float accg = 0.f;
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          const int64_t c = b / 2, half = b % 2;
          const uint8_t* wb = w + b * 16;
          const int8_t* lo = q + c * kChunk + half * 16;
          const int8_t* hi = lo + 32;
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j) dot += (wb[j] & 0xF) * lo[j] + (wb[j] >> 4) * hi[j];
          accg += static_cast<float>(dot) * lane[c * 8 + half * 4];
        }
        acc += a.s[n * a.NG + g] * accg;
        corr += a.sz[n * a.NG + g] * a.xg[m * a.NG + g];
      }
      a.y[m * a.N + n] = acc - corr;
    }
  }
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

// Exact fallback for group sizes that are not a multiple of 32: dequantize n-blocks to
// fp32 (w = u * s - s * z) and multiply with at::mm.
at::Tensor w4_dequant_mm(const at::Tensor& x, const at::Tensor& qweight, const float* s, const float* sz,
                         int64_t G) {
  const int64_t N = qweight.size(0), K = x.size(1), NG = K / G;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor out = at::empty({x.size(0), N}, xf.options());
  const uint8_t* w = reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>());
  const int64_t nb = std::max<int64_t>(1, (4 << 20) / (K * 4));
  at::Tensor wf = at::empty({std::min(nb, N), K}, xf.options());
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t n1 = std::min(N, n0 + nb);
    float* dst = wf.data_ptr<float>();
    at::parallel_for(n0, n1, 1, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t byte = w[n * K / 2 + k / 2];
          const int u = (k & 1) ? (byte >> 4) : (byte & 0xF);
          const int64_t g = n * NG + k / G;
          dst[(n - n0) * K + k] = static_cast<float>(u) * s[g] - sz[g];
        }
    });
    out.narrow(1, n0, n1 - n0).copy_(at::mm(xf, wf.narrow(0, 0, n1 - n0).t()));
  }
  return out;
}

// The shared body of both entry points; `scale` and `scaled_zero` are fp32 [N, NG].
at::Tensor w4a16_run(const at::Tensor& x_in, const at::Tensor& qweight_in,
                     const at::Tensor& scale, const at::Tensor& scaled_zero, int64_t G) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0), NG = K / G;
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous();
  if (M == 0 || N == 0) return at::zeros({M, N}, x.options());
  const float* s = scale.data_ptr<float>();
  const float* sz = scaled_zero.data_ptr<float>();
  if (G % kBlock != 0) return w4_dequant_mm(x, qweight, s, sz, G).to(x.scalar_type());

  const int64_t KC = ceil_div(K, kChunk);
  // One workspace for the quantized activations (int8 [M, KC*64]), their lane scales
  // (fp32 [M, KC*8]) and group sums (fp32 [M, NG]): a decode step makes ~100 of these calls.
  const int64_t xq_bytes = M * KC * kChunk, xs_floats = M * KC * 8;
  at::Tensor work = at::empty({xq_bytes + 4 * (xs_floats + M * NG)}, x.options().dtype(at::kByte));
  int8_t* xq = reinterpret_cast<int8_t*>(work.data_ptr<uint8_t>());
  float* xs = reinterpret_cast<float*>(work.data_ptr<uint8_t>() + xq_bytes);  // xq_bytes % 64 == 0
  float* xg = xs + xs_floats;
  quantize_activations(x, G, KC, xq, xs, xg);

  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  W4Args a{M, N, K, G, KC, NG, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()), s, sz,
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
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
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

}  // namespace

// Canonical checkpoint tensors (scales fp32/fp16/bf16, zeros uint8): converted to the
// kernel's fp32 (scale, scale * zero) per call. The runtime converts once at load time
// and calls w4a16_gemm_prepared instead.
at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size) {
  check_w4_args("w4a16_gemm", x, qweight, scales, zeros, group_size);
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  const at::Tensor szf = (sf * zeros.to(at::kFloat)).contiguous();
  return w4a16_run(x, qweight, sf, szf, group_size);
}

at::Tensor w4a16_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                               const at::Tensor& scaled_zero, int64_t group_size) {
  check_w4_args("w4a16_gemm_prepared", x, qweight, scale, scaled_zero, group_size);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scaled_zero.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && scaled_zero.is_contiguous(),
              "w4a16_gemm_prepared: scale and scaled_zero must be contiguous float32 (see w4a16_prepare_cpu)");
  return w4a16_run(x, qweight, scale, scaled_zero, group_size);
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w4a16_gemm", &compress_cpu::w4a16_gemm);
  m.impl("w4a16_gemm_prepared", &compress_cpu::w4a16_gemm_prepared);
}
