// AMX tile set-up shared by the CPU kernels that multiply on tiles (the amx level's build, with
// -mamx-bf16; the other levels' builds see nothing of this header).
#pragma once

#if defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedllm {

// Linux hands out the AMX register state only on request, once per process.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows x 64 bytes: 16 x 32 bfloat16 operands, 16 x 16 float32 sums.
inline void configure_full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace pagedllm
#endif
