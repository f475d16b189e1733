// compress::paged_decode_attention on CPU: one query per row over a paged KV cache.
// Reference: compress/ops/reference.py::paged_decode_attention.
//
//   q [B, Hq, D]; k_pool, v_pool [NB, Hkv, BS, D]; block_tables int32 [B, M];
//   context_lens int32 [B]; window (0 = full attention)
//   row r attends to its positions first..n-1 (n = context_lens[r], first = n - window
//   when 0 < window < n, else 0); position p is slot p % BS of block block_tables[r][p / BS].
//   Out [B, Hq, D] in q's dtype; GQA (query head h reads kv head h / (Hq / Hkv)).
//
// Work items are (rows, kv head) pairs, one contiguous run of them per thread, taken one at
// a time from its front, and a thread done with its own run takes the rest of another's
// from its end (parallel_parts_stealing), so a batch whose rows have very different
// lengths still balances over the threads. A thread reads a row's kv heads in turn, the
// neighbouring parts of each block ([block, head, slot, d]); handed out from one counter,
// the threads took heads alternately, and a layer took 1 / 0.84 of this split's time (batch
// 16 x 250 keys, fp16, 2 threads; set_paged_parts_split switches back for A / B runs). "Rows" is
// one row, or consecutive rows that share their keys (one prompt chunk run as one-token
// rows: the same block table, context lengths n, n + 1, ...; full attention): their K and
// V rows are gathered (and widened) once, each row attends to its prefix. Within an item
// the q heads of the group run back to back, so the kv head's K and V rows come from
// DRAM once (the first pass streams them, the others find them in cache).
//
// A row's keys are "runs": the part of each of its blocks it reads, rows contiguous in
// the pool (stride = the pool's slot stride). The vector path (AVX2 + FMA, D % 8 == 0;
// paged_loop_attention.inc) reads float32 runs in place and widens float16 / bfloat16 ones
// once per item into a thread buffer (then every q head of the group reads fp32). While
// it reads run r it prefetches run r + 1 row by row: the blocks are scattered, so the next one is never
// the hardware prefetcher's guess. Scores, softmax and the output sums are fp32 for every
// dtype; the output is rounded to q's dtype once at the end. Other shapes and the scalar
// ISA take a plain loop with the same arithmetic order per key.
//
// A row that attends alone (a decode row) takes, on AVX-512 (D % 16 == 0), a kernel that
// reads its keys in the pool two a zmm with those loops' operations
// (paged_row_attention.inc: attend_row_avx512).
//
// Rows that share their keys (a prompt chunk) take, on AVX-512 (D % 16 == 0), that
// kernel's loops with up to four (row, q head) pairs a pass, so each K and V row read serves
// four of them (attend_rows_avx512), and each row gets the bits it would get alone.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/kv_int8.h"
#include "cpu/ops.h"

namespace compress_cpu {

// Whether rows sharing their keys (a prompt chunk) take the AVX-512 chunk kernel
// (attend_rows_avx512) where the CPU has it; off, the per-row loops over keys widened once
// (tests compare).
std::atomic<bool> paged_group_kernel{true};
bool set_paged_group_kernel(bool on) { return paged_group_kernel.exchange(on); }
// Whether a row that attends alone (a decode row) takes the AVX-512 row kernel
// (attend_row_avx512) where the CPU has it; off, the per-row loops (tests compare).
std::atomic<bool> paged_row_kernel{true};
bool set_paged_row_kernel(bool on) { return paged_row_kernel.exchange(on); }
// Whether the items run in one contiguous part per thread with take-over (on) or are handed
// out one at a time from a counter (off); the same bits either way (tests compare).
std::atomic<bool> paged_parts_split{true};
bool set_paged_parts_split(bool on) { return paged_parts_split.exchange(on); }

namespace {

bool group_attention_on() { return paged_group_kernel.load(std::memory_order_relaxed); }

// Sizes and strides of one call; the tables and lengths were validated by the caller.
struct Paged {
  int64_t B, Hq, Hkv, D, BS, group, window;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;  // pool strides: block, kv head, slot
  const int32_t* tables;
  int64_t M;  // table columns
  const int32_t* lens;
  float scale;

  // first position row b attends to, and how many
  void span(int64_t b, int64_t* first, int64_t* count) const {
    const int64_t n = lens[b];
    *first = window > 0 && n > window ? n - window : 0;
    *count = n - *first;
  }
};

Paged describe_call(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const int32_t* tables,
                    int64_t M, const int32_t* lens, int64_t window) {
  Paged a{};
  a.B = q.size(0), a.Hq = q.size(1), a.D = q.size(2), a.Hkv = k_pool.size(1), a.BS = k_pool.size(2);
  a.group = a.Hq / a.Hkv, a.window = window;
  a.ks0 = k_pool.stride(0), a.ks1 = k_pool.stride(1), a.ks2 = k_pool.stride(2);
  a.vs0 = v_pool.stride(0), a.vs1 = v_pool.stride(1), a.vs2 = v_pool.stride(2);
  a.tables = tables, a.M = M, a.lens = lens;
  a.scale = 1.f / std::sqrt(static_cast<float>(a.D));
  return a;
}

template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}

// ---- generic path: any D, any ISA ------------------------------------------------------
template <typename T, typename TKV>
void paged_generic(const Paged& a, const T* q, const TKV* k, const TKV* v, T* out) {
  const int64_t D = a.D;
  parallel_grabs(a.B * a.Hq, 1, [&](const auto& take) {
    std::vector<float> scores, qf(D), acc(D);
    int64_t begin, end;
    while (take(begin, end)) {
      const int64_t b = begin / a.Hq, h = begin % a.Hq, hk = h / a.group;
      int64_t first, S;
      a.span(b, &first, &S);
      scores.resize(S);
      const T* qrow = q + (b * a.Hq + h) * D;
      for (int64_t d = 0; d < D; ++d) qf[d] = to_f32(qrow[d]) * a.scale;
      const int32_t* table = a.tables + b * a.M;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        const int64_t p = first + s;
        const TKV* krow = k + table[p / a.BS] * a.ks0 + hk * a.ks1 + (p % a.BS) * a.ks2;
        const float ks = kv_row_scale(krow, D);
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[d] * kv_elem(krow, d, ks);
        scores[s] = dot;
        mx = std::max(mx, dot);
      }
      float denom = 0.f;
      for (int64_t s = 0; s < S; ++s) denom += (scores[s] = std::exp(scores[s] - mx));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t p = first + s;
        const TKV* vrow = v + table[p / a.BS] * a.vs0 + hk * a.vs1 + (p % a.BS) * a.vs2;
        const float vsc = kv_row_scale(vrow, D);
        for (int64_t d = 0; d < D; ++d) acc[d] += scores[s] * kv_elem(vrow, d, vsc);
      }
      T* orow = out + (b * a.Hq + h) * D;
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[d] * inv);
    }
  });
}

// ---- vector path: AVX2 + FMA, D % 8 == 0 -----------------------------------------------
#include "cpu/paged_loop_attention.inc"

// Rows that share their keys: consecutive rows with the same block table (over the blocks
// the last one uses) and context lengths n, n + 1, ...: the tokens of one prompt chunk or
// verify pass, run as one-token rows (ModelRunner.forward_tokens). Full attention only
// (with a window their first positions differ). Returns (first row, rows) per group.
std::vector<std::pair<int64_t, int64_t>> shared_key_groups(const Paged& a) {
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t b = 0; b < a.B;) {
    int64_t r = 1;
    while (b + r < a.B && a.lens[b + r] == a.lens[b + r - 1] + 1 &&
           (a.window == 0 || a.lens[b + r] <= a.window) &&
           std::equal(a.tables + b * a.M, a.tables + b * a.M + (a.lens[b + r] + a.BS - 1) / a.BS,
                      a.tables + (b + r) * a.M))
      ++r;
    groups.emplace_back(b, r);
    b += r;
  }
  return groups;
}

#include "cpu/paged_row_attention.inc"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <typename T, typename TKV>
void paged_avx2(const Paged& a, const T* q, const TKV* k, const TKV* v, T* out) {
  const int64_t D = a.D, group = a.group;
  constexpr bool kInPlace = std::is_same_v<TKV, float>;  // else widened copies, already in cache
  // Work items: (group of rows sharing their keys, kv head). A group takes the AVX-512
  // row kernels where it can; otherwise its K and V rows are read (and widened) once for
  // the longest row and each row attends to its prefix.
  const std::vector<std::pair<int64_t, int64_t>> groups = shared_key_groups(a);
  const bool group_kernel = group_attention_on();
  const bool row_kernel = active_isa() == Isa::Avx512Vnni && D % 16 == 0 && D <= kRowKernelMaxD &&
                          paged_row_kernel.load(std::memory_order_relaxed);
  const auto items = [&](int64_t begin0, int64_t end0) {
    // reused by this thread from call to call (a decode step makes one call a layer)
    thread_local std::vector<float> qf, scores, kbuf, vbuf, obuf;
    thread_local std::vector<Run> kruns, vruns, krow, vrow;
    thread_local RowBuffers rowbuf;
    if (qf.size() < static_cast<size_t>(group * D)) qf.resize(group * D), obuf.resize(group * D);
    for (int64_t begin = begin0; begin < end0; ++begin) {
      const int64_t b0 = groups[begin / a.Hkv].first, nrows = groups[begin / a.Hkv].second, hk = begin % a.Hkv;
      int64_t first, Smax;
      a.span(b0 + nrows - 1, &first, &Smax);   // the group's union: the last row's span
      // a decode row, or a chunk's rows (each with the bits it would get alone)
      if (row_kernel && (nrows == 1 || group_kernel)) {
        if (nrows == 1) attend_row_avx512(a, q, k, v, out, b0, hk, rowbuf);
        else attend_rows_avx512(a, q, k, v, out, b0, nrows, hk, rowbuf);
        continue;
      }
      const int64_t ks = item_runs(a, k, a.ks0, a.ks1, a.ks2, b0 + nrows - 1, hk, first, Smax, kruns, kbuf);
      bool v_ready = false;
      int64_t vs = 0;
      for (int64_t row = 0; row < nrows; ++row) {
        const int64_t b = b0 + row;
        int64_t first_b, S;
        a.span(b, &first_b, &S);   // first_b == first: groups of more than one row have no window
        if (scores.size() < static_cast<size_t>(group * S)) scores.resize(group * S);
        for (int64_t g = 0; g < group; ++g) {
          const T* qrow = q + (b * a.Hq + hk * group + g) * D;
          for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f32(qrow[d]) * a.scale;
        }
        const std::vector<Run>* kr = &kruns;
        if (S < Smax) prefix_runs(kruns, S, krow), kr = &krow;
        float* sc = scores.data();
        const int64_t nk = static_cast<int64_t>(kr->size());
        for (int64_t g = 0; g < group; g += 2) {  // heads in pairs: each pass reads K once for two
          const bool two = g + 1 < group, stream = kInPlace && g == 0 && row == 0;
          if (stream) {
            const int64_t n0 = std::min<int64_t>((*kr)[0].rows, 8);
            for (int64_t i = 0; i < n0; ++i) prefetch_row((*kr)[0].p + i * ks, D);
          }
          int64_t s0 = 0;
          for (int64_t r = 0; r < nk; ++r) {
            NextRun next;
            if (stream && r + 1 < nk) next = NextRun{(*kr)[r + 1].p, (*kr)[r + 1].rows, ks, D};
            const NextRun* np = stream && r + 1 < nk ? &next : nullptr;
            float* sa = sc + g * S + s0;
            if (two) qk_run<true>(&qf[g * D], &qf[(g + 1) * D], (*kr)[r], ks, D, np, sa, sa + S);
            else qk_run<false>(&qf[g * D], nullptr, (*kr)[r], ks, D, np, sa, nullptr);
            s0 += (*kr)[r].rows;
          }
        }
        for (int64_t g = 0; g < group; ++g) softmax_row(sc + g * S, S);
        if (!v_ready) vs = item_runs(a, v, a.vs0, a.vs1, a.vs2, b0 + nrows - 1, hk, first, Smax, vruns, vbuf), v_ready = true;
        const std::vector<Run>* vr = &vruns;
        if (S < Smax) prefix_runs(vruns, S, vrow), vr = &vrow;
        const int64_t nv = static_cast<int64_t>(vr->size());
        T* orow = out + (b * a.Hq + hk * group) * D;
        float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(orow) : obuf.data();
        for (int64_t g = 0; g < group; g += 2) {
          const float* p = sc + g * S;
          const bool stream = kInPlace && g == 0 && row == 0;
          if (g + 1 < group) pv_runs<true>(p, p + S, vr->data(), nv, vs, D, stream, dst + g * D, dst + (g + 1) * D);
          else pv_runs<false>(p, nullptr, vr->data(), nv, vs, D, stream, dst + g * D, nullptr);
        }
        if constexpr (!std::is_same_v<T, float>)
          for (int64_t i = 0; i < group * D; ++i) orow[i] = static_cast<T>(obuf[i]);
      }
    }
  };
  const int64_t n_items = static_cast<int64_t>(groups.size()) * a.Hkv;
  if (paged_parts_split.load(std::memory_order_relaxed)) {
    parallel_parts_stealing(n_items, 1, 1, items);
  } else {
    parallel_grabs(n_items, 1, [&](const auto& take) {
      int64_t begin, end;
      while (take(begin, end)) items(begin, end);
    });
  }
}
#pragma GCC pop_options


template <typename T, typename TKV>
void paged_dispatch_kv(const Paged& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const TKV *kp = k.data_ptr<TKV>(), *vp = v.data_ptr<TKV>();
  if (a.D % 8 == 0 && active_isa() != Isa::Scalar) paged_avx2<T, TKV>(a, qp, kp, vp, op);
  else paged_generic<T, TKV>(a, qp, kp, vp, op);
}

template <typename T>
void paged_dispatch(const Paged& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out) {
  switch (k.scalar_type()) {
    case at::kFloat: paged_dispatch_kv<T, float>(a, q, k, v, out); break;
    case at::kBFloat16: paged_dispatch_kv<T, c10::BFloat16>(a, q, k, v, out); break;
    case at::kChar: paged_dispatch_kv<T, int8_t>(a, q, k, v, out); break;
    default: paged_dispatch_kv<T, c10::Half>(a, q, k, v, out); break;
  }
}

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }
bool is_kv_type(at::ScalarType t) { return is_float_type(t) || t == at::kChar; }

}  // namespace

static int64_t pool_row_elems(const at::Tensor& pool, int64_t head_dim) {
  return pool.scalar_type() == at::kChar ? head_dim + kKvInt8ScaleBytes : head_dim;
}

void check_paged_pools(const char* op, const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t n_kv_heads,
                       int64_t head_dim) {
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() && is_kv_type(k_pool.scalar_type()), op,
              ": k_pool and v_pool must have one dtype, float32, bfloat16, float16 or int8; got ",
              k_pool.scalar_type(), " and ", v_pool.scalar_type());
  const int64_t row = pool_row_elems(k_pool, head_dim);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.size(1) == n_kv_heads &&
                  k_pool.size(3) == row && k_pool.size(2) > 0,
              op, ": k_pool and v_pool must both be [num_blocks, n_kv_heads, block_size, ",
              row == head_dim ? "head_dim" : "head_dim + 4 (int8: the row's scale)", "] = [NB, ", n_kv_heads, ", BS, ",
              row, "], got k_pool ", k_pool.sizes(), ", v_pool ", v_pool.sizes());
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1 && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              op, ": k_pool and v_pool must be CPU tensors with a contiguous last dim");
}

void check_paged_tables(const char* op, const int32_t* tables, int64_t B, int64_t M, const int32_t* lens,
                        int64_t block_size, int64_t num_blocks, int64_t window) {
  TORCH_CHECK(window >= 0, op, ": window must be >= 0 (0 = full attention), got ", window);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b];
    TORCH_CHECK(n >= 1 && n <= M * block_size, op, ": context_lens[", b, "] = ", n, " is outside 1..", M * block_size,
                " (M = ", M, " table columns x block_size ", block_size, ")");
    const int64_t first = window > 0 && n > window ? n - window : 0;
    for (int64_t j = first / block_size; j <= (n - 1) / block_size; ++j) {
      const int64_t blk = tables[b * M + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, op, ": block table entry [", b, ", ", j, "] = ", blk,
                  " is in use but outside the pool's blocks 0..", num_blocks - 1);
    }
  }
}

void paged_decode_attention_into(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                 const int32_t* tables, int64_t M, const int32_t* lens, int64_t window,
                                 at::Tensor& out) {
  const Paged a = describe_call(q, k_pool, v_pool, tables, M, lens, window);
  if (a.B == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention",
                                  [&] { paged_dispatch<scalar_t>(a, q, k_pool, v_pool, out); });
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t window) {
  constexpr const char* op = "paged_decode_attention";
  TORCH_CHECK(q_in.dim() == 3 && is_float_type(q_in.scalar_type()), op,
              ": q must be [B, Hq, head_dim] float32, bfloat16 or float16, got ", q_in.sizes(), " ",
              q_in.scalar_type());
  const int64_t B = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(1) > 0 && Hq % k_pool.size(1) == 0 &&
                  k_pool.size(3) == pool_row_elems(k_pool, D), op,
              ": q ", q_in.sizes(), " does not fit k_pool ", k_pool.sizes(), " (head_dim, or Hq % Hkv)");
  check_paged_pools(op, k_pool, v_pool, k_pool.size(1), D);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kInt, op,
              ": block_tables must be int32 [B, M] with B = ", B, ", got ", block_tables.scalar_type(), " ",
              block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B && context_lens.scalar_type() == at::kInt, op,
              ": context_lens must be int32 [B] with B = ", B, ", got ", context_lens.scalar_type(), " ",
              context_lens.sizes());
  const at::Tensor q = q_in.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t M = tables.size(1);
  check_paged_tables(op, tables.data_ptr<int32_t>(), B, M, lens.data_ptr<int32_t>(), k_pool.size(2), k_pool.size(0),
                     window);
  at::Tensor out = at::empty_like(q);
  paged_decode_attention_into(q, k_pool, v_pool, tables.data_ptr<int32_t>(), M, lens.data_ptr<int32_t>(), window,
                              out);
  return out;
}

}  // namespace compress_cpu

TORCH_LIBRARY_IMPL(compress, CPU, m) { m.impl("paged_decode_attention", &compress_cpu::paged_decode_attention); }
