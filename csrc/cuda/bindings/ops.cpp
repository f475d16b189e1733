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

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "cuda/kernels.h"
#include "cuda/op_checks.h"

namespace compress_cuda {
namespace {

cpk::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return cpk::DType::kF16;
    case at::kBFloat16: return cpk::DType::kBF16;
    case at::kChar: return cpk::DType::kI8;  // op_checks.h admits it for paged attention's pools only
    default: return cpk::DType::kF32;  // op_checks.h admits float16, bfloat16 and float32 otherwise
  }
}

cpk::TensorDesc describe(const at::Tensor& t, const char* name) {
  cpk::TensorDesc d{};
  d.name = name;
  d.device = t.is_cuda() ? cpk::Dev::kCUDA : t.is_cpu() ? cpk::Dev::kCPU : cpk::Dev::kOther;
  d.index = t.device().has_index() ? t.device().index() : -1;
  switch (t.scalar_type()) {
    case at::kHalf: d.kind = cpk::Kind::kF16; break;
    case at::kBFloat16: d.kind = cpk::Kind::kBF16; break;
    case at::kFloat: d.kind = cpk::Kind::kF32; break;
    case at::kByte: d.kind = cpk::Kind::kU8; break;
    case at::kChar: d.kind = cpk::Kind::kI8; break;
    case at::kShort: d.kind = cpk::Kind::kI16; break;
    case at::kInt: d.kind = cpk::Kind::kI32; break;
    case at::kLong: d.kind = cpk::Kind::kI64; break;
    default: d.kind = cpk::Kind::kOther; break;
  }
  d.dim = static_cast<int>(t.dim());
  d.size0 = t.dim() > 0 ? t.size(0) : 0;
  d.size1 = t.dim() > 1 ? t.size(1) : 0;
  d.numel = t.numel();
  d.size2 = t.dim() > 2 ? t.size(2) : 0;
  d.size3 = t.dim() > 3 ? t.size(3) : 0;
  return d;
}

void raise_if(const std::string& msg, const char* op) { TORCH_CHECK(msg.empty(), op, ": ", msg); }

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

// ---- W4A16 -------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a16_shuffle_for_cuda(const at::Tensor& qweight,
                                                                      const at::Tensor& scales,
                                                                      const at::Tensor& zeros, int64_t group_size) {
  constexpr const char* op = "w4a16_shuffle_for_cuda";
  raise_if(cpk::check_w4a16_shuffle(describe(qweight, "qweight"), describe(scales, "scales"), describe(zeros, "zeros"),
                                    group_size),
           op);
  const c10::cuda::CUDAGuard guard(qweight.device());
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8;
  const int64_t g = k / group_size, np = round_up(n, 128), kp = round_up(k, 64);
  const int64_t gp = (kp + group_size - 1) / group_size;
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
  raise_if(cpk::check_w4a16_gemm_shuffled(describe(x, "x"), describe(qweight_shuffled, "qweight_shuffled"),
                                          describe(scales_t, "scales_t"), describe(zeros_t, "zeros_t"), group_size, n),
           op);
  const c10::cuda::CUDAGuard guard(x.device());
  const cpk::DType dt = dtype_of(x);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t np = qweight_shuffled.size(0) * 16, kp = qweight_shuffled.size(1) / 2;
  at::Tensor xc = aligned16(x);
  // a no-op where the scales already have x's dtype (the runtime converts them once)
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
  raise_if(cpk::check_w4a16_gemm(describe(x, "x"), describe(qweight, "qweight"), describe(scales, "scales"),
                                 describe(zeros, "zeros"), group_size),
           op);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8;
  const cpk::DType dt = dtype_of(x);
  if (dt != cpk::DType::kF32 && group_size % 16 == 0) {
    // canonical layout at call time: shuffle, then the tensor-core kernel (the runtime
    // shuffles once at load time and calls w4a16_gemm_shuffled instead)
    auto [qs, st, zt] = w4a16_shuffle_for_cuda(qweight, scales, zeros, group_size);
    return w4a16_gemm_shuffled(x, qs, st, zt, group_size, n);
  }
  // any group size / float32: dequantize, then cuBLAS
  at::Tensor q = qweight.contiguous();
  at::Tensor s = scales.to(x.scalar_type()).contiguous();
  at::Tensor z = zeros.to(at::kByte).contiguous();  // zero points 0..15 in any integer dtype
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
  raise_if(cpk::check_quantize_rows(describe(x, "x")), op);
  const c10::cuda::CUDAGuard guard(x.device());
  const cpk::DType dt = dtype_of(x);
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
  {
    const cpk::TensorDesc idx = outlier_idx ? describe(*outlier_idx, "outlier_idx") : cpk::TensorDesc{};
    const cpk::TensorDesc ow = outlier_weight ? describe(*outlier_weight, "outlier_weight") : cpk::TensorDesc{};
    raise_if(cpk::check_w8a8(describe(x, "x"), describe(qweight, "qweight"), describe(weight_scale, "weight_scale"),
                             outlier_idx ? &idx : nullptr, outlier_weight ? &ow : nullptr),
             op);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cpk::DType dt = dtype_of(x);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  const int64_t kq = round_up(k, 16);
  at::Tensor xc = x.contiguous();
  at::Tensor idx, xo, wo;
  int64_t c = 0;
  if (outlier_idx != nullptr) {
    c = outlier_idx->numel();
    if (c > 0) {
      idx = outlier_idx->to(at::kLong).contiguous();
      xo = at::empty({m, c}, x.options());
      // fp32 as in the reference (a no-op where the runtime converted them at load time)
      wo = outlier_weight->to(at::kFloat).contiguous();
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
  a.w_outliers = c > 0 ? wo.data_ptr<float>() : nullptr;
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

// ---- paged decode attention ----------------------------------------------------
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t window) {
  constexpr const char* op = "paged_decode_attention";
  raise_if(cpk::check_paged_decode_attention(describe(q, "q"), describe(k_pool, "k_pool"), describe(v_pool, "v_pool"),
                                             describe(block_tables, "block_tables"),
                                             describe(context_lens, "context_lens"), window),
           op);
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, op, ": k_pool and v_pool need a contiguous last dim");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  cpk::PagedAttnArgs a{};
  a.q = qc.data_ptr();
  a.k_pool = k_pool.data_ptr();
  a.v_pool = v_pool.data_ptr();
  for (int i = 0; i < 3; ++i) a.k_stride[i] = k_pool.stride(i), a.v_stride[i] = v_pool.stride(i);
  a.block_tables = tables.data_ptr<int32_t>();
  a.context_lens = lens.data_ptr<int32_t>();
  a.out = out.data_ptr();
  a.rows = static_cast<int>(q.size(0));
  a.n_heads = static_cast<int>(q.size(1));
  a.n_kv_heads = static_cast<int>(k_pool.size(1));
  a.head_dim = static_cast<int>(q.size(2));
  a.num_blocks = static_cast<int>(k_pool.size(0));
  a.block_size = static_cast<int>(k_pool.size(2));
  a.table_cols = static_cast<int>(tables.size(1));
  a.window = static_cast<int>(window);
  a.scale = 1.f / std::sqrt(static_cast<float>(q.size(2)));
  at::Tensor workspace;  // the splits' partials, when a row may have more than one
  if (const long long n = cpk::plan_paged_decode_attention(a); n > 0) {
    workspace = at::empty({n}, qc.options().dtype(at::kFloat));
    a.workspace = workspace.data_ptr<float>();
  }
  check_launch(cpk::launch_paged_decode_attention(dtype_of(qc), dtype_of(k_pool), a, stream()), op);
  return out;
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
  m.impl("paged_decode_attention", &compress_cuda::paged_decode_attention);
}

// set_paged_attention_kernel("split" | "heads"): the kernel paged_decode_attention launches
// (kernels.h: PagedKernel); returns the previous one's name.
static PyObject* py_set_paged_attention_kernel(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : nullptr;
  if (name == nullptr || (std::strcmp(name, "split") != 0 && std::strcmp(name, "heads") != 0)) {
    PyErr_SetString(PyExc_ValueError, "set_paged_attention_kernel: expected 'split' or 'heads'");
    return nullptr;
  }
  const bool was_split = cpk::paged_attention_kernel() == cpk::PagedKernel::kSplit;
  cpk::set_paged_attention_kernel(std::strcmp(name, "split") == 0 ? cpk::PagedKernel::kSplit
                                                                  : cpk::PagedKernel::kHeads);
  return PyUnicode_FromString(was_split ? "split" : "heads");
}

static PyMethodDef compress_cuda_methods[] = {
    {"set_paged_attention_kernel", py_set_paged_attention_kernel, METH_O,
     "The CUDA paged decode attention kernel: 'split' (a block per row, kv head and 256 positions; the default) "
     "or 'heads' (a block per row and query head, the baseline); returns the previous one."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef compress_cuda_module = {PyModuleDef_HEAD_INIT, "_cuda", "compress CUDA kernels", -1,
                                                  compress_cuda_methods};

PyMODINIT_FUNC PyInit__cuda(void) { return PyModule_Create(&compress_cuda_module); }
