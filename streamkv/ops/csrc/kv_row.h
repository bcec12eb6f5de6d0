// One (token, KV head) row of the paged KV cache, read as fp32: shared by paged_attention.cpp and
// paged_prefill.cpp (one extension, two translation units).
//
//   fp32 / bf16:  the row is D values
//   int8 / fp8:   the row is D codes then a float32 scale (streamkv/attention/kv_layout.py), x = code * scale
#pragma once

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd_math.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace streamkv {

using fp8_t = c10::Float8_e4m3fn;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// All 256 e4m3 codes as floats (NaN codes stay NaN): a table lookup per element, a gather per 16.
inline const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(fp8_t(static_cast<uint8_t>(i), fp8_t::from_bits()));
    return t;
  }();
  return table;
}

inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(fp8_t x) { return fp8_table()[x.x]; }

template <typename kv_t>
constexpr bool is_quantized = std::is_same_v<kv_t, int8_t> || std::is_same_v<kv_t, fp8_t>;

// The dequantization scale of one row (1 for unquantized rows): the float32 after its head_dim codes.
template <typename kv_t>
inline float row_scale(const kv_t* row, int64_t head_dim) {
  if constexpr (is_quantized<kv_t>) {
    float s;
    std::memcpy(&s, reinterpret_cast<const char*>(row) + head_dim, sizeof(s));
    return s;
  } else {
    return 1.f;
  }
}

#if defined(__AVX512F__)
// 16 lanes of a K/V row as fp32 (codes, before the scale).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return bf16_widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const fp8_t* p) {
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_i32gather_ps(codes, fp8_table().data(), 4);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define STREAMKV_AVX2_KV 1
// 8 lanes of a K/V row as fp32 (the AVX2 kernels' loads; int8 / fp8: the codes, before the row's scale).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// e4m3fn without a table (a gather of 8 ran the decode at a sixth of int8's speed): with e the 4 exponent bits
// and m the 3 mantissa bits, a normal code (e > 0) is the fp32 of exponent e + 120 and mantissa m << 20, exactly;
// a subnormal one (e == 0) is m * 2^-9, exactly; S.1111.111 is NaN; the sign bit moves to bit 31.
inline __m256 load8(const fp8_t* p) {
  const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_and_si256(u, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.f / 512.f));
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em);  // e == 0
  const __m256i nan = _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F));
  __m256 x = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(small));
  x = _mm256_blendv_ps(x, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), _mm256_castsi256_ps(nan));
  return _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24)));
}

// The scales of 8 rows (1 for unquantized rows), lane k row k's.
template <typename kv_t>
inline __m256 row_scales8(const kv_t* const rows[8], int64_t head_dim) {
  alignas(32) float s[8];
  for (int k = 0; k < 8; ++k) s[k] = row_scale(rows[k], head_dim);
  return _mm256_load_ps(s);
}
#endif

// Calls body.template operator()<q_t, kv_t>() for the (query, KV cache) dtype pair, or raises.
// The pairs: fp32/fp32, bf16/bf16, fp32/bf16, and fp32 or bf16 queries on int8 / fp8 rows.
template <typename Body>
void dispatch_dtypes(at::ScalarType q_type, at::ScalarType kv_type, Body&& body) {
  if (q_type == at::kFloat && kv_type == at::kFloat) {
    body.template operator()<float, float>();
  } else if (q_type == at::kBFloat16 && kv_type == at::kBFloat16) {
    body.template operator()<at::BFloat16, at::BFloat16>();
  } else if (q_type == at::kFloat && kv_type == at::kBFloat16) {
    body.template operator()<float, at::BFloat16>();
  } else if (q_type == at::kFloat && kv_type == at::kChar) {
    body.template operator()<float, int8_t>();
  } else if (q_type == at::kBFloat16 && kv_type == at::kChar) {
    body.template operator()<at::BFloat16, int8_t>();
  } else if (q_type == at::kFloat && kv_type == at::kFloat8_e4m3fn) {
    body.template operator()<float, fp8_t>();
  } else if (q_type == at::kBFloat16 && kv_type == at::kFloat8_e4m3fn) {
    body.template operator()<at::BFloat16, fp8_t>();
  } else {
    TORCH_CHECK(false, "unsupported dtypes: query ", q_type, ", kv_cache ", kv_type);
  }
}

// The checks both ops make of out, query and the cache: [T, Hq, D] query rows with a unit last stride,
// a contiguous [2, num_blocks, block_size, Hkv, R] cache whose rows fit head_dim, whole query-head groups.
inline void check_query_and_cache(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [T, Hq, D] alike");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, Hkv, D]");
  const auto kv_type = kv_cache.scalar_type();
  const bool quantized = kv_type == at::kChar || kv_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(kv_cache.size(4) == query.size(2) + (quantized ? 4 : 0),
              "kv_cache rows must be head_dim wide (head_dim + 4, a float32 scale, for int8 / fp8)");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "query heads are not a multiple of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need a unit last stride");
  TORCH_CHECK(query.scalar_type() == out.scalar_type(), "query and out dtypes differ");
}

}  // namespace streamkv
