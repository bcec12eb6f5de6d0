// Fused element-wise ops of a Llama decoder layer on the CPU: residual add + RMSNorm,
// SiLU-and-mul, RoPE; and the greedy argmax of logit rows. Each reads its inputs once and writes its output once, where the
// torch composition makes 2-5 passes (x.float(), pow, mean, rsqrt, mul, to(bf16), mul, ...)
// over the same rows.
//
// Rounding follows the torch reference path in streamkv/model/llama.py step by step,
// so bf16 results round where torch's do:
//   rms_norm      fp32: x * rsqrt(mean(x^2) + eps) * w
//                 bf16: bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))      (transformers' order)
//   add_rms_norm  residual = dtype(residual + x) in place, then rms_norm(residual)
//   silu_and_mul  dtype(dtype(silu(gate)) * up), gate_up = [gate | up] per row
//                 (bf16: dtype(silu(gate)) is looked up, torch's own silu of each of the 65,536 bf16 values)
//   rope          dtype(dtype(x * cos) + swap(x) * sin)                  (torch.addcmul's order)
// Sums and products run in fp32 whatever the storage dtype.
//
// Rows are independent: at::parallel_for splits them over torch's threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "silu_table.h"
#include "simd_math.h"

// The AVX2 paths (8 lanes) run where AVX-512 is missing; the same operations in the same order per lane.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define STREAMKV_AVX2 1
#endif
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

// Round through the storage dtype (identity for fp32).
template <typename T>
inline float round_to(float x) { return to_f(from_f<T>(x)); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return bf16_widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_round16(v));
}
inline __m512 round16(__m512 v, float*) { return v; }
inline __m512 round16(__m512 v, at::BFloat16*) {
  return bf16_widen16(bf16_round16(v));
}

#endif

#if defined(STREAMKV_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// bf16_round16's integer rule (simd_math.h) on 8 lanes.
inline __m128i to_bf16_8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
  const __m256i hi16 = _mm256_srli_epi32(rounded, 16);  // 0..65535: packus keeps them
  return _mm_packus_epi32(_mm256_castsi256_si128(hi16), _mm256_extracti128_si256(hi16, 1));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_8(v)); }
inline __m256 round8(__m256 v, float*) { return v; }
inline __m256 round8(__m256 v, at::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_8(v)), 16));
}
#endif

// Rows per parallel_for task: about 16k elements.
inline int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with unit last stride");
}

// out = norm(src) for one row of n elements; src may alias nothing else written here.
template <typename T>
inline void norm_row(T* out, const T* src, const T* w, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = load16(src + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#elif defined(STREAMKV_AVX2)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {  // two accumulators: the 16-lane sum of the AVX-512 build, lane for lane
    const __m256 v0 = load8(src + i), v1 = load8(src + i + 8);
    acc0 = _mm256_fmadd_ps(v0, v0, acc0);
    acc1 = _mm256_fmadd_ps(v1, v1, acc1);
  }
  ss = hsum8(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) ss += to_f(src[i]) * to_f(src[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    __m512 y;
    if constexpr (std::is_same_v<T, float>) {
      y = _mm512_mul_ps(_mm512_mul_ps(load16(src + i), vinv), load16(w + i));
    } else {
      y = _mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(load16(src + i), vinv), out));
    }
    store16(out + i, y);
  }
#elif defined(STREAMKV_AVX2)
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    __m256 y;
    if constexpr (std::is_same_v<T, float>) {
      y = _mm256_mul_ps(_mm256_mul_ps(load8(src + i), vinv), load8(w + i));
    } else {
      y = _mm256_mul_ps(load8(w + i), round8(_mm256_mul_ps(load8(src + i), vinv), out));
    }
    store8(out + i, y);
  }
#endif
  for (; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = src[i] * inv * w[i];
    } else {
      out[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(src[i]) * inv));
    }
  }
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* o = out.data_ptr<T>();
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const int64_t so = out.stride(0), sx = x.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(o + r * so, src + r * sx, w, n, static_cast<float>(eps));
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& out, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                       double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* o = out.data_ptr<T>();
  const T* src = x.data_ptr<T>();
  T* res = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const int64_t so = out.stride(0), sx = x.stride(0), sr = residual.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* rr = res + r * sr;
      const T* xr = src + r * sx;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) store16(rr + i, _mm512_add_ps(load16(rr + i), load16(xr + i)));
#elif defined(STREAMKV_AVX2)
      for (; i + 8 <= n; i += 8) store8(rr + i, _mm256_add_ps(load8(rr + i), load8(xr + i)));
#endif
      for (; i < n; ++i) rr[i] = from_f<T>(to_f(rr[i]) + to_f(xr[i]));
      norm_row(o + r * so, rr, w, n, static_cast<float>(eps));
    }
  });
}

// bf16 rows: out = bf16(table[gate] * up), the table's entry being bf16(silu(gate)).
void silu_and_mul_bf16(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = out.size(0), n = out.size(1);
  const float* table = streamkv::bf16_silu_table();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const at::BFloat16* gu = gate_up.data_ptr<at::BFloat16>();
  const int64_t so = out.stride(0), sg = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* g = gu + r * sg;
      const at::BFloat16* u = g + n;
      at::BFloat16* dst = o + r * so;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const auto* gv = reinterpret_cast<const __m256i*>(g + i);
        const auto* uv = reinterpret_cast<const __m256i*>(u + i);
        store16(dst + i, streamkv::silu_mul16(_mm256_loadu_si256(gv), _mm256_loadu_si256(uv), table));
      }
#elif defined(STREAMKV_AVX2)
      for (; i + 8 <= n; i += 8) {
        const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)));
        store8(dst + i, _mm256_mul_ps(_mm256_i32gather_ps(table, bits, 4), load8(u + i)));
      }
#endif
      for (; i < n; ++i) dst[i] = from_f<at::BFloat16>(table[g[i].x] * to_f(u[i]));
    }
  });
}

// fp32 rows: silu(gate) = gate / (1 + exp(-gate)) lane by lane.
void silu_and_mul_f32(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = out.size(0), n = out.size(1);
  float* o = out.data_ptr<float>();
  const float* gu = gate_up.data_ptr<float>();
  const int64_t so = out.stride(0), sg = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gu + r * sg;
      const float* u = g + n;
      float* dst = o + r * so;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) store16(dst + i, silu_mul16_f32(load16(g + i), load16(u + i)));
#elif defined(STREAMKV_AVX2)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        store8(dst + i, _mm256_mul_ps(silu, load8(u + i)));
      }
#endif
      for (; i < n; ++i) dst[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

template <typename T>
void rope_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  T* o = out.data_ptr<T>();
  const T* src = x.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t sxt = x.stride(0), sxh = x.stride(1), sot = out.stride(0), soh = out.stride(1);
  const int64_t sct = cos.stride(0), sst = sin.stride(0);
  at::parallel_for(0, tokens, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = c + t * sct;
      const T* st = s + t * sst;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = src + t * sxt + h * sxh;
        T* dst = o + t * sot + h * soh;
#if defined(__AVX512F__)
        if (half % 16 == 0) {  // both halves in 16-lane chunks: dtype(x * cos), then one FMA, as torch.addcmul
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 lo = load16(xr + i), hi = load16(xr + half + i);
            store16(dst + i, _mm512_fmadd_ps(hi, load16(st + i), round16(_mm512_mul_ps(lo, load16(ct + i)), dst)));
            store16(dst + half + i,
                    _mm512_fmadd_ps(lo, load16(st + half + i), round16(_mm512_mul_ps(hi, load16(ct + half + i)), dst)));
          }
          continue;
        }
#elif defined(STREAMKV_AVX2)
        if (half % 8 == 0) {
          for (int64_t i = 0; i < half; i += 8) {
            const __m256 lo = load8(xr + i), hi = load8(xr + half + i);
            store8(dst + i, _mm256_fmadd_ps(hi, load8(st + i), round8(_mm256_mul_ps(lo, load8(ct + i)), dst)));
            store8(dst + half + i,
                   _mm256_fmadd_ps(lo, load8(st + half + i), round8(_mm256_mul_ps(hi, load8(ct + half + i)), dst)));
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < d; ++i) {
          const float swapped = to_f(xr[i < half ? i + half : i - half]);
          dst[i] = from_f<T>(round_to<T>(to_f(xr[i]) * to_f(ct[i])) + swapped * to_f(st[i]));
        }
      }
    }
  });
}

// Index of the first maximum of one row, torch.argmax's answer: a NaN counts as the maximum (the first NaN
// wins), ties go to the lowest index, a row of -inf gives 0.
// A bf16 row is compared as its exact fp32 widening, so its answer is that of the row's .float().
template <typename T>
inline int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    // Per lane: the first index holding that lane's maximum (strict > keeps the earliest).
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i idx = _mm512_setzero_si512();
    __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = load16(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
      m = _mm512_mask_mov_ps(m, gt, v);
      idx = _mm512_mask_mov_epi32(idx, gt, cur);
      cur = _mm512_add_epi32(cur, step);
    }
    if (nan) {
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(to_f(x[j]))) return j;
    }
    alignas(64) float mv[16];
    alignas(64) int32_t iv[16];
    _mm512_store_ps(mv, m);
    _mm512_store_si512(iv, idx);
    best = mv[0], best_i = iv[0];
    for (int k = 1; k < 16; ++k)
      if (mv[k] > best || (mv[k] == best && iv[k] < best_i)) best = mv[k], best_i = iv[k];
  }
#elif defined(STREAMKV_AVX2)
  if (n >= 8) {
    __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i idx = _mm256_setzero_si256();
    __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = load8(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, m, _CMP_GT_OQ);
      m = _mm256_blendv_ps(m, v, gt);
      idx = _mm256_blendv_epi8(idx, cur, _mm256_castps_si256(gt));
      cur = _mm256_add_epi32(cur, step);
    }
    if (_mm256_movemask_ps(nan)) {
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(to_f(x[j]))) return j;
    }
    alignas(32) float mv[8];
    alignas(32) int32_t iv[8];
    _mm256_store_ps(mv, m);
    _mm256_store_si256(reinterpret_cast<__m256i*>(iv), idx);
    best = mv[0], best_i = iv[0];
    for (int k = 1; k < 8; ++k)
      if (mv[k] > best || (mv[k] == best && iv[k] < best_i)) best = mv[k], best_i = iv[k];
  }
#endif
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    if (std::isnan(v)) {
      for (int64_t j = 0; j < i; ++j)
        if (std::isnan(to_f(x[j]))) return j;
      return i;
    }
    if (v > best) best = v, best_i = i;
  }
  return best_i;
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtypes differ");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16 only");
}

}  // namespace

// out [N, H] = rms_norm(x [N, H]) * weight [H]
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  check_same(out, x, "rms_norm");
  check_same(weight, x, "rms_norm");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: shapes");
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(out, x, weight, eps);
  else rms_norm_impl<at::BFloat16>(out, x, weight, eps);
}

// residual [N, H] += x [N, H] (in place, rounded to the dtype); out = rms_norm(residual) * weight
void add_rms_norm(at::Tensor out, const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_same(out, x, "add_rms_norm");
  check_same(residual, x, "add_rms_norm");
  check_same(weight, x, "add_rms_norm");
  TORCH_CHECK(out.sizes() == x.sizes() && residual.sizes() == x.sizes() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous(),
              "add_rms_norm: shapes");
  if (x.scalar_type() == at::kFloat) add_rms_norm_impl<float>(out, x, residual, weight, eps);
  else add_rms_norm_impl<at::BFloat16>(out, x, residual, weight, eps);
}

// out [N, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  check_same(out, gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1), "silu_and_mul: shapes");
  if (out.scalar_type() == at::kFloat) silu_and_mul_f32(out, gate_up);
  else silu_and_mul_bf16(out, gate_up);
}

// out [T, H, D] = x * cos + swap_halves(x) * sin, cos/sin [T, 1, D] (sin carries the sign)
void rope(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "rope: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && out.sizes() == x.sizes() && x.stride(2) == 1 && out.stride(2) == 1, "rope: shapes");
  TORCH_CHECK(cos.dim() == 3 && sin.dim() == 3 && cos.size(0) == x.size(0) && cos.size(2) == x.size(2) &&
                  sin.sizes() == cos.sizes() && cos.stride(2) == 1 && sin.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope: cos/sin must be [T, 1, D] with an even D");
  check_same(out, x, "rope");
  check_same(cos, x, "rope");
  check_same(sin, x, "rope");
  if (x.scalar_type() == at::kFloat) rope_impl<float>(out, x, cos, sin);
  else rope_impl<at::BFloat16>(out, x, cos, sin);
}

// out [N] (int64) = argmax of each row of logits [N, V] (float32 or bf16), as torch.argmax(logits, dim=-1)
// answers it. A bf16 model's logits are read as they come from the LM head: widening [64, 49,152] of them to
// float32 first (12.6 MB written, then read back) made the argmax 0.74-0.79 ms where the bf16 rows take
// 0.18-0.20 (docs/benchmarks.md, "Round 39").
void argmax_rows(at::Tensor out, const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && out.device().is_cpu(), "argmax_rows: CPU tensors only");
  TORCH_CHECK((logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "argmax_rows: logits must be float32 or bfloat16 [N, V] with a unit last stride");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "argmax_rows: V must be in [1, 2^31)");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == logits.size(0) && out.is_contiguous(),
              "argmax_rows: out must be a contiguous int64 [N]");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  const auto run = [&](const auto* x) {
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * stride, n);
    });
  };
  if (logits.scalar_type() == at::kFloat) run(logits.data_ptr<float>());
  else run(logits.data_ptr<at::BFloat16>());
}

#ifndef STREAMKV_NO_PYBIND  // left out of streamkv_decode_ops (decode_layer.cpp), which calls the ops directly
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of rows (CPU, fp32/bf16)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual (CPU, fp32/bf16)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] rows (CPU, fp32/bf16)");
  m.def("rope", &rope, "rotary embedding, half-split layout (CPU, fp32/bf16)");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, -1) of float32 or bf16 rows (CPU)");
}
#endif
