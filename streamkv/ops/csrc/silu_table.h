// torch's bf16 SiLU as a table, shared by fused_layers.cpp (silu_and_mul) and small_linear.cpp (the gate_up
// matmul with SiLU-and-mul in its epilogue), so both give silu_and_mul's bits.
#pragma once

#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"
#endif

#include <cstdint>
#include <cstring>
#include <vector>

namespace streamkv {

// torch's bf16 silu (at::silu, rounded to bf16) of every bf16 value, widened to fp32, indexed by the value's bits.
// A lookup (a gather per 16 lanes, 8 on AVX2) in place of an exp and a division per lane: bf16 silu_and_mul took
// 1.70 ms on a [4096, 3072] gate_up against 1.03 with the table on the AMX host (docs/benchmarks.md, "Round 29"),
// and its silu is torch's by construction, the sign of a zero included. Built on the first call, before any
// parallel region; never freed (256 KB).
inline const float* bf16_silu_table() {
  static const float* table = [] {
    std::vector<uint16_t> bits(65536);
    for (int i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
    const at::Tensor silu = at::silu(at::from_blob(bits.data(), {65536}, at::TensorOptions().dtype(at::kBFloat16)));
    auto* t = new float[65536];
    std::memcpy(t, silu.to(at::kFloat).contiguous().data_ptr<float>(), 65536 * sizeof(float));
    return t;
  }();
  return table;
}

#if defined(__AVX512F__)
// silu(gate) * up in fp32 for 16 bf16 gates and ups (their bits), the SiLU from bf16_silu_table(): the product
// both silu_and_mul_bf16 (fused_layers.cpp) and the fused gate_up's epilogue (small_linear.cpp) round to bf16, so
// their bits are the same by construction.
inline __m512 silu_mul16(__m256i gate, __m256i up, const float* table) {
  return _mm512_mul_ps(_mm512_i32gather_ps(_mm512_cvtepu16_epi32(gate), table, 4), bf16_widen16(up));
}
#endif

}  // namespace streamkv
