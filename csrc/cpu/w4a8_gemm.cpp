// compress::w4a8_gemm on CPU: x [M, K] (fp32 / bf16 / fp16) @ dequant(int4 W [N, K])^T with
// the activations quantized to int8 per block of 32: the fast path of a w4a16 checkpoint
// (LLM(w4_activations="int8")), not its promised numbers (w4a16_gemm.cpp computes those).
// Reference: compress/ops/reference.py::w4a8_gemm. Layout notes: csrc/cpu/README.md.
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
// Group sizes that are not a multiple of 32 take the float path (w4::run_float), as
// the reference does. Many rows on CPUs with AMX-BF16: bf16 tiles (w4a16_amx.inc).
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/amx_common.h"
#include "cpu/kernel_common.h"
#include "cpu/ops.h"
#include "cpu/w4a16_common.h"
#include "cpu/w4a16_kernel.h"

namespace compress_cpu {
namespace {

using namespace w4;

std::atomic<bool> w4_shared_unpack{true};
inline bool w4_shared_unpack_on() { return w4_shared_unpack.load(std::memory_order_relaxed); }

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

#include "cpu/w4a8_panel.inc"

// Many rows on the panel GEMM (w4a8_panel.inc): `a` carries the quantized activations.
void w4_panel_gemm(const W4Args& a) {
  constexpr int R = panel::kPanelRows;
  const int64_t MB = ceil_div(a.M, panel::kLanes);
  w4::run_panel_gemm(
      MB, panel::act_panel_bytes(MB, a.KC, a.NG), std::max<int64_t>(1, panel::kActBudget / (a.K * panel::kLanes)),
      ceil_div(a.N, R),
      [&](int64_t mb, uint8_t* act) { panel::build_act_block(a, panel::act_panel_at(act, MB, a.KC, a.NG), mb); },
      [&](uint8_t* act, int64_t mb0, int64_t mb1, int64_t p0, int64_t p1) {
        const Scratch mine(Scratch::kW4Panel, panel::thread_bytes(a.K, R));
        panel::run_panels<R>(a, panel::act_panel_at(act, MB, a.KC, a.NG), mb0, mb1, p0, p1, mine.data());
      });
}
#pragma GCC pop_options

std::atomic<int64_t> w4_panel_rows{kW4PanelMinRows};

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
at::Tensor w4a8_run_amx(const at::Tensor& x, const W4Args& args, at::Tensor* out) {
  const int64_t M = args.M, K = args.K, N = args.N;
  const Scratch work(Scratch::kW4, w4_amx_activation_bytes(M, K));
  uint16_t* xb = reinterpret_cast<uint16_t*>(work.data());
  at::parallel_for(0, w4_amx_padded_rows(M) / 16, 1, [&](int64_t b0, int64_t b1) {
    // K fp32 and 16 x K bf16 of this thread's scratch (the kW4 slot holds xb; kW4Panel is
    // free until the tiles below take it)
    const Scratch mine(Scratch::kW4Panel, K * 4 + 16 * K * 2);
    float* row = reinterpret_cast<float*>(mine.data());
    w4_amx_build_activations(x, b0, b1, xb, row, reinterpret_cast<uint16_t*>(mine.data() + K * 4));
  });
  at::Tensor y = out ? *out : at::empty({M, N}, x.options().dtype(at::kFloat));
  W4Args a = args;
  a.y = y.data_ptr<float>();
  const bool small = M <= 32;  // w4_block_amx_small: no whole panel
  parallel_grabs(ceil_div(N, kW4AmxCols), small ? 2 : w4_amx_panels_per_grab(K), [&](const auto& take) {
    const Scratch mine(Scratch::kW4Panel, small ? w4_amx_small_bytes() : w4_amx_thread_bytes(K));
    amx_load_config_16x64();
    for (int64_t p0, p1; take(p0, p1);) {
      if (!small) w4_block_amx(a, xb, p0, p1, mine.data());
      else if (M > 16) w4_block_amx_small<true>(a, xb, p0, p1, mine.data());
      else w4_block_amx_small<false>(a, xb, p0, p1, mine.data());
    }
    amx_release();
  });
  return float_to_activation_dtype(y, x.scalar_type());
}
#endif  // COMPRESS_ISA_EMULATION

std::atomic<int64_t> w4_amx_rows{kW4AmxMinRows};

// The shared body of the entry points; `scale` is fp32 and `zeros` uint8, both [N, NG].
// `tiled`: qweight is in the prepared row tiling (w4a8_gemm_prepared), else canonical.
// `out`: where to write y (fp32 x only; w4a8_gemm_prepared_into), else a new tensor.
at::Tensor w4a8_run(const at::Tensor& x_in, const at::Tensor& qweight_in,
                    const at::Tensor& scale, const at::Tensor& zeros, int64_t G, bool tiled,
                    at::Tensor* out = nullptr) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0), NG = K / G;
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous();
  if (M == 0 || N == 0) return out ? out->zero_() : at::zeros({M, N}, x.options());
  const float* s = scale.data_ptr<float>();
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  const int64_t N4 = tiled && K % kChunk == 0 ? N - N % kTileRows : 0;
  // The tiles take groups of 32 (two to a 64-k chunk) or of a multiple of 64 (whole
  // chunks); other sizes (16, 96, 160, ...) take the float path (reference.w4a8_gemm).
  if (G != kBlock && G % kChunk != 0) return w4::run_float(x, qweight, scale, zeros, G, tiled, out);

  const int64_t KC = ceil_div(K, kChunk);
#ifndef COMPRESS_ISA_EMULATION
  if (active_isa() == Isa::Avx512Vnni && K % kChunk == 0 && M >= std::max<int64_t>(2, w4::amx_min_rows()) &&
      amx_bf16_available()) {
    const W4Args a{M, N, K, G, KC, NG, N4, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()), s, z,
                   nullptr, nullptr, nullptr, nullptr};
    return w4a8_run_amx(x, a, out);
  }
#endif
  const QuantizedActivations q(x, G, KC);
  at::Tensor y = out ? *out : at::empty({M, N}, x.options().dtype(at::kFloat));
  W4Args a{M, N, K, G, KC, NG, N4, reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>()), s, z,
           q.xq, q.xs, q.xg, y.data_ptr<float>()};
  if (active_isa() == Isa::Avx512Vnni && K % kChunk == 0 && M >= std::max<int64_t>(2, w4::panel_min_rows())) {
    w4_panel_gemm(a);
    return float_to_activation_dtype(y, x.scalar_type());
  }
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

}  // namespace

w4::QuantizedActivations::QuantizedActivations(const at::Tensor& x, int64_t G, int64_t KC)
    : work(Scratch::kW4, x.size(0) * KC * (kChunk + 4 * 8) + 4 * x.size(0) * (x.size(1) / G)) {
  const int64_t M = x.size(0), K = x.size(1), NG = K / G;
  xq = reinterpret_cast<int8_t*>(work.data());
  xs = reinterpret_cast<float*>(work.data() + M * KC * kChunk);  // M * KC * 64 bytes: 64-aligned
  xg = xs + M * KC * 8;
  const bool avx2 = active_isa() >= Isa::Avx2;
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(x.scalar_type() == at::kFloat ? 0 : K);
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x.scalar_type() == at::kFloat ? x.data_ptr<float>() + m * K : buf.data();
      if (!buf.empty()) row_to_float(x, m, buf.data());
      quantize_row(row, K, G, KC, avx2, xq + m * KC * kChunk, xs + m * KC * 8, xg + m * NG);
    }
  });
}

bool set_w4a8_shared_unpack(bool on) { return w4_shared_unpack.exchange(on); }

int64_t w4::set_panel_min_rows(int64_t rows) { return w4_panel_rows.exchange(rows); }
int64_t w4::panel_min_rows() { return w4_panel_rows.load(std::memory_order_relaxed); }
int64_t w4::set_amx_min_rows(int64_t rows) { return w4_amx_rows.exchange(rows); }
int64_t w4::amx_min_rows() { return w4_amx_rows.load(std::memory_order_relaxed); }

// Canonical checkpoint tensors (scales fp32/fp16/bf16, zeros uint8): converted to the
// kernel's fp32 scales per call. The runtime prepares once at load time
// (reference.w4a16_prepare_cpu: row-tiled qweight, fp32 scales) and calls
// w4a8_gemm_prepared instead.
at::Tensor w4a8_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t group_size) {
  w4::check_args("w4a8_gemm", x, qweight, scales, zeros, group_size);
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  return w4a8_run(x, qweight, sf, zeros.to(at::kByte).contiguous(), group_size, /*tiled=*/false);
}

at::Tensor w4a8_gemm_prepared(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                              const at::Tensor& zeros, int64_t group_size) {
  w4::check_args("w4a8_gemm_prepared", x, qweight, scale, zeros, group_size);
  w4::check_prepared_metadata("w4a8_gemm_prepared", scale, zeros);
  return w4a8_run(x, qweight, scale, zeros, group_size, /*tiled=*/true);
}

at::Tensor& w4a8_gemm_prepared_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                    const at::Tensor& zeros, int64_t group_size, at::Tensor& out) {
  w4::check_args("w4a8_gemm_prepared_into", x, qweight, scale, zeros, group_size);
  w4::check_prepared_metadata("w4a8_gemm_prepared_into", scale, zeros);
  check_float_out("w4a8_gemm_prepared_into", x, qweight.size(0), out);
  w4a8_run(x, qweight, scale, zeros, group_size, /*tiled=*/true, &out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w4a8_gemm", &compress_cpu::w4a8_gemm);
  m.impl("w4a8_gemm_prepared", &compress_cpu::w4a8_gemm_prepared);
}
