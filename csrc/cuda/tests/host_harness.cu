// Host-only test harness for the __host__ __device__ helpers of the CUDA
// kernels. Compiled by nvcc into a shared library (no GPU needed) and driven by
// tests/csrc/test_cuda_host.py through ctypes, which compares everything with
// compress/ops/reference.py.
//
// The emulators below follow the kernels' block / warp / lane structure with the
// kernels' own helpers (copy maps, swizzle, ldmatrix addressing, shuffled word
// offsets, dequantization, accumulator coordinates); ldmatrix and mma.sync are
// emulated from the PTX ISA fragment tables, written out here independently of
// the helpers in cpk_common.cuh.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "../cpk_common.cuh"
#include "../int4_layout.cuh"
#include "../op_checks.h"
#include "../paged_attention.cuh"
#include "../w4a16_tile.cuh"
#include "../w8a8_tile.cuh"
#include "paged_attention_emulated.h"  // the paged attention kernels, emulated

using namespace cpk;

namespace {

// ---- PTX ISA fragment tables (spelled as in the ISA text) -----------------
// m16n8k16 .f16/.bf16
void ptx_f16_a(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
  *col = tig * 2 + (i & 0x1) + (i >= 4 ? 8 : 0);
}
void ptx_f16_b(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = tig * 2 + (i & 0x1) + (i >= 2 ? 8 : 0);
  *col = group;
}
void ptx_c(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = i < 2 ? group : group + 8;
  *col = tig * 2 + (i & 0x1);
}
// m16n8k32 .s8
void ptx_s8_a(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = (i < 4 || (i >= 8 && i < 12)) ? group : group + 8;
  *col = tig * 4 + (i & 0x3) + (i >= 8 ? 16 : 0);
}
void ptx_s8_b(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = tig * 4 + (i & 0x3) + (i >= 4 ? 16 : 0);
  *col = group;
}

// ldmatrix.sync.aligned.m8n8.x4.b16: threads 8j..8j+7 give the row addresses of
// matrix j; lane receives, in register j, the 32 bits at row lane/4, bytes
// 4*(lane%4) of matrix j.
void emu_ldsm_x4(const uint8_t* const addr[32], uint32_t regs[32][4]) {
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < 4; ++j) std::memcpy(&regs[lane][j], addr[8 * j + lane / 4] + 4 * (lane % 4), 4);
}

template <bool kBf16>
float half_val(uint32_t reg, int slot) {
  const uint16_t h = static_cast<uint16_t>(slot ? reg >> 16 : reg & 0xffff);
  return kBf16 ? bf16_to_f32_host(h) : f16_to_f32_host(h);
}

// mma.sync m16n8k16 f32 += f16/bf16 * f16/bf16 on per-lane registers.
template <bool kBf16>
void emu_mma_16816(const uint32_t a[32][4], const uint32_t b[32][2], float c[32][4]) {
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      int r, cc;
      ptx_f16_a(lane, i, &r, &cc);
      A[r][cc] = half_val<kBf16>(a[lane][i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {
      int r, cc;
      ptx_f16_b(lane, i, &r, &cc);
      B[r][cc] = half_val<kBf16>(b[lane][i / 2], i % 2);
    }
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      int r, cc;
      ptx_c(lane, i, &r, &cc);
      float s = 0.f;
      for (int kk = 0; kk < 16; ++kk) s += A[r][kk] * B[kk][cc];
      c[lane][i] += s;
    }
}

// mma.sync m16n8k32 s32 += s8 * s8.
void emu_mma_16832_s8(const uint32_t a[32][4], const uint32_t b[32][2], int32_t c[32][4]) {
  int A[16][32], B[32][8];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 16; ++i) {
      int r, cc;
      ptx_s8_a(lane, i, &r, &cc);
      A[r][cc] = static_cast<int8_t>((a[lane][i / 4] >> (8 * (i % 4))) & 0xff);
    }
    for (int i = 0; i < 8; ++i) {
      int r, cc;
      ptx_s8_b(lane, i, &r, &cc);
      B[r][cc] = static_cast<int8_t>((b[lane][i / 4] >> (8 * (i % 4))) & 0xff);
    }
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      int r, cc;
      ptx_c(lane, i, &r, &cc);
      int s = 0;
      for (int kk = 0; kk < 32; ++kk) s += A[r][kk] * B[kk][cc];
      c[lane][i] += s;
    }
}

template <bool kBf16, int MT>
void emu_w4a16(const uint16_t* x, int m, int k, const int32_t* qshuf, const uint16_t* scales_t,
               const uint8_t* zeros_t, int n, int np, int kp, int group_size, int splits, float* y) {
  using Tile = W4Tile<MT>;
  const int kblocks = kp / kW4TileK;
  std::vector<uint8_t> sa(Tile::kAChunks * 16);
  std::vector<uint32_t> sb(Tile::kBChunks * 4);
  std::memset(y, 0, sizeof(float) * m * n);
  for (int bz = 0; bz < splits; ++bz)
    for (int bx = 0; bx < ceil_div(m, Tile::kBM); ++bx)
      for (int by = 0; by < np / kW4TileN; ++by) {
        const int m0 = bx * Tile::kBM, n0 = by * kW4TileN;
        int kt_begin, kt_end;
        split_range(kblocks, splits, bz, &kt_begin, &kt_end);
        static float acc[4][MT][4][32][4];
        std::memset(acc, 0, sizeof(acc));
        for (int kt = kt_begin; kt < kt_end; ++kt) {
          for (int tid = 0; tid < kW4Threads; ++tid) {  // cp.async stage fill
            for (int i = 0; i < MT; ++i) {
              const RowCol c = w4_a_copy(tid, i);
              const int gm = m0 + c.row, gk = kt * kW4TileK + c.col * 8;
              uint8_t* dst = sa.data() + 16 * swz128(c.row, c.col);
              if (gm < m && gk < k)
                std::memcpy(dst, x + static_cast<long long>(gm) * k + gk, 16);
              else
                std::memset(dst, 0, 16);
            }
            for (int i = 0; i < 2; ++i) {
              const RowCol c = w4_b_copy(tid, i);
              const long long word = ((static_cast<long long>(n0 / 16 + c.row) * kblocks + kt) * 32 + c.col) * 4;
              std::memcpy(sb.data() + (c.row * 32 + c.col) * 4, qshuf + word, 16);
            }
          }
          for (int warp = 0; warp < 4; ++warp)
            for (int ks = 0; ks < 4; ++ks) {
              const int group = (kt * kW4TileK + ks * 16) / group_size;
              uint32_t af[MT][32][4];
              for (int mt = 0; mt < MT; ++mt) {
                const uint8_t* addr[32];
                for (int lane = 0; lane < 32; ++lane)
                  addr[lane] = sa.data() + 16 * swz128(mt * 16 + ldsm_x4_row(lane), ks * 2 + ldsm_x4_chunk(lane));
                emu_ldsm_x4(addr, af[mt]);
              }
              for (int j = 0; j < 2; ++j) {
                uint32_t b0[32][2], b1[32][2];
                for (int lane = 0; lane < 32; ++lane) {
                  uint32_t sc[2], zc[2];
                  for (int h = 0; h < 2; ++h) {
                    const long long off = static_cast<long long>(group) * np + n0 + w4_scale_col(warp, j, h, lane);
                    sc[h] = static_cast<uint32_t>(scales_t[off]) * 0x10001u;
                    zc[h] = zeros_t[off];
                  }
                  uint32_t b[4];
                  w4_dequant<kBf16>(sb[w4_stage_word(warp, j, lane, ks)], sc[0], sc[1], zc[0], zc[1], b);
                  b0[lane][0] = b[0];
                  b0[lane][1] = b[1];
                  b1[lane][0] = b[2];
                  b1[lane][1] = b[3];
                }
                for (int mt = 0; mt < MT; ++mt) {
                  emu_mma_16816<kBf16>(af[mt], b0, acc[warp][mt][2 * j]);
                  emu_mma_16816<kBf16>(af[mt], b1, acc[warp][mt][2 * j + 1]);
                }
              }
            }
        }
        for (int warp = 0; warp < 4; ++warp)  // epilogue: split partials summed like the reduce kernel
          for (int mt = 0; mt < MT; ++mt)
            for (int j = 0; j < 4; ++j)
              for (int lane = 0; lane < 32; ++lane)
                for (int i = 0; i < 4; ++i) {
                  const RowCol c = w4_acc_coord(warp, mt, j, lane, i);
                  const int row = m0 + c.row, col = n0 + c.col;
                  if (row < m && col < n) y[static_cast<long long>(row) * n + col] += acc[warp][mt][j][lane][i];
                }
      }
}

template <int MT>
void emu_w8a8(const int8_t* xq, int m, int kq, const int8_t* wq, int n, int splits, int32_t* out) {
  using Tile = W8Tile<MT>;
  std::vector<uint8_t> sa(Tile::kAChunks * 16), sb(Tile::kBChunks * 16);
  std::memset(out, 0, sizeof(int32_t) * m * n);
  for (int bz = 0; bz < splits; ++bz)
    for (int bx = 0; bx < ceil_div(m, Tile::kBM); ++bx)
      for (int by = 0; by < ceil_div(n, kW8TileN); ++by) {
        const int m0 = bx * Tile::kBM, n0 = by * kW8TileN;
        int kt_begin, kt_end;
        split_range(ceil_div(kq, kW8TileK), splits, bz, &kt_begin, &kt_end);
        static int32_t acc[4][MT][4][32][4];
        std::memset(acc, 0, sizeof(acc));
        for (int kt = kt_begin; kt < kt_end; ++kt) {
          for (int tid = 0; tid < kW8Threads; ++tid) {
            for (int i = 0; i < MT; ++i) {
              const RowCol c = w8_copy(tid, i);
              const int gm = m0 + c.row, gk = kt * kW8TileK + c.col * 16;
              uint8_t* dst = sa.data() + 16 * swz128(c.row, c.col);
              if (gm < m && gk < kq)
                std::memcpy(dst, xq + static_cast<long long>(gm) * kq + gk, 16);
              else
                std::memset(dst, 0, 16);
            }
            for (int i = 0; i < 8; ++i) {
              const RowCol c = w8_copy(tid, i);
              const int gn = n0 + c.row, gk = kt * kW8TileK + c.col * 16;
              uint8_t* dst = sb.data() + 16 * swz128(c.row, c.col);
              if (gn < n && gk < kq)
                std::memcpy(dst, wq + static_cast<long long>(gn) * kq + gk, 16);
              else
                std::memset(dst, 0, 16);
            }
          }
          for (int warp = 0; warp < 4; ++warp)
            for (int ks = 0; ks < kW8TileK / 32; ++ks) {
              uint32_t af[MT][32][4], bf[2][32][4];
              const uint8_t* addr[32];
              for (int mt = 0; mt < MT; ++mt) {
                for (int lane = 0; lane < 32; ++lane) {
                  const RowCol c = w8_a_ldsm(lane, mt, ks);
                  addr[lane] = sa.data() + 16 * swz128(c.row, c.col);
                }
                emu_ldsm_x4(addr, af[mt]);
              }
              for (int j = 0; j < 2; ++j) {
                for (int lane = 0; lane < 32; ++lane) {
                  const RowCol c = w8_b_ldsm(lane, warp, j, ks);
                  addr[lane] = sb.data() + 16 * swz128(c.row, c.col);
                }
                emu_ldsm_x4(addr, bf[j]);
              }
              for (int mt = 0; mt < MT; ++mt)
                for (int j = 0; j < 2; ++j) {
                  uint32_t b0[32][2], b1[32][2];
                  for (int lane = 0; lane < 32; ++lane) {
                    b0[lane][0] = bf[j][lane][0];
                    b0[lane][1] = bf[j][lane][2];
                    b1[lane][0] = bf[j][lane][1];
                    b1[lane][1] = bf[j][lane][3];
                  }
                  emu_mma_16832_s8(af[mt], b0, acc[warp][mt][2 * j]);
                  emu_mma_16832_s8(af[mt], b1, acc[warp][mt][2 * j + 1]);
                }
            }
        }
        for (int warp = 0; warp < 4; ++warp)
          for (int mt = 0; mt < MT; ++mt)
            for (int j = 0; j < 4; ++j)
              for (int lane = 0; lane < 32; ++lane)
                for (int i = 0; i < 4; ++i) {
                  const RowCol c = w8_acc_coord(warp, mt, j, lane, i);
                  const int row = m0 + c.row, col = n0 + c.col;
                  if (row < m && col < n) out[static_cast<long long>(row) * n + col] += acc[warp][mt][j][lane][i];
                }
      }
}

}  // namespace

extern "C" {

// which: 0 f16 A, 1 f16 B, 2 s8 A, 3 s8 B, 4 C. Fills [32 * E] rows / cols from
// the kernels' helpers (out) and from the PTX tables (ptx). Returns E.
int cpk_frag_coords(int which, int* rows, int* cols, int* ptx_rows, int* ptx_cols) {
  const int elems[] = {8, 4, 16, 8, 4};
  const int e = elems[which];
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < e; ++i) {
      RowCol rc{};
      int* pr = ptx_rows + lane * e + i;
      int* pc = ptx_cols + lane * e + i;
      switch (which) {
        case 0: rc = mma_f16_a(lane, i); ptx_f16_a(lane, i, pr, pc); break;
        case 1: rc = mma_f16_b(lane, i); ptx_f16_b(lane, i, pr, pc); break;
        case 2: rc = mma_s8_a(lane, i); ptx_s8_a(lane, i, pr, pc); break;
        case 3: rc = mma_s8_b(lane, i); ptx_s8_b(lane, i, pr, pc); break;
        default: rc = mma_c(lane, i); ptx_c(lane, i, pr, pc); break;
      }
      rows[lane * e + i] = rc.row;
      cols[lane * e + i] = rc.col;
    }
  return e;
}

void cpk_swz128(int rows, int* out) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < 8; ++c) out[r * 8 + c] = swz128(r, c);
}

void cpk_ldsm_rows(int* rows, int* chunks) {
  for (int lane = 0; lane < 32; ++lane) {
    rows[lane] = ldsm_x4_row(lane);
    chunks[lane] = ldsm_x4_chunk(lane);
  }
}

void cpk_split_range(int tiles, int splits, int* begins, int* ends) {
  for (int p = 0; p < splits; ++p) split_range(tiles, splits, p, begins + p, ends + p);
}
int cpk_choose_splits(int blocks, int ktiles, int sms, int min_tiles) {
  return choose_splits(blocks, ktiles, sms, min_tiles);
}
int cpk_w4_splits(int m, int np, int kp, int sms) { return w4_splits(m, np, kp, sms); }
int cpk_w4_block_rows(int m) { return w4_block_rows(m); }
int cpk_w4_invariant_rows() { return kW4InvariantRows; }

void cpk_f32_to_half_bits(int bf16, const float* in, long long count, uint16_t* out) {
  for (long long i = 0; i < count; ++i) out[i] = bf16 ? f32_to_bf16_host(in[i]) : f32_to_f16_host(in[i]);
}
void cpk_half_bits_to_f32(int bf16, const uint16_t* in, long long count, float* out) {
  for (long long i = 0; i < count; ++i) out[i] = bf16 ? bf16_to_f32_host(in[i]) : f16_to_f32_host(in[i]);
}

void cpk_w4_shuffle(const int32_t* qweight, int n, int k, int32_t* out) {
  const int kp = w4_padded_k(k);
  const long long words = static_cast<long long>(w4_padded_n(n)) * kp / 8;
  for (long long w = 0; w < words; ++w) out[w] = static_cast<int32_t>(w4_shuffle_word(qweight, n, k, kp, w));
}

void cpk_w4_shuffled_coords(int np, int kp, int* n_out, int* k_out) {
  const long long words = static_cast<long long>(np) * kp / 8;
  for (long long w = 0; w < words; ++w)
    for (int p = 0; p < 8; ++p) {
      const RowCol c = w4_shuffled_coord(w, p, kp);
      n_out[w * 8 + p] = c.row;
      k_out[w * 8 + p] = c.col;
    }
}

void cpk_w4_dequant(int bf16, long long count, const uint32_t* words, const uint32_t* s0, const uint32_t* s1,
                    const uint32_t* z0, const uint32_t* z1, uint32_t* out) {
  for (long long i = 0; i < count; ++i) {
    if (bf16)
      w4_dequant<true>(words[i], s0[i], s1[i], z0[i], z1[i], out + 4 * i);
    else
      w4_dequant<false>(words[i], s0[i], s1[i], z0[i], z1[i], out + 4 * i);
  }
}

int cpk_w4a16_emulate(int bf16, const uint16_t* x, int m, int k, const int32_t* qshuf, const uint16_t* scales_t,
                      const uint8_t* zeros_t, int n, int np, int kp, int group_size, int mt, int splits, float* y) {
  if (group_size % 16 || np % kW4TileN || kp % kW4TileK) return 1;
#define CPK_EMU(B, M) emu_w4a16<B, M>(x, m, k, qshuf, scales_t, zeros_t, n, np, kp, group_size, splits, y)
  if (bf16) {
    if (mt == 1) CPK_EMU(true, 1); else if (mt == 2) CPK_EMU(true, 2); else CPK_EMU(true, 4);
  } else {
    if (mt == 1) CPK_EMU(false, 1); else if (mt == 2) CPK_EMU(false, 2); else CPK_EMU(false, 4);
  }
#undef CPK_EMU
  return 0;
}

int cpk_w8a8_emulate(const int8_t* xq, int m, int kq, const int8_t* wq, int n, int mt, int splits, int32_t* out) {
  if (kq % 16) return 1;
  if (mt == 1) emu_w8a8<1>(xq, m, kq, wq, n, splits, out);
  else if (mt == 2) emu_w8a8<2>(xq, m, kq, wq, n, splits, out);
  else emu_w8a8<4>(xq, m, kq, wq, n, splits, out);
  return 0;
}

// ---- LLM.int8() outlier columns and the quantize kernel's shared memory -------
int cpk_max_int8_dot_k() { return kMaxInt8DotK; }
int cpk_outlier_column(long long j, int k) { return outlier_column(j, k); }
int cpk_quantize_rows_smem_bytes(int k, int c) { return quantize_rows_smem_bytes(k, c); }
int cpk_smem_needs_optin(int dynamic_bytes, int static_bytes) { return smem_needs_optin(dynamic_bytes, static_bytes); }

// The quantize kernel's outlier pass (w8a8.cu, quantize_rows_kernel) for one block
// per row, run by its own helpers: marks the columns idx[0..c) in a bit mask of
// quantize_rows_smem_bytes(k, c) bytes, gathers them into xo [m, c] (0 for an
// index out of range), quantizes the rest into q [m, ldq]. x given as float values.
int cpk_quantize_rows_outliers(const float* x, int m, int k, int ldq, const long long* idx, int c, int8_t* q,
                               float* scale, float* xo) {
  std::vector<uint32_t> mask(static_cast<size_t>(quantize_rows_smem_bytes(k, c)) / 4 + 1, 0xdeadbeefu);
  for (int r = 0; r < m; ++r) {
    const float* xr = x + static_cast<long long>(r) * k;
    if (c > 0) {
      for (int i = 0; i < outlier_mask_words(k); ++i) mask[i] = 0;
      for (int i = 0; i < c; ++i) {
        const int j = outlier_column(idx[i], k);
        if (j >= 0) mask[j >> 5] |= 1u << (j & 31);
        xo[static_cast<long long>(r) * c + i] = j >= 0 ? xr[j] : 0.f;
      }
    }
    float amax = 0.f;
    for (int i = 0; i < k; ++i)
      if (c == 0 || !outlier_mask_test(mask.data(), i)) amax = amax > __builtin_fabsf(xr[i]) ? amax : __builtin_fabsf(xr[i]);
    const float s = int8_scale_from_amax(amax);
    for (int i = 0; i < ldq; ++i)
      q[static_cast<long long>(r) * ldq + i] =
          i < k && (c == 0 || !outlier_mask_test(mask.data(), i)) ? int8_quantize(xr[i], s) : 0;
    scale[r] = s;
  }
  return 0;
}

// ---- argument checks of the bindings (op_checks.h) ----------------------------
// Each tensor as 9 int64: device (0 cpu, 1 cuda, 2 other), index, kind (cpk::Kind),
// dim, size0, size1, numel, size2, size3. op: 0 w4a16_shuffle_for_cuda (qweight, scales,
// zeros; ints: group_size), 1 w4a16_gemm_shuffled (x, qweight_shuffled, scales_t, zeros_t;
// group_size, n), 2 w4a16_gemm (x, qweight, scales, zeros; group_size),
// 3 quantize_per_token_int8 (x), 4 w8a8_gemm (x, qweight, weight_scale),
// 5 w8a8_outlier_gemm (x, qweight, weight_scale, outlier_idx, outlier_weight),
// 6 paged_decode_attention (q, k_pool, v_pool, block_tables, context_lens; window).
// Writes the message (empty: valid) into msg; returns its length, -1 for a bad op.
int cpk_check_op(int op, const long long* t, const long long* ints, char* msg, int cap) {
  static const char* const names[7][5] = {
      {"qweight", "scales", "zeros"},
      {"x", "qweight_shuffled", "scales_t", "zeros_t"},
      {"x", "qweight", "scales", "zeros"},
      {"x"},
      {"x", "qweight", "weight_scale"},
      {"x", "qweight", "weight_scale", "outlier_idx", "outlier_weight"},
      {"q", "k_pool", "v_pool", "block_tables", "context_lens"}};
  if (op < 0 || op > 6) return -1;
  TensorDesc d[5]{};
  for (int i = 0; i < 5 && names[op][i] != nullptr; ++i) {
    const long long* v = t + 9 * i;
    d[i] = TensorDesc{names[op][i], static_cast<Dev>(v[0]), static_cast<int>(v[1]), static_cast<Kind>(v[2]),
                      static_cast<int>(v[3]), v[4], v[5], v[6], v[7], v[8]};
  }
  std::string e;
  switch (op) {
    case 0: e = check_w4a16_shuffle(d[0], d[1], d[2], ints[0]); break;
    case 1: e = check_w4a16_gemm_shuffled(d[0], d[1], d[2], d[3], ints[0], ints[1]); break;
    case 2: e = check_w4a16_gemm(d[0], d[1], d[2], d[3], ints[0]); break;
    case 3: e = check_quantize_rows(d[0]); break;
    case 4: e = check_w8a8(d[0], d[1], d[2], nullptr, nullptr); break;
    case 5: e = check_w8a8(d[0], d[1], d[2], &d[3], &d[4]); break;
    default: e = check_paged_decode_attention(d[0], d[1], d[2], d[3], d[4], ints[0]); break;
  }
  std::snprintf(msg, static_cast<size_t>(cap), "%s", e.c_str());
  return static_cast<int>(e.size());
}

// Row quantization with the kernel's scalar helpers; x given as float values.
void cpk_quantize_rows(const float* x, int m, int k, const uint8_t* mask, int8_t* q, float* scale) {
  for (int r = 0; r < m; ++r) {
    float amax = 0.f;
    for (int i = 0; i < k; ++i)
      if (!mask[i]) amax = amax > __builtin_fabsf(x[r * k + i]) ? amax : __builtin_fabsf(x[r * k + i]);
    const float s = int8_scale_from_amax(amax);
    for (int i = 0; i < k; ++i) q[r * k + i] = mask[i] ? 0 : int8_quantize(x[r * k + i], s);
    scale[r] = s;
  }
}

}  // extern "C"
