// Stands in for <immintrin.h> in the ISA emulation harness only (isa_emulation.cpp puts
// this directory first on the include path). The x86 intrinsics, AVX-512 VNNI among
// them, come from SIMDe (https://github.com/simd-everywhere/simde, the simde-py
// package) under their Intel names, as portable C that runs on any x86-64. The compiled
// extension never sees this file.
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx2.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#include <simde/x86/avx512/dpbusd.h>
#include <simde/x86/avx512/loadu.h>
#include <simde/x86/avx512/mov_mask.h>
#include <simde/x86/avx512/setzero.h>
#include <simde/x86/avx512/storeu.h>
#include <simde/x86/avx512/sub.h>

#include <cmath>
#include <cstdint>

// Names SIMDe 0.8.2 defines only with its SIMDE_ prefix.
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

// SIMDe 0.8.2 lacks _mm512_reduce_add_epi32: the sum of the 16 int32 lanes (wrapping,
// as the instruction sequence the compiler emits for it wraps). Under its own name, so it
// does not clash with the compiler's declaration where <x86intrin.h> came first
// (csrc/cpu/tests/check_vnni_emulated.sh).
#define _mm512_reduce_add_epi32 compress_emu_reduce_add_epi32
static inline int32_t compress_emu_reduce_add_epi32(simde__m512i v) {
  int32_t lanes[16];
  simde_mm512_storeu_si512(lanes, v);
  uint32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += static_cast<uint32_t>(lanes[i]);
  return static_cast<int32_t>(sum);
}

// SIMDe's portable _mm256_fmadd_ps rounds twice (a * b, then + c) unless the compiler
// targets hardware FMA; the instruction rounds once. These round once (std::fma), so
// the emulated tiles compute what an FMA-capable CPU computes.
static inline simde__m256 compress_emu_fma256(simde__m256 a, simde__m256 b, simde__m256 c, float sign) {
  float va[8], vb[8], vc[8];
  simde_mm256_storeu_ps(va, a);
  simde_mm256_storeu_ps(vb, b);
  simde_mm256_storeu_ps(vc, c);
  for (int i = 0; i < 8; ++i) va[i] = std::fma(sign * va[i], vb[i], vc[i]);
  return simde_mm256_loadu_ps(va);
}
#undef _mm256_fmadd_ps
#undef _mm256_fnmadd_ps
#define _mm256_fmadd_ps(a, b, c) compress_emu_fma256((a), (b), (c), 1.f)
#define _mm256_fnmadd_ps(a, b, c) compress_emu_fma256((a), (b), (c), -1.f)
