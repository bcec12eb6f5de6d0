// SIMD math shared by streamkv's C++ CPU ops (paged_attention.cpp, fused_layers.cpp).
#pragma once

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
