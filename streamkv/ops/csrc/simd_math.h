// SIMD math shared by streamkv's C++ CPU ops (paged_attention.cpp, paged_prefill.cpp, fused_layers.cpp,
// small_linear.cpp).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

// exp on 8 lanes, exp16's arithmetic (same reduction, same polynomial, so the same bits): AVX2 has no scalef,
// so 2^n is applied as two exact power-of-two products (each exponent within a normal float's range); x above
// 100 reads 100, whose exp is already inf, as exp16's scalef overflows; x below -87 reads -87.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(100.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 poly = _mm256_set1_ps(1.f / 5040);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 720));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 120));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 24));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 6));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(0.5f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(poly, p1), p2);
}

// The sums of 8 vectors' lanes in one vector: lane k of the result is the sum of v[k]'s lanes.
inline __m256 reduce8(const __m256 v[8]) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);  // per 128-bit half: v0 v0 v1 v1
  for (int i = 0; i < 2; ++i) b[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);  // per half: v0 v1 v2 v3
  const __m256 lo = _mm256_permute2f128_ps(b[0], b[1], 0x20), hi = _mm256_permute2f128_ps(b[0], b[1], 0x31);
  return _mm256_add_ps(lo, hi);  // lanes 0-3: v0-v3 (b[0]'s halves summed), lanes 4-7: v4-v7
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// s[0, len) = exp(s - max s) in place (fp32, exp8); returns their sum and sets *max_out to max s. len >= 1.
inline float exp_scores8(float* s, int64_t len, float* max_out) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t p = 0;
  if (len >= 8) {
    __m256 m8 = _mm256_loadu_ps(s);
    for (p = 8; p + 8 <= len; p += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + p));
    mx = hmax8(m8);
  }
  for (; p < len; ++p) mx = std::max(mx, s[p]);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (p = 0; p + 8 <= len; p += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), m));
    _mm256_storeu_ps(s + p, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum8(sum8);
  if (p < len) {  // the tail through a padded buffer: exp8 of the live lanes only
    alignas(32) float t[8] = {};
    for (int64_t i = p; i < len; ++i) t[i - p] = s[i] - mx;
    alignas(32) float e[8];
    _mm256_store_ps(e, exp8(_mm256_load_ps(t)));
    for (int64_t i = p; i < len; ++i) sum += s[i] = e[i - p];
  }
  *max_out = mx;
  return sum;
}

// s[0, len) = exp(s - max s) in place (fp32, exp8); returns 1 / their sum. len >= 1.
inline float softmax8(float* s, int64_t len) {
  float mx;
  return 1.f / exp_scores8(s, len, &mx);
}

#endif

#if defined(__AVX512F__)
#include <immintrin.h>

constexpr float kLog2e = 1.44269504088896341f;  // log2(e)

// exp on 16 lanes: 2^n * poly(r), x = n ln2 + r, |r| <= ln2 / 2; degree-7 Taylor (rel. error < 1e-7).
// Large x overflows to inf in scalef (so silu(-100) is -0, as in torch); x below -87 reads -87.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 poly = _mm512_set1_ps(1.f / 5040);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 720));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 120));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 24));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 6));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(poly, n);
}

// silu(g) * u on 16 fp32 lanes, silu(g) = g / (1 + exp(-g)): silu_and_mul_f32's arithmetic (fused_layers.cpp) and the
// fp32 fused gate_up's epilogue (small_linear.cpp, run_silu_mul_f32), one function so both give the same bits.
inline __m512 silu_mul16_f32(__m512 g, __m512 u) {
  const __m512 silu =
      _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(silu, u);
}

// 2^y on 16 lanes: 2^floor(y) * poly(f), f = y - floor(y) in [0, 1) (vreduceps), poly a degree-5 fit of 2^f on that
// interval (relative error 8e-8 in exact arithmetic, 2e-7 as evaluated in fp32; exp16's is 1e-7). Seven
// instructions, the scaling by log2(e) folded into the caller's fmsub, where exp16 takes thirteen (its
// reduction of x by ln 2 in two steps and a degree-7 polynomial). y below -150 gives +0 (scalef), above 128 inf;
// y must not be NaN. (vreduceps is AVX512DQ, which every AVX-512 CPU but Xeon Phi has.)
#if defined(__AVX512DQ__)
inline __m512 exp2_16(__m512 y) {
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 poly = _mm512_set1_ps(1.87756939e-3f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(8.9893337e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.5826349e-2f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.40153594e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.93153079e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.99999925e-1f));
  return _mm512_scalef_ps(poly, y);
}
#endif

// 16 fp32 lanes -> 16 bf16, round-to-nearest-even, a NaN kept NaN as 0x7FC0: c10::BFloat16's rule, bit for bit.
// vcvtneps2bf16 (AVX512-BF16) gives the same bits for every input but subnormals, which it reads as zero, and
// NaNs, whose payload it keeps; a vector with such a lane takes the integer rule. The instruction made
// silu_and_mul's bf16 rows 1.25x faster when they rounded twice (~15 of a 16-lane step's ~45 instructions).
inline __m256i bf16_round16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) == 0, 1)) {  // QNaN, subnormal, SNaN
    return (__m256i)_mm512_cvtneps_pbh(v);
  }
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// 16 bf16 -> 16 fp32, exactly (each value's bits in the high half of its lane).
inline __m512 bf16_widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

#endif
