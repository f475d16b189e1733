// The AMX tile configurations of the AMX kernels here: palette 1, all eight tiles 16 rows x
// 64 bytes (w8a8_amx.inc, w4a16_amx.inc, compute_peak.cpp), or the caller's shapes
// (w4a8_lanes_amx.inc). Plain inline asm, so it needs no target region; the caller checks
// amx_int8_available() / amx_bf16_available() first. The tile state is per thread: load it on each thread
// before its first tile instruction and release it after its last.
#pragma once

#include <cstdint>
#include <cstring>

namespace compress_cpu {

struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Palette 1, tile t of rows[t] rows x colsb[t] bytes (0 x 0: unused).
inline void amx_load_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = rows[t], cfg.colsb[t] = colsb[t];
  // Not GCC 12's _tile_loadconfig: its asm operand names only the first 8 bytes of the
  // configuration, so the stores of rows and colsb were dropped as dead (then the first
  // tilezero raised SIGILL, the tiles being unconfigured). Here the whole struct is the
  // operand.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

inline void amx_load_config_16x64() {
  amx_load_config({16, 16, 16, 16, 16, 16, 16, 16}, {64, 64, 64, 64, 64, 64, 64, 64});
}

// After a thread's last tile instruction (asm: _tile_release is target-gated).
inline void amx_release() { __asm__ volatile("tilerelease" ::: "memory"); }

}  // namespace compress_cpu
