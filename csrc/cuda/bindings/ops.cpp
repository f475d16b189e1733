// Torch bindings of the CUDA kernels: compress._cuda. Importing the module runs
// the TORCH_LIBRARY_IMPL(compress, CUDA) registrations below, so the
// torch.ops.compress.* ops dispatch to these kernels for CUDA tensors. Only
// argument checks, allocation and launch here; the kernels (csrc/cuda/*.cu) do
// not see torch.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/kernels.h"

namespace compress_cuda {
namespace {

cpk::DType dtype_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kHalf: return cpk::DType::kF16;
    case at::kBFloat16: return cpk::DType::kBF16;
    case at::kFloat: return cpk::DType::kF32;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type(), " (float16, bfloat16 or float32)");
  }
  return cpk::DType::kF32;
}

void check_launch(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(e));
}

int sm_count(const at::Tensor& t) {
  int n = 0;
  check_launch(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, t.get_device()), "sm_count");
  return n;
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// cp.async moves 16-byte chunks: operands must start 16-byte aligned.
at::Tensor aligned16(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

void check_2d_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.sizes());
}

// ---- W4A16 -------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a16_shuffle_for_cuda(const at::Tensor& qweight,
                                                                      const at::Tensor& scales,
                                                                      const at::Tensor& zeros, int64_t group_size) {
  constexpr const char* op = "w4a16_shuffle_for_cuda";
  check_2d_cuda(qweight, op, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kInt, op, ": qweight must be int32 [N, K/8]");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8;
  TORCH_CHECK(group_size > 0 && k % group_size == 0, op, ": group_size must divide K");
  const int64_t g = k / group_size, np = round_up(n, 128), kp = round_up(k, 64);
  const int64_t gp = (kp + group_size - 1) / group_size;
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({n, g}) && zeros.sizes() == at::IntArrayRef({n, g}), op,
              ": scales / zeros must be [N, K/group_size]");
  at::Tensor q = qweight.contiguous();
  at::Tensor out = at::empty({np / 16, kp * 2}, q.options());
  check_launch(cpk::launch_w4a16_shuffle(q.data_ptr<int32_t>(), static_cast<int>(n), static_cast<int>(k),
                                         out.data_ptr<int32_t>(), stream()),
               op);
  at::Tensor scales_t = at::zeros({gp, np}, scales.options());
  scales_t.narrow(0, 0, g).narrow(1, 0, n).copy_(scales.t());
  at::Tensor zeros_t = at::zeros({gp, np}, zeros.options().dtype(at::kByte));
  zeros_t.narrow(0, 0, g).narrow(1, 0, n).copy_(zeros.t());
  return {out, scales_t, zeros_t};
}

at::Tensor w4a16_gemm_shuffled(const at::Tensor& x, const at::Tensor& qweight_shuffled, const at::Tensor& scales_t,
                               const at::Tensor& zeros_t, int64_t group_size, int64_t n) {
  constexpr const char* op = "w4a16_gemm_shuffled";
  check_2d_cuda(x, op, "x");
  check_2d_cuda(qweight_shuffled, op, "qweight_shuffled");
  const c10::cuda::CUDAGuard guard(x.device());
  const cpk::DType dt = dtype_of(x, op);
  TORCH_CHECK(dt != cpk::DType::kF32, op, ": x must be float16 or bfloat16 (use w4a16_gemm for float32)");
  TORCH_CHECK(group_size % 16 == 0, op, ": group_size must be a multiple of 16 (use w4a16_gemm), got ", group_size);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t np = qweight_shuffled.size(0) * 16, kp = qweight_shuffled.size(1) / 2;
  TORCH_CHECK(k % 8 == 0 && kp == round_up(k, 64) && np == round_up(n, 128), op,
              ": qweight_shuffled [", qweight_shuffled.size(0), ", ", qweight_shuffled.size(1),
              "] does not match K=", k, ", N=", n);
  const int64_t gp = (kp + group_size - 1) / group_size;
  TORCH_CHECK(scales_t.sizes() == at::IntArrayRef({gp, np}) && zeros_t.sizes() == at::IntArrayRef({gp, np}) &&
                  zeros_t.scalar_type() == at::kByte,
              op, ": scales_t / zeros_t must be [", gp, ", ", np, "] (zeros uint8)");
  at::Tensor xc = aligned16(x);
  at::Tensor st = scales_t.to(x.scalar_type()).contiguous();
  at::Tensor zt = zeros_t.contiguous();
  at::Tensor qs = aligned16(qweight_shuffled);
  at::Tensor y = at::empty({m, n}, x.options());
  cpk::W4A16Args a{};
  a.x = xc.data_ptr();
  a.qshuf = qs.data_ptr<int32_t>();
  a.scales_t = st.data_ptr();
  a.zeros_t = zt.data_ptr<uint8_t>();
  a.y = y.data_ptr();
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  a.np = static_cast<int>(np);
  a.kp = static_cast<int>(kp);
  a.group_size = static_cast<int>(group_size);
  a.splits = m == 0 ? 1 : cpk::w4a16_splits(a.m, a.np, a.kp, sm_count(x));
  at::Tensor ws;
  if (a.splits > 1) {
    ws = at::empty({a.splits, m, n}, x.options().dtype(at::kFloat));
    a.workspace = ws.data_ptr<float>();
  }
  check_launch(cpk::launch_w4a16_gemm(dt, a, stream()), op);
  return y;
}

at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size) {
  constexpr const char* op = "w4a16_gemm";
  check_2d_cuda(x, op, "x");
  check_2d_cuda(qweight, op, "qweight");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8;
  TORCH_CHECK(x.size(1) == k, op, ": x has K=", x.size(1), " but qweight has K=", k);
  const cpk::DType dt = dtype_of(x, op);
  if (dt != cpk::DType::kF32 && group_size % 16 == 0) {
    // canonical layout at call time: shuffle, then the tensor-core kernel (the runtime
    // shuffles once at load time and calls w4a16_gemm_shuffled instead)
    auto [qs, st, zt] = w4a16_shuffle_for_cuda(qweight, scales, zeros, group_size);
    return w4a16_gemm_shuffled(x, qs, st, zt, group_size, n);
  }
  // any group size / float32: dequantize, then cuBLAS
  TORCH_CHECK(group_size > 0 && k % group_size == 0, op, ": group_size must divide K");
  at::Tensor q = qweight.contiguous();
  at::Tensor s = scales.to(x.scalar_type()).contiguous();
  at::Tensor z = zeros.contiguous();
  at::Tensor w = at::empty({n, k}, x.options());
  check_launch(cpk::launch_w4a16_dequant(dt, q.data_ptr<int32_t>(), s.data_ptr(), z.data_ptr<uint8_t>(),
                                         static_cast<int>(n), static_cast<int>(k), static_cast<int>(group_size),
                                         w.data_ptr(), stream()),
               op);
  return at::matmul(x, w.t());
}

// ---- int8 ----------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> quantize_per_token_int8(const at::Tensor& x) {
  constexpr const char* op = "quantize_per_token_int8";
  check_2d_cuda(x, op, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const cpk::DType dt = dtype_of(x, op);
  at::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m}, x.options().dtype(at::kFloat));
  check_launch(cpk::launch_quantize_rows(dt, xc.data_ptr(), static_cast<int>(m), static_cast<int>(k),
                                         static_cast<int>(k), nullptr, 0, q.data_ptr<int8_t>(),
                                         scale.data_ptr<float>(), nullptr, stream()),
               op);
  return {q, scale};
}

at::Tensor w8a8_impl(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                     const at::Tensor* outlier_idx, const at::Tensor* outlier_weight) {
  check_2d_cuda(x, op, "x");
  check_2d_cuda(qweight, op, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kChar, op, ": qweight must be int8 [N, K]");
  const c10::cuda::CUDAGuard guard(x.device());
  const cpk::DType dt = dtype_of(x, op);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == k, op, ": x has K=", k, " but qweight has K=", qweight.size(1));
  TORCH_CHECK(weight_scale.numel() == n, op, ": weight_scale must have N=", n, " elements");
  const int64_t kq = round_up(k, 16);
  at::Tensor xc = x.contiguous();
  at::Tensor idx, xo, wo;
  int64_t c = 0;
  if (outlier_idx != nullptr) {
    c = outlier_idx->numel();
    TORCH_CHECK(outlier_weight->dim() == 2 && outlier_weight->size(0) == n && outlier_weight->size(1) == c, op,
                ": outlier_weight must be [N, C] = [", n, ", ", c, "]");
    if (c > 0) {
      idx = outlier_idx->to(x.device(), at::kLong).contiguous();
      xo = at::empty({m, c}, x.options());
      wo = outlier_weight->to(x.scalar_type()).contiguous();
    }
  }
  at::Tensor xq = at::empty({m, kq}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m}, x.options().dtype(at::kFloat));
  check_launch(cpk::launch_quantize_rows(dt, xc.data_ptr(), static_cast<int>(m), static_cast<int>(k),
                                         static_cast<int>(kq), c > 0 ? idx.data_ptr<int64_t>() : nullptr,
                                         static_cast<int>(c), xq.data_ptr<int8_t>(), sx.data_ptr<float>(),
                                         c > 0 ? xo.data_ptr() : nullptr, stream()),
               op);
  at::Tensor wq = kq == k ? aligned16(qweight) : at::constant_pad_nd(qweight, {0, kq - k}).contiguous();
  at::Tensor ws = weight_scale.reshape({n}).to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  cpk::W8A8Args a{};
  a.xq = xq.data_ptr<int8_t>();
  a.x_scale = sx.data_ptr<float>();
  a.wq = wq.data_ptr<int8_t>();
  a.w_scale = ws.data_ptr<float>();
  a.x_outliers = c > 0 ? xo.data_ptr() : nullptr;
  a.w_outliers = c > 0 ? wo.data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.kq = static_cast<int>(kq);
  a.c = static_cast<int>(c);
  a.splits = m == 0 ? 1 : cpk::w8a8_splits(a.m, a.n, a.kq, sm_count(x));
  at::Tensor acc;
  if (a.splits > 1) {
    acc = at::zeros({m, n}, x.options().dtype(at::kInt));
    a.workspace = acc.data_ptr<int32_t>();
  }
  check_launch(cpk::launch_w8a8_gemm(dt, a, stream()), op);
  return y;
}

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale) {
  return w8a8_impl("w8a8_gemm", x, qweight, weight_scale, nullptr, nullptr);
}

at::Tensor w8a8_outlier_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& weight_scale,
                             const at::Tensor& outlier_idx, const at::Tensor& outlier_weight) {
  return w8a8_impl("w8a8_outlier_gemm", x, qweight, weight_scale, &outlier_idx, &outlier_weight);
}

}  // namespace
}  // namespace compress_cuda

TORCH_LIBRARY_IMPL(compress, CUDA, m) {
  m.impl("w4a16_gemm", &compress_cuda::w4a16_gemm);
  m.impl("w4a16_shuffle_for_cuda", &compress_cuda::w4a16_shuffle_for_cuda);
  m.impl("w4a16_gemm_shuffled", &compress_cuda::w4a16_gemm_shuffled);
  m.impl("quantize_per_token_int8", &compress_cuda::quantize_per_token_int8);
  m.impl("w8a8_gemm", &compress_cuda::w8a8_gemm);
  m.impl("w8a8_outlier_gemm", &compress_cuda::w8a8_outlier_gemm);
}

static struct PyModuleDef compress_cuda_module = {PyModuleDef_HEAD_INIT, "_cuda", "compress CUDA kernels", -1,
                                                  nullptr};

PyMODINIT_FUNC PyInit__cuda(void) { return PyModule_Create(&compress_cuda_module); }
