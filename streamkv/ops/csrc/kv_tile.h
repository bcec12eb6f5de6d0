// A paged prefill task's view of the tensors, and (AVX-512) one 64-key tile of a KV head read from the pool as
// fp32 or bf16-pair tiles: the loads paged_prefill.cpp's kernels share their query vectors over.
#pragma once

#include "kv_row.h"

#include <algorithm>
#include <cstdint>

namespace streamkv {

// What every kernel instance reads: the tensors' pointers and strides.
template <typename q_t, typename kv_t>
struct Layout {
  const q_t* q;
  q_t* o;
  const kv_t* kv;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* starts;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h, table_stride;
  int64_t head_dim, group, block_size, row, slot_stride, block_stride, v_offset;

  Layout(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
         const at::Tensor& lens, const at::Tensor& query_start_loc)
      : q(query.data_ptr<q_t>()), o(out.data_ptr<q_t>()), kv(kv_cache.data_ptr<kv_t>()),
        tables(block_tables.data_ptr<int32_t>()), seq_lens(lens.data_ptr<int32_t>()),
        starts(query_start_loc.data_ptr<int32_t>()), q_stride_t(query.stride(0)), q_stride_h(query.stride(1)),
        o_stride_t(out.stride(0)), o_stride_h(out.stride(1)), table_stride(block_tables.stride(0)),
        head_dim(query.size(2)), group(query.size(1) / kv_cache.size(3)), block_size(kv_cache.size(2)),
        row(kv_cache.size(4)), slot_stride(kv_cache.size(3) * kv_cache.size(4)),
        block_stride(kv_cache.size(2) * kv_cache.size(3) * kv_cache.size(4)), v_offset(kv_cache.stride(0)) {}

  // Key row of position p of sequence b, head h (add v_offset for the value row).
  const kv_t* key(int64_t b, int64_t h, int64_t p) const {
    const int32_t block = tables[b * table_stride + p / block_size];
    return kv + block * block_stride + (p % block_size) * slot_stride + h * row;
  }
  const q_t* query_row(int64_t t, int64_t head) const { return q + t * q_stride_t + head * q_stride_h; }
  q_t* out_row(int64_t t, int64_t head) const { return o + t * o_stride_t + head * o_stride_h; }
};


#if defined(__AVX512F__)
constexpr int64_t KEYS = 64;  // keys per tile: KC zmm of scores per query vector
constexpr int KC = KEYS / 16;

inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

// r[i] (16 lanes of row i) -> r[d] (lane i = row i's element d): 4 rounds of in-lane and cross-lane shuffles.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16];
  for (int i = 0; i < 4; ++i) {  // rows 4i .. 4i+3: u[4i + k] holds their columns k, k+4, k+8, k+12
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  __m512 v[16];
  for (int k = 0; k < 4; ++k) {  // 128-bit lanes: rows 0-7 (v[k], v[k+4]) and rows 8-15 (v[k+8], v[k+12])
    v[k] = _mm512_shuffle_f32x4(u[k], u[k + 4], 0x88);
    v[k + 4] = _mm512_shuffle_f32x4(u[k], u[k + 4], 0xdd);
    v[k + 8] = _mm512_shuffle_f32x4(u[k + 8], u[k + 12], 0x88);
    v[k + 12] = _mm512_shuffle_f32x4(u[k + 8], u[k + 12], 0xdd);
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(v[k], v[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(v[k], v[k + 8], 0xdd);
  }
}

// Keys k0 .. k0+n-1 (n <= KEYS) of sequence b, KV head h, as fp32: kt [D][KEYS] transposed (zeros past n),
// vb [KEYS][D] each row times its scale (rows past n left as they are: never read), kscale [KEYS].
template <int C, typename q_t, typename kv_t>
inline void load_tile(const Layout<q_t, kv_t>& L, int64_t b, int64_t h, int64_t k0, int64_t n,
                      float* __restrict kt, float* __restrict vb, float* __restrict kscale) {
  constexpr int64_t D = 16 * C;
  const kv_t* keys[KEYS];
  for (int64_t j = 0; j < n; ++j) {
    keys[j] = L.key(b, h, k0 + j);
    kscale[j] = row_scale(keys[j], D);
    const kv_t* v = keys[j] + L.v_offset;
    const __m512 vs = _mm512_set1_ps(row_scale(v, D));
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(vb + j * D + 16 * c, _mm512_mul_ps(load16(v + 16 * c), vs));
  }
  for (int64_t j = n; j < KEYS; ++j) kscale[j] = 1.f;
  for (int64_t j0 = 0; j0 < KEYS; j0 += 16) {
    for (int c = 0; c < C; ++c) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = j0 + i < n ? load16(keys[j0 + i] + 16 * c) : _mm512_setzero_ps();
      transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_ps(kt + (16 * c + d) * KEYS + j0, r[d]);
    }
  }
}

#if defined(__AVX512BF16__)
// The bf16 dot-product layout of the same tile (bf16 K and V, vdpbf16ps): one dword = two bf16.
//   kt [D/2][KEYS] dwords: (k_j[2e], k_j[2e+1]) for key j, dims 2e, 2e+1 (zeros past n)
//   vb [KEYS/2][D] dwords: (v_2i[d], v_2i+1[d]) for keys 2i, 2i+1, dim d (an odd n's last pair has a zero
//      partner; pairs past it are left as they are, for the caller to zero if it reads them)
template <int C>
inline void load_tile_bf16(const Layout<at::BFloat16, at::BFloat16>& L, int64_t b, int64_t h, int64_t k0, int64_t n,
                           float* __restrict kt, float* __restrict vb) {
  constexpr int64_t D = 16 * C;
  const at::BFloat16* keys[KEYS];
  for (int64_t j = 0; j < n; ++j) keys[j] = L.key(b, h, k0 + j);
  for (int64_t j = 0; j < n; j += 2) {
    const at::BFloat16* v0 = keys[j] + L.v_offset;
    const at::BFloat16* v1 = j + 1 < n ? keys[j + 1] + L.v_offset : nullptr;
    for (int c = 0; c < C; ++c) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)));
      const __m512i hi = v1 ? _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c))), 16)
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(vb + (j / 2) * D + 16 * c, _mm512_or_si512(lo, hi));
    }
  }
  for (int64_t j0 = 0; j0 < KEYS; j0 += 16) {
    for (int c = 0; c < C / 2; ++c) {  // 32 dims = 16 dwords per key
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < n ? _mm512_castsi512_ps(_mm512_loadu_si512(keys[j0 + i] + 32 * c)) : _mm512_setzero_ps();
      transpose16(r);
      for (int e = 0; e < 16; ++e) _mm512_storeu_ps(kt + (16 * c + e) * KEYS + j0, r[e]);
    }
  }
}
#endif

#endif

}  // namespace streamkv
