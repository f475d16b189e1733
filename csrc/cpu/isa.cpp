// Run-time ISA selection for the CPU kernels (not an op: a process-wide setting that
// every kernel file reads through active_isa()).
#include "cpu/kernel_common.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace compress_cpu {
namespace {

bool os_saves_zmm() {
#if defined(__x86_64__)
  unsigned int eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  (void)edx;
  // XMM (bit 1), YMM (2), opmask (5), ZMM_Hi256 (6), Hi16_ZMM (7).
  return (eax & 0xE6u) == 0xE6u;
#else
  return false;
#endif
}

Isa detect() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && os_saves_zmm())
    return Isa::Avx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
#endif
  return Isa::Scalar;
}

int parse(const char* name) {
  if (name == nullptr || *name == 0 || std::strcmp(name, "auto") == 0) return -1;
  if (std::strcmp(name, "avx512_vnni") == 0) return static_cast<int>(Isa::Avx512Vnni);
  if (std::strcmp(name, "avx2") == 0) return static_cast<int>(Isa::Avx2);
  if (std::strcmp(name, "scalar") == 0) return static_cast<int>(Isa::Scalar);
  return -2;
}

std::atomic<int>& override_slot() {
  static std::atomic<int> slot{[] {
    const int v = parse(std::getenv("COMPRESS_CPU_ISA"));
    return v == -2 ? -1 : v;
  }()};
  return slot;
}

}  // namespace

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

Isa active_isa() {
  const int o = override_slot().load(std::memory_order_relaxed);
  const Isa d = detected_isa();
  return (o < 0 || o > static_cast<int>(d)) ? d : static_cast<Isa>(o);
}

bool set_isa_override(const char* name) {
  const int v = parse(name);
  if (v == -2) return false;
  override_slot().store(v);
  return true;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Vnni: return "avx512_vnni";
    case Isa::Avx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace compress_cpu
