// Shared pieces of the compress CPU kernels: run-time ISA selection, the ATen-facing
// helpers (scale types of tensors, activation rows to fp32) and the work-splitting
// helper. Every kernel file (one op per file) includes this; what needs no ATen (scale
// loading, SIMD helpers) is in simd_common.h.
//
// ISA-specific code is compiled with `#pragma GCC target(...)` regions inside each
// kernel file (setup.py compiles all files with the same flags, and the extension must
// load on any x86-64), and is only called when active_isa() says the CPU supports it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/simd_common.h"

namespace compress_cpu {

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512Vnni = 2 };

// What cpuid (and the OS's XSAVE state) says this CPU can run.
Isa detected_isa();
// The ISA kernels use now: min(detected, override). The override starts from the
// environment variable COMPRESS_CPU_ISA (auto|avx512_vnni|avx2|scalar).
Isa active_isa();
// Sets the override; returns false for an unknown name. "auto" clears it.
bool set_isa_override(const char* name);
const char* isa_name(Isa isa);
// AMX tiles, on top of the avx512_vnni level (not an ISA cap of their own): cpuid has
// AMX-TILE and AMX-INT8 (resp. AMX-BF16), XCR0 has the tile state enabled, and Linux
// granted this process the tile data (asked once). Callers also check active_isa().
bool amx_int8_available();
bool amx_bf16_available();

inline ScaleType scale_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScaleType::F32;
    case at::kHalf: return ScaleType::F16;
    case at::kBFloat16: return ScaleType::BF16;
    default: TORCH_CHECK(false, "compress: scales must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

// Copies a float / bf16 / fp16 activation row into fp32.
inline void row_to_float(const at::Tensor& x, int64_t m, float* dst) {
  const int64_t k = x.size(1);
  switch (x.scalar_type()) {
    case at::kFloat: std::copy_n(x.data_ptr<float>() + m * k, k, dst); break;
    case at::kBFloat16: {
      const c10::BFloat16* src = x.data_ptr<c10::BFloat16>() + m * k;
      for (int64_t j = 0; j < k; ++j) dst[j] = static_cast<float>(src[j]);
      break;
    }
    case at::kHalf: {
      const c10::Half* src = x.data_ptr<c10::Half>() + m * k;
      for (int64_t j = 0; j < k; ++j) dst[j] = static_cast<float>(src[j]);
      break;
    }
    default: TORCH_CHECK(false, "compress: activations must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

// A GEMM's fp32 result `y` (contiguous) as a new tensor of the activations' dtype (y
// itself for fp32), rounded as y.to(dtype) rounds. Our own loop (float_out.cpp): in a
// cold M = 1 call (bench kernels) ATen's copy kernel cost ~40 us of a 0.4-1 ms GEMV.
at::Tensor float_to_activation_dtype(const at::Tensor& y, at::ScalarType dtype);

// The `_into` entry points write y into `out`: fp32 x, out fp32 [M, N] and contiguous.
inline void check_float_out(const char* op, const at::Tensor& x, int64_t N, const at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == N && out.is_contiguous(),
              op, ": needs float32 x and a contiguous float32 out [", x.size(0), ", ", N, "]; got x ",
              x.scalar_type(), ", out ", out.scalar_type(), " ", out.sizes());
}

// Workspace memory reused from call to call on the calling thread. A decode step makes
// ~100 kernel calls that each need a few KiB of workspace; an at::empty per call cost
// ~1-2 us there (glibc malloc, its metadata cold after the weights streamed through the
// caches). `slot` keeps apart users whose workspaces are live at the same time (one per
// kernel). Requests above kMaxBytes (a long prefill) get their own allocation, so no
// thread keeps a large buffer. The contents are whatever the last call left; data() is
// 64-byte aligned (at::empty's CPU allocations are).
class Scratch {
 public:
  enum Slot : int { kW4 = 0, kW8 = 1, kW8Panel = 2, kW4Panel = 3, kW4Amx = 4, kSlots = 5 };
  static constexpr int64_t kMaxBytes = 1 << 20;

  Scratch(Slot slot, int64_t bytes) {
    if (bytes <= kMaxBytes) {
      thread_local std::vector<uint8_t> buffers[kSlots];
      std::vector<uint8_t>& buf = buffers[slot];
      if (static_cast<int64_t>(buf.size()) < bytes + 63) buf = std::vector<uint8_t>(bytes + 63);
      data_ = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    } else {
      owned_ = at::empty({bytes}, at::kByte);
      data_ = owned_.data_ptr<uint8_t>();
    }
  }
  uint8_t* data() const { return data_; }

 private:
  at::Tensor owned_;
  uint8_t* data_ = nullptr;
};

// Items [0, n) handed out `grab` at a time from one shared counter to the intra-op
// threads (as many as have work): `thread_body(take)` runs once per thread, and
// take(begin, end) gives it its next grab, false when none is left. For work whose
// threads need per-thread setup (a workspace, the AMX tile state) and should balance
// dynamically: the development VMs' two vCPUs run at different speeds from call to call.
template <typename F>
inline void parallel_grabs(int64_t n, int64_t grab, const F& thread_body) {
  std::atomic<int64_t> next{0};
  const auto take = [&](int64_t& begin, int64_t& end) {
    begin = next.fetch_add(grab, std::memory_order_relaxed);
    end = std::min(n, begin + grab);
    return begin < n;
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), ceil_div(n, grab)), 1,
                   [&](int64_t, int64_t) { thread_body(take); });
}

// Items [0, n) in one contiguous part per intra-op thread (boundaries multiples of
// `align`); each thread takes `chunk` items at a time from the front of its own part and,
// once that is empty, from the back of the others': fn(begin, end) per take. A thread
// streams its own run front to back as with a static split, but a thread held up (the
// two vCPUs of these VMs are shared with the sandbox's agents, which take one for ~4 ms
// about once a second) delays the call by about half the hold instead of all of it,
// because the other thread takes over the rest of its part. Which thread computes an
// item never changes its result.
namespace parts {
inline std::atomic<bool> g_stealing{true};
inline std::atomic<int64_t> g_test_hold_us{0};  // thread 0 waits this long before its first take (tests)
inline std::atomic<int64_t> g_items_stolen{0};
constexpr int64_t kMaxParts = 64;
}  // namespace parts
// Turns the take-over on or off (off: every thread does its own part only); returns the previous setting.
inline bool set_parts_stealing(bool on) { return parts::g_stealing.exchange(on); }

template <typename F>
inline void parallel_parts_stealing(int64_t n, int64_t align, int64_t chunk, const F& fn) {
  if (n <= 0) return;
  const int64_t units = ceil_div(n, align);
  const int64_t nparts = std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), units, parts::kMaxParts});
  if (nparts <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  struct alignas(64) Part {
    std::atomic<uint64_t> left;   // front << 32 | back: items [front, back) not yet taken
  };
  Part part[parts::kMaxParts];
  for (int64_t p = 0; p < nparts; ++p) {
    const uint64_t front = std::min(n, align * (p * units / nparts)), back = std::min(n, align * ((p + 1) * units / nparts));
    part[p].left.store(front << 32 | back, std::memory_order_relaxed);
  }
  const auto take = [&](int64_t p, bool from_front, int64_t& begin, int64_t& end) {
    uint64_t cur = part[p].left.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(cur >> 32), back = static_cast<int64_t>(cur & 0xffffffffu);
      if (front >= back) return false;
      begin = from_front ? front : std::max(front, back - chunk);
      end = from_front ? std::min(back, front + chunk) : back;
      const uint64_t next = from_front ? (static_cast<uint64_t>(end) << 32 | back)
                                       : (static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(begin));
      if (part[p].left.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return true;
    }
  };
  at::parallel_for(0, nparts, 1, [&](int64_t p0, int64_t p1) {
    const int64_t hold = parts::g_test_hold_us.load(std::memory_order_relaxed);
    if (hold > 0 && at::get_thread_num() == 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(hold);
      while (std::chrono::steady_clock::now() < until) {
      }
    }
    int64_t begin, end;
    for (int64_t p = p0; p < p1; ++p)
      while (take(p, true, begin, end)) fn(begin, end);
    for (int64_t i = 1; i < nparts; ++i) {
      const int64_t q = (p0 + i) % nparts;
      while (take(q, false, begin, end)) {
        parts::g_items_stolen.fetch_add(end - begin, std::memory_order_relaxed);
        fn(begin, end);
      }
    }
  });
}

// Splits an [M, N] output into (m-block, n-block) work items for at::parallel_for
// with the m-block index fastest, so one thread keeps one weight n-block hot in its
// cache while it walks the M rows. `fn(m0, m1, n0, n1)`.
template <typename F>
inline void parallel_tiles(int64_t M, int64_t N, int64_t mb, int64_t nb, const F& fn) {
  const int64_t m_blocks = ceil_div(M, mb), n_blocks = ceil_div(N, nb);
  at::parallel_for(0, m_blocks * n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mi = item % m_blocks, ni = item / m_blocks;
      fn(mi * mb, std::min(M, (mi + 1) * mb), ni * nb, std::min(N, (ni + 1) * nb));
    }
  });
}

}  // namespace compress_cpu
