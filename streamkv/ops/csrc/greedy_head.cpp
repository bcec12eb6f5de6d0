// Greedy tokens of a float32 model's LM head from a bf16 estimate of its logits, exactly: the argmax of the fp32
// logits small_linear would compute, without computing most of them.
//
// A greedy decode step needs only argmax_v y[v] of each row's logits y = x W^T (x: the final hidden row, fp32 [K];
// W: the LM head, fp32 [V, K]). The bf16 kernel (vdpbf16ps, or AMX tiles) computes an estimate a[v] at twice the fp32
// FMA rate, from x and W each rounded to bf16 (u = 2^-8), fp32 sums and one rounding of the sum to bf16; its
// distance from f[v], the fp32 kernel's logit (an FMA chain, k ascending), is at most
//
//   |a - f| <= (2u + u^2 + (1 + u)^2 g + g) sum_k |x_k W_vk| + u / (1 - u) |a| + c3
//   with g = gamma_{K+1} = (K+1) 2^-24 / (1 - (K+1) 2^-24)
//           <= c1 ||x||_2 ||W_v||_2 + c2 |a| + c3                                         (Cauchy-Schwarz)
//
// (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Lemma 3.1 and eq. 3.5: any order of fp32
// additions of K products; the same gamma bounds the fp32 kernel's own chain; vdpbf16ps and tdpbf16ps flush
// subnormal inputs and outputs, which c3 = 2^-100 covers while |x| and |W| stay below 2^16: GreedyHead.build checks
// W, this op x.) With b[v] that bound, the row's fp32 argmax v* has a[v*] + b[v*] >= f[v*] >= max_v f[v] >=
// max_v (a[v] - b[v]), so every v with a[v] + b[v] >= max_v (a[v] - b[v]) is a candidate, and f is computed exactly
// (the fp32 kernel's chain: acc = fma(x_k, w_k, acc) from zero, k ascending, then + 0) for those alone. Ties keep
// the first index, as torch.argmax. On SmolLM2-135M's 49,152-token head (||x|| 37-63, ||W_v|| 1.8-7.5), 1,152
// decode rows had a median of 1 candidate, a mean of 6.1, a 99th percentile of 94 and at most 189
// (docs/benchmarks.md, "Round 46").
//
// The fp32 weights are read in small_linear's layouts: GGUF Q8_0 codes [N/32, K/32, 1088] (w = d * q, exact) or
// packed fp32 [N/32, K, 32]. A row whose x or estimate is not finite (or whose |x| reaches 2^16), or whose exact
// candidate logit is NaN, gets token -1: the caller runs the full fp32 head for it.

#include <torch/extension.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"
#endif

namespace {

constexpr int64_t PAIR = 32;              // columns of a packed pair (small_linear's 2 x LANES)
constexpr int64_t Q8_0_K = 32;            // k steps per Q8_0 block
constexpr int64_t Q8_0_BYTES = 1088;      // a pair's Q8_0 block: 32 steps x 32 int8 codes, then 32 fp16 d

// The fp32 kernel's logit of column v: the FMA chain over k ascending, from packed fp32 [N/32, K, 32].
float exact_dense(const float* x, const float* packed, int64_t k, int64_t v) {
  const float* w = packed + (v / PAIR) * k * PAIR + v % PAIR;
  float acc = 0.f;
  for (int64_t i = 0; i < k; ++i) acc = std::fma(x[i], w[i * PAIR], acc);
  return acc + 0.f;
}

// The same from Q8_0 codes: w = d * q is exact in fp32 (11 significant bits times 8).
float exact_q8_0(const float* x, const uint8_t* packed, int64_t k, int64_t v) {
  const int64_t blocks = k / Q8_0_K, col = v % PAIR;
  const uint8_t* blk = packed + (v / PAIR) * blocks * Q8_0_BYTES;
  float acc = 0.f;
  for (int64_t b = 0; b < blocks; ++b, blk += Q8_0_BYTES) {
    at::Half d;
    std::memcpy(&d, blk + 1024 + 2 * col, 2);
    const float df = static_cast<float>(d);
    for (int64_t e = 0; e < Q8_0_K; ++e)
      acc = std::fma(x[b * Q8_0_K + e], df * static_cast<float>(static_cast<int8_t>(blk[e * PAIR + col])), acc);
  }
  return acc + 0.f;
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The bound b = c1x ||W_v|| + c2 |a| + c3 of one estimate a (the file's header; c1x = c1 ||x||): both passes and
// the vector lanes (bound16) compute it with the same operations, so pass 2 rules out exactly what pass 1 measured.
inline float bound1(float a, float w_norm, float c1x, float c2, float c3) {
  return std::fma(c1x, w_norm, c2 * std::fabs(a)) + c3;
}

#if defined(__AVX512F__)
// The estimates a[0, 16) widened from their bf16 bits, and their bounds, bound1's arithmetic lane by lane.
struct Bound16 {
  __m512 c1x, c2, c3;
  inline __m512 estimates(const uint16_t* a) const {
    return bf16_widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  }
  inline __m512 bound(__m512 a, const float* w_norm) const {
    return _mm512_add_ps(_mm512_fmadd_ps(c1x, _mm512_loadu_ps(w_norm), _mm512_mul_ps(c2, _mm512_abs_ps(a))), c3);
  }
};
#endif

}  // namespace

int64_t greedy_head(at::Tensor tokens, const at::Tensor& x, const at::Tensor& approx, const at::Tensor& packed,
                    const at::Tensor& row_norms) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "greedy_head: x must be a contiguous CPU float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(approx.scalar_type() == at::kBFloat16 && approx.dim() == 2 && approx.size(0) == m &&
                  approx.stride(1) == 1,
              "greedy_head: approx must be bfloat16 [M, V] with a unit last stride");
  const int64_t n = approx.size(1);
  TORCH_CHECK(row_norms.scalar_type() == at::kFloat && row_norms.dim() == 1 && row_norms.size(0) == n &&
                  row_norms.is_contiguous(),
              "greedy_head: row_norms must be a contiguous float32 [V]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.size(0) == m && tokens.is_contiguous(),
              "greedy_head: tokens must be a contiguous int64 [M]");
  const int64_t pairs = (n + PAIR - 1) / PAIR;
  const bool q8 = packed.scalar_type() == at::kByte;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == pairs &&
                  (q8 ? k % Q8_0_K == 0 && packed.size(1) == k / Q8_0_K && packed.size(2) == Q8_0_BYTES
                      : packed.scalar_type() == at::kFloat && packed.size(1) == k && packed.size(2) == PAIR),
              "greedy_head: packed must be small_linear's Q8_0 [N/32, K/32, 1088] or fp32 [N/32, K, 32] layout");
  // The bound's constants (the file's header), rounded up: 2^-16 more covers the fp32 rounding of b and a +- b.
  const double u = std::ldexp(1.0, -8), unit = std::ldexp(1.0, -24);
  const double g = (k + 1) * unit / (1 - (k + 1) * unit);
  const double c1 = (2 * u + u * u + (1 + u) * (1 + u) * g + g) * (1 + std::ldexp(1.0, -16));
  const float c2 = static_cast<float>(u / (1 - u) + std::ldexp(1.0, -16)), c3 = std::ldexp(1.f, -100);
  const float* xp = x.data_ptr<float>();
  const auto* ap = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* wn = row_norms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  std::atomic<int64_t> examined{0};
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * k;
      const uint16_t* a = ap + r * approx.stride(0);
      double ss = 0;
      float big_x = 0;
      for (int64_t i = 0; i < k; ++i) {
        ss += static_cast<double>(xr[i]) * xr[i];
        big_x = std::max(big_x, std::fabs(xr[i]));
      }
      const double norm = std::sqrt(ss) * (1 + std::ldexp(1.0, -40));
      out[r] = -1;
      if (!std::isfinite(norm) || !(big_x < 65536.f)) continue;  // c3 covers |x| below 2^16 (NaN fails too)
      const float c1x = static_cast<float>(c1 * norm * (1 + std::ldexp(1.0, -20)));
      // Pass 1: max over v of a[v] - b[v], and whether every estimate is finite.
      float lower = -std::numeric_limits<float>::infinity();
      bool finite = true;
      int64_t v = 0;
#if defined(__AVX512F__)
      __m512 lo = _mm512_set1_ps(lower), big = _mm512_setzero_ps();
      const Bound16 b16{_mm512_set1_ps(c1x), _mm512_set1_ps(c2), _mm512_set1_ps(c3)};
      for (; v + 16 <= n; v += 16) {
        const __m512 av = b16.estimates(a + v);
        lo = _mm512_max_ps(lo, _mm512_sub_ps(av, b16.bound(av, wn + v)));
        big = _mm512_max_ps(big, _mm512_abs_ps(av));  // an inf shows here; a NaN (which max may not pass on) below
        finite &= _mm512_cmp_ps_mask(av, av, _CMP_UNORD_Q) == 0;
      }
      lower = _mm512_reduce_max_ps(lo);
      finite &= std::isfinite(_mm512_reduce_max_ps(big));
#endif
      for (int64_t t = v; t < n; ++t) {
        const float av = bf16_to_float(a[t]);
        finite &= std::isfinite(av);
        lower = std::max(lower, av - bound1(av, wn[t], c1x, c2, c3));
      }
      if (!finite) continue;
      // Pass 2: the candidates' exact logits, the first of the largest kept.
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_v = -1, count = 0;
      bool nan = false;
      const auto consider = [&](int64_t c) {
        const float f = q8 ? exact_q8_0(xr, packed.data_ptr<uint8_t>(), k, c)
                           : exact_dense(xr, packed.data_ptr<float>(), k, c);
        ++count;
        nan |= std::isnan(f);
        if (best_v < 0 || f > best) best = f, best_v = c;
      };
      v = 0;
#if defined(__AVX512F__)
      const __m512 lower_v = _mm512_set1_ps(lower);
      for (; v + 16 <= n; v += 16) {
        const __m512 av = b16.estimates(a + v);
        const __m512 upper = _mm512_add_ps(av, b16.bound(av, wn + v));
        for (__mmask16 hit = _mm512_cmp_ps_mask(upper, lower_v, _CMP_GE_OQ); hit; hit &= hit - 1)
          consider(v + __builtin_ctz(hit));
      }
#endif
      for (int64_t t = v; t < n; ++t) {
        const float av = bf16_to_float(a[t]);
        if (av + bound1(av, wn[t], c1x, c2, c3) >= lower) consider(t);
      }
      examined += count;
      if (!nan) out[r] = best_v;
    }
  });
  return examined.load();
}
