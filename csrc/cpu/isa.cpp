// Run-time ISA selection for the CPU kernels (not an op: a process-wide setting that
// every kernel file reads through active_isa()).
#include "cpu/kernel_common.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// CPUID.7.0:EDX bits of AMX-TILE (24) and of the wanted AMX kind; the tile state
// enabled in XCR0; and Linux's permission for this process to use the tile data
// (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; without it the first tile load faults).
bool detect_amx(unsigned int kind_bit) {
#if defined(__x86_64__) && defined(__linux__) && !defined(COMPRESS_ISA_EMULATION)  // SIMDe has no AMX
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << kind_bit))) return false;
  unsigned int xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  (void)xhi;
  if ((xlo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG, XTILEDATA
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  (void)kind_bit;
  return false;
#endif
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

bool amx_int8_available() {
  static const bool ok = detected_isa() == Isa::Avx512Vnni && detect_amx(25);
  return ok;
}

bool amx_bf16_available() {  // its users also convert with AVX512_BF16
  static const bool ok = detected_isa() == Isa::Avx512Vnni && __builtin_cpu_supports("avx512bf16") && detect_amx(22);
  return ok;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Vnni: return "avx512_vnni";
    case Isa::Avx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace compress_cpu
