// compress::stream_read_sum on CPU: wrapping int64 sum of a buffer, written as a pure
// streaming read (AVX2 loads, 4 independent accumulators, one contiguous range per
// thread). `compress bench` uses it over >= 1 GiB to measure the DRAM read bandwidth
// the kernels are held against. Reference: reference.py::stream_read_sum.
#include <torch/library.h>

#include <immintrin.h>

#include <vector>

#include "cpu/kernel_common.h"

namespace compress_cpu {
namespace {

int64_t sum_scalar(const int64_t* p, int64_t n) {
  uint64_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<uint64_t>(p[i]);
  return static_cast<int64_t>(s);
}

#pragma GCC push_options
#pragma GCC target("avx2")
int64_t sum_avx2(const int64_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) s += static_cast<uint64_t>(p[i]);
  return static_cast<int64_t>(s);
}
#pragma GCC pop_options

}  // namespace

at::Tensor stream_read_sum(const at::Tensor& buf_in) {
  TORCH_CHECK(buf_in.scalar_type() == at::kLong, "stream_read_sum: buffer must be int64");
  const at::Tensor buf = buf_in.contiguous();
  const int64_t n = buf.numel();
  const int64_t* p = buf.data_ptr<int64_t>();
  const int threads = at::get_num_threads();
  std::vector<int64_t> partial(threads, 0);
  const bool vec = active_isa() != Isa::Scalar;
  // one contiguous slice per thread (grain = n / threads)
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      partial[t] = vec ? sum_avx2(p + lo, hi - lo) : sum_scalar(p + lo, hi - lo);
    }
  });
  uint64_t s = 0;
  for (int64_t v : partial) s += static_cast<uint64_t>(v);
  return at::scalar_tensor(static_cast<int64_t>(s), buf.options());
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("stream_read_sum", &compress_cpu::stream_read_sum); }
