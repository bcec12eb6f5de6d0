// SIMD math shared by streamkv's C++ CPU ops (paged_attention.cpp, fused_layers.cpp).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

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

#endif

#if defined(__AVX512F__)
#include <immintrin.h>

// exp on 16 lanes: 2^n * poly(r), x = n ln2 + r, |r| <= ln2 / 2; degree-7 Taylor (rel. error < 1e-7).
// Large x overflows to inf in scalef (so silu(-100) is -0, as in torch); x below -87 reads -87.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
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

#endif
