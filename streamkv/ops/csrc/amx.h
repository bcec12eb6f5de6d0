// Intel AMX (Advanced Matrix Extensions: 8 tile registers of up to 16 rows x 64 bytes, tdpbf16ps) for the
// kernels that use it: small_linear.cpp's bf16 and int8 matmuls and fp32 prefill matmuls on GGUF codes,
// paged_prefill.cpp's bf16 attention, and pass 1 (q . k) of paged_attention.cpp's bf16 decode.
//
// STREAMKV_AMX is defined on a -march=native build for a CPU with AMX-BF16 (Sapphire Rapids and later; AVX512DQ,
// which prefill_amx's exp2_16 needs, is checked too, though every such CPU has it). Even
// there a process may use the tiles only after asking Linux for their state (arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), which oneDNN also makes); amx_on() asks once and falls back when the OS refuses.
// One switch per extension (set_amx, or STREAMKV_AMX=0 in the environment at the first call), shared by
// every source compiled into it; streamkv.ops.cpu_ops.set_amx sets it in every loaded extension.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)
#define STREAMKV_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace streamkv {

// The 64-byte operand of ldtilecfg, palette 1: each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(STREAMKV_AMX)
// ldtilecfg of all 64 bytes of cfg. Not _tile_loadconfig: GCC 12 declares that intrinsic's operand as 8 bytes
// (`"m" (*(const void**)p)`), so the stores that fill the rest of a config may be deleted as dead. They were when
// the decode kernels' config took the query group as an argument (round 35): ldtilecfg read the stack's leftovers
// and faulted (SIGSEGV).
inline void load_tiles(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }
#endif

// Whether the OS gave this process the tile state (asked once; false on a build without AMX).
inline bool amx_permitted() {
#if defined(STREAMKV_AMX)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

inline std::atomic<int> amx_mode{-1};  // -1: not decided yet; 0: off; 1: on

// Whether this extension's AMX kernels run (bf16; int8 and fp32 from bf16 pieces in small_linear.cpp): built for
// them, permitted, not switched off.
inline bool amx_on() {
  int mode = amx_mode.load(std::memory_order_relaxed);
  if (mode < 0) {
    const char* env = std::getenv("STREAMKV_AMX");
    mode = amx_permitted() && !(env && std::strcmp(env, "0") == 0) ? 1 : 0;
    amx_mode.store(mode, std::memory_order_relaxed);
  }
  return mode == 1;
}

// Switch the AMX kernels on (only where they can run) or off; returns the state before.
inline bool set_amx(bool on) {
  const bool before = amx_on();
  amx_mode.store(on && amx_permitted() ? 1 : 0, std::memory_order_relaxed);
  return before;
}

}  // namespace streamkv
