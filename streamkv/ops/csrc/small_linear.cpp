// y = x W^T (+ b) for the few rows of a decode step, streaming W once at memory speed (CPU, fp32 / bf16 / int8 /
// GGUF Q4_1 and Q8_0 W). Which kernels a build has: fp32 weights (and GGUF codes under fp32 x) on any AVX-512 CPU;
// bf16 weights (and GGUF codes under bf16 x) with AVX512-BF16 (vdpbf16ps); int8 weights with AVX-512 VNNI
// (vpdpwssd; Cascade Lake, Ice Lake and later, Zen 4). AVX2 builds (no AVX-512) run fp32 weights alone, on
// run_avx2: the same layout and summation order, 3 x 32 tiles up to 8 rows and 6 x 16 tiles (the shape of BLIS's
// AVX2 sgemm kernel) past them, on blocks of k once there is more than one pass of rows; 1.2-1.4x oneDNN up to
// 64 rows, on par at 128.
//
// A decode step's matmuls have M = batch rows against weights of N x K: at M <= 8 they are bound by the
// bytes of W, not by FLOPs. oneDNN's packed matmul reaches ~18-20 GB/s on them on the 2-core EPYC where a
// plain read of memory reaches ~26 (docs/benchmarks.md, "Small-batch linear"). This kernel reads W in a
// layout made for that stream:
//
//   fp32:  packed [N/32, K, 2, 16]        packed[p, k, c, j] = W[32 p + 16 c + j, k]
//   bf16:  packed [N/32, K/2, 2, 16, 2]   packed[p, e, c, j, i] = W[32 p + 16 c + j, 2 e + i]   (vdpbf16ps pairs)
//          (N padded to a multiple of 32 and K to a multiple of 2 with zeros)
//
// so the 16 outputs of a column block are one zmm, each step of k is one 64-byte load per block of a
// pair used by every row of x, and a thread walks its pairs of blocks front to back as one sequential
// stream. Rows of x go up to 12 at a time (24 zmm accumulators: 12 rows x the pair's two blocks), each
// row count its own instantiation; past 12 rows the pair's weights are walked again, from L2, while the
// next pair's are prefetched (run()). A row's result is the same whatever the batch it is in: every
// output is one fp32 sum over k ascending, whichever pass computes it (but see run_gguf_amx_f32 below).
//
// int8 weights (--quantization int8, one float32 scale per output column; AVX-512 VNNI):
//
//   int8:  packed [N/32, K/2, 2, 16, 2]   packed[p, e, c, j, i] = q[32 p + 16 c + j, 2 e + i],   W[n, k] ~= q[n, k] * scale[n]
//
// Each row of x is first quantized to int16 with its own scale (max|x| / 32767, nearest-even), so each
// step of k is one 64-byte line (two column blocks' weight pairs, each widened to int16 by vpmovsxbw; a
// thread's pairs of blocks lie end to end, one sequential stream) and one vpdpwssd per row and block:
// int16 x int8 products summed exactly in int32, added every 256 pairs (before any int32 sum could overflow)
// to float64 totals, which hold the integer exactly; the total is rounded to fp32 once, and both scales (and
// the bias) are applied in fp32 at the end. Half the bytes of bf16 per weight at the rows where the weight
// stream is the cost, so this kernel runs every batch size of an int8 model (a row's result never depends on
// its batch). On a CPU with AMX-INT8, batches from AMX_INT8_MIN_ROWS rows run run_amx_int8 instead: tiles
// that sum the same integers, so the same bits (vpdpwssd was compute-bound from 16 rows: 0.23x oneDNN's bf16
// matmul at 4,096).
// The x error per element is at most max|x| / 65534: next to bf16's rounding of x (2^-9 relative), and
// far below the weights' own quantization step.
//
// bf16 on a CPU with AMX-BF16 (Sapphire Rapids and later) runs run_amx instead, on the same packed layout:
// there vdpbf16ps computes at ~53 GMAC/s a core and the kernel above was compute-bound from 16 rows (0.25x
// oneDNN's AMX matmul at 64), while tdpbf16ps reaches ~550, so every row count streams the weight at memory
// speed up to 32 rows and keeps at or ahead of oneDNN up to 128 (docs/benchmarks.md, "Round 15"). Python sends
// every batch size here (streamkv/model/linear.py, SmallMatmul), prefill chunks included ("Round 44").
//
// fp32 x on GGUF codes (the default model's format; streamkv/model/gguf_codes.py, run_gguf): a pair's 32 columns
// keep their codes and fp16 scales per block of 32 k: Q4_1's 4-bit codes with d and m (640 bytes a block; the
// projections), Q8_0's int8 codes with d (1,088 bytes; the tied embedding, our LM head). w = d * q + m, or d * q,
// is exact to the bit of gguf-py's fp32 dequantization, and the sums are the fp32 kernel's, so the results are the
// fp32 kernel's on the dequantized weight, bitwise, from a fifth (Q4_1) or 0.27 (Q8_0) of the bytes. The
// exception: on AMX, batches of GGUF_F32_AMX_MIN_ROWS rows and more (prefill) run run_gguf_amx_f32, fp32 sums of
// exact products in another order, whose last bits differ (as oneDNN's fp32 matmul's did on those rows).
//
// bf16 x on GGUF codes (AVX512-BF16; run_gguf_bf16): a bf16 model holds those weights rounded once to bf16, and the
// kernel rounds its exact dequantization the same way into the bf16 kernels' panel (AMX tiles or vdpbf16ps; without
// AMX, up to 12 rows, the panel's lines go from registers straight to vdpbf16ps), from its own layout of the same bytes
// ([N/32, K/32, 40, 16] and [N/32, K/32, 68, 16]); the results are the bf16 kernel's on the bf16 weight, bitwise, from
// ~0.3 (Q4_1) or 0.53 (Q8_0) of the bytes. small_linear tells the layouts apart by their shapes and x's dtype: a tensor
// of one layout reshaped into the other's is not detected, so take them from the pack functions as they come.
//
// Numerics: fp32 accumulates every product in fp32 (k ascending); bf16 multiplies bf16 pairs exactly and
// accumulates in fp32 (vdpbf16ps), then rounds to bf16 once, round-to-nearest-even: the contract of
// oneDNN's bf16 matmul, with another summation order. The bias is added in fp32 before that rounding.

#include "ops.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// fp32 on AVX2 (no AVX-512): the same packed layout, a pair's 32 columns as four ymm per step of k.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define STREAMKV_AVX2_LINEAR 1
#endif

// bf16 on AMX tiles (STREAMKV_AMX, amx.h): the same packed layout, see run_amx.
#include "amx.h"
#include "silu_table.h"
#include "simd_math.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using streamkv::amx_on;
using streamkv::TileConfig;

constexpr int64_t LANES = 16;  // outputs per column block
constexpr int64_t ROWS = 8;    // rows of x per pass over a column block (int8 kernel)
constexpr int FLOAT_ROWS = 12;  // most rows of x per pass for the float kernels (24 accumulators)
constexpr int64_t GGUF_K = 32;             // GGUF Q4_1 / Q8_0: k steps per block (run_gguf)
constexpr int64_t Q4_1_BLOCK_BYTES = 640;  // Q4_1: a pair's block of 32 k steps, codes then d and m
constexpr int64_t Q8_0_BLOCK_BYTES = 1088;  // Q8_0: a pair's block of 32 k steps, codes then d

int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// A 64-byte-aligned scratch of `elems` T on the calling thread, kept (it only grows) for the thread's next calls.
// One per T: a caller is done with it before that thread asks for a T scratch again.
template <typename T>
T* thread_scratch(int64_t elems) {
  thread_local std::vector<T> storage;
  const size_t want = static_cast<size_t>(elems) + 64 / sizeof(T);
  if (storage.size() < want) storage.resize(want);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

#if defined(__AVX512F__)
// The first min(live, 16) lanes (none when live <= 0).
inline __mmask16 first_lanes(int64_t live) {
  return live >= LANES ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(live > 0 ? (1u << live) - 1 : 0);
}

// 16 fp32 results into the first lanes of `mask` at dst, as T (bf16: rounded once, nearest-even).
template <typename T>
inline void store_row(T* dst, __mmask16 mask, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(dst, mask, v);
  } else {
    _mm256_mask_storeu_epi16(dst, mask, bf16_round16(v));
  }
}

// A pass's results acc[c][r] (+ bias) into rows [m0, m0 + R) of y, columns col0 + 16 c + j below n (the zero
// columns padding N to a multiple of 32 are not stored).
template <typename T, int R>
inline void store_pair(const __m512 (&acc)[2][R], T* y, int64_t y_stride, const float* bias, int64_t m0, int64_t col0,
                       int64_t n) {
  for (int c = 0; c < 2; ++c) {
    const int64_t col = col0 + c * LANES;
    const int64_t live = std::min<int64_t>(LANES, n - col);
    if (live <= 0) break;
    const __mmask16 mask = first_lanes(live);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store_row(y + (m0 + r) * y_stride + col, mask, _mm512_add_ps(acc[c][r], b));
  }
}

// The two column blocks of pair `pair` for rows [m0, m0 + R) of x. A step of k reads two 64-byte
// lines (block 0's, then block 1's) and consecutive pairs are consecutive in memory: one sequential stream.
template <typename T, int R>
inline void column_pair(const T* x, int64_t x_stride, T* y, int64_t y_stride, const T* packed, const float* bias,
                        int64_t m0, int64_t pair, int64_t n, int64_t k_steps, const char* ahead, int64_t ahead_lines) {
  // R rows of x from m0, a compile-time count (so acc[][] stays in registers with no test per row).
  // k_steps: K for fp32, K/2 (pairs) for bf16. ahead: the first of ahead_lines 64-byte lines to bring into
  // the cache during this pass, one a step (the next pair's panel; see run()).
  constexpr int NB = 2;
  __m512 acc[NB][R];
  for (int c = 0; c < NB; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  const char* w = reinterpret_cast<const char*>(packed) + pair * k_steps * NB * 64;
  const T* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * x_stride;
  for (int64_t s = 0; s < k_steps; ++s) {
    const char* p = w + s * NB * 64;
    _mm_prefetch(p + 2048, _MM_HINT_T0);
    _mm_prefetch(p + 2048 + 64, _MM_HINT_T0);
    if (s < ahead_lines) _mm_prefetch(ahead + s * 64, _MM_HINT_T1);
    __m512 wv[NB];
    for (int c = 0; c < NB; ++c) wv[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(p + c * 64));
    for (int r = 0; r < R; ++r) {
      __m512 xv;
      if constexpr (std::is_same_v<T, float>) {
        xv = _mm512_set1_ps(xr[r][s]);
      } else {
        int32_t x_pair;
        std::memcpy(&x_pair, xr[r] + 2 * s, sizeof(x_pair));
        xv = _mm512_castsi512_ps(_mm512_set1_epi32(x_pair));
      }
      for (int c = 0; c < NB; ++c) {
        if constexpr (std::is_same_v<T, float>) {
          acc[c][r] = _mm512_fmadd_ps(xv, wv[c], acc[c][r]);
        } else {
#if defined(__AVX512BF16__)
          acc[c][r] = _mm512_dpbf16_ps(acc[c][r], (__m512bh)xv, (__m512bh)wv[c]);
#else
          static_assert(std::is_same_v<T, float>, "bf16 weights need AVX512-BF16 (small_linear_bf16_supported)");
#endif
        }
      }
    }
  }
  store_pair<T, R>(acc, y, y_stride, bias, m0, 2 * pair * LANES, n);
}

// column_pair for 1 <= rows <= FLOAT_ROWS rows, each count its own instantiation.
template <typename T, int R = FLOAT_ROWS>
inline void column_pair_rows(int64_t rows, const T* x, int64_t x_stride, T* y, int64_t y_stride, const T* packed,
                             const float* bias, int64_t m0, int64_t pair, int64_t n, int64_t k_steps,
                             const char* ahead, int64_t ahead_lines) {
  if constexpr (R > 1) {
    if (rows < R)
      return column_pair_rows<T, R - 1>(rows, x, x_stride, y, y_stride, packed, bias, m0, pair, n, k_steps, ahead,
                                        ahead_lines);
  }
  column_pair<T, R>(x, x_stride, y, y_stride, packed, bias, m0, pair, n, k_steps, ahead, ahead_lines);
}

// Past SMALL_BATCH_MAX_ROWS rows (prefill chunks) run, run_gguf and run_gguf_bf16 (the vector kernels) walk a
// thread's pairs a chunk of PANEL_CHUNK_BYTES at a time, as the AMX kernel does past AMX_PANEL_MAJOR_ROWS: the
// chunk's panels dequantized once (GGUF codes) or read in place (packed weights), then pass by pass (FLOAT_ROWS rows of x, in L1) over every panel of the chunk (from L2). Pair by pair, a
// prefill-sized x came from L3 in every pass. SmolLM2's projections at 4,096 rows, 2 threads, as a share of the
// FMA (fp32) or vdpbf16ps (bf16) peak, against oneDNN's on the dense weight in the same run: bf16 qkv 86.6 ->
// 90.7% (oneDNN 92.2), gate_up 85.3 -> 93.0% (93.1); fp32 qkv 90.8 -> 90.9-92.6% (95.6-96.0), down 89.9-91.6 ->
// 92.2-95.7% (96.2-96.4) (docs/benchmarks.md, "Round 44"). A row's result is the same bits either way: each
// output is column_pair's chain, k ascending, whatever the rows beside it.
constexpr int64_t SMALL_BATCH_MAX_ROWS = 128;
constexpr int64_t PANEL_CHUNK_BYTES = 1 << 20;

// The walk over m rows and the pairs' panels (k_steps x 128 bytes each, run()'s layout). panels(p0, p1, end) gives
// pair p0's panel with those of pairs p0 + 1 .. p1 - 1 after it, read until its next call on the same thread (end:
// the end of the thread's range, for asking for the codes that follow); pass(rows, m0, pair, panel) runs rows
// [m0, m0 + rows) against one pair's panel.
template <typename T, typename Panels, typename Pass>
void walk_panel_chunks(int64_t m, int64_t pairs, int64_t k_steps, const Panels& panels_of, const Pass& pass) {
  const int64_t panel_elems = k_steps * 2 * 64 / static_cast<int64_t>(sizeof(T));
  const int64_t chunk = k_steps > 0 ? std::max<int64_t>(1, PANEL_CHUNK_BYTES / (k_steps * 2 * 64)) : pairs;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += chunk) {
      const int64_t p1 = std::min(end, p0 + chunk);
      const T* panels = panels_of(p0, p1, end);
      for (int64_t m0 = 0; m0 < m; m0 += FLOAT_ROWS)
        for (int64_t pair = p0; pair < p1; ++pair)
          pass(std::min<int64_t>(FLOAT_ROWS, m - m0), m0, pair, panels + (pair - p0) * panel_elems);
    }
  });
}

// x [m, K] @ the pairs' panels into y (walk_panel_chunks).
template <typename T, typename Panels>
void run_panel_chunks(int64_t m, const T* xp, int64_t x_stride, T* yp, int64_t y_stride, const float* bias,
                      int64_t n, int64_t pairs, int64_t k_steps, const Panels& panels_of) {
  walk_panel_chunks<T>(m, pairs, k_steps, panels_of, [&](int64_t rows, int64_t m0, int64_t pair, const T* panel) {
    const int64_t col = pair * 2 * LANES;
    column_pair_rows<T>(rows, xp, x_stride, yp + col, y_stride, panel, bias ? bias + col : nullptr, m0, 0, n - col,
                        k_steps, nullptr, 0);
  });
}

// run_panel_chunks' panels for GGUF codes: pairs p0 .. p1 - 1 dequantized by dequantize(codes, next, panel) into
// this thread's scratch (next: the following pair's codes to ask for, null past the thread's range).
template <typename T, typename Dequantize>
auto dequantized_chunk(const uint8_t* wp, int64_t pair_bytes, int64_t panel_elems, const Dequantize& dequantize) {
  return [=](int64_t p0, int64_t p1, int64_t end) {
    T* panel = thread_scratch<T>((p1 - p0) * panel_elems);
    for (int64_t pair = p0; pair < p1; ++pair) {
      const uint8_t* w = wp + pair * pair_bytes;
      dequantize(w, pair + 1 < end ? w + pair_bytes : nullptr, panel + (pair - p0) * panel_elems);
    }
    return static_cast<const T*>(panel);
  };
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  const int64_t m = x.size(0);
  const int64_t pairs = packed.size(0);
  const int64_t k_steps = packed.size(1);  // K (fp32) or K / 2 (bf16 pairs)
  const T* xp = x.data_ptr<T>();
  T* yp = out.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  // Contiguous ranges of pairs per thread keep each thread's stream sequential. A pair's panel (k_steps x
  // 128 bytes) is walked once per pass of up to FLOAT_ROWS rows (the passes as even as they can be: 32 rows
  // are 11 + 11 + 10, not 12 + 12 + 8). With one pass the stream is bound by memory; with more, the first
  // would wait on memory and the others compute from L2, so each pass also pulls an equal share of the next
  // pair's panel into the cache: memory streams the next panel while the FMAs work on this one, and every
  // pass reads from L2 (docs/benchmarks.md, "The small-batch kernel past 8 rows").
  if (m == 0) return;
  if (m > SMALL_BATCH_MAX_ROWS) {
    const int64_t panel_elems = k_steps * 2 * 64 / static_cast<int64_t>(sizeof(T));
    run_panel_chunks<T>(m, xp, x.stride(0), yp, out.stride(0), bias, n, pairs, k_steps,
                        [=](int64_t p0, int64_t, int64_t) { return wp + p0 * panel_elems; });
    return;
  }
  const int64_t passes = (m + FLOAT_ROWS - 1) / FLOAT_ROWS;
  const int64_t rows_per_pass = (m + passes - 1) / passes;
  const int64_t panel_lines = 2 * k_steps;  // two 64-byte lines a step
  const int64_t share = passes > 1 ? (panel_lines + passes - 1) / passes : 0;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const char* next = reinterpret_cast<const char*>(wp) + (pair + 1) * panel_lines * 64;
      for (int64_t m0 = 0, pass = 0; m0 < m; m0 += rows_per_pass, ++pass) {
        const int64_t first = std::min(pass * share, panel_lines);
        const int64_t lines = pair + 1 < end ? std::min(share, panel_lines - first) : 0;
        column_pair_rows<T>(std::min(rows_per_pass, m - m0), xp, x.stride(0), yp, out.stride(0), wp, bias, m0, pair,
                            n, k_steps, next + first * 64, lines);
      }
    }
  });
}

// fp32 on GGUF codes (the default model's format; see the file's header). A pair's 32 columns over one block of
// 32 k steps are Block::BYTES bytes. Q4_1 (the projections), Q4_1_BLOCK_BYTES:
//   [0, 512)    32 steps x 16 bytes: byte j of step e holds column j's code (low nibble) and column 16 + j's (high)
//   [512, 576)  d of the 32 columns, fp16;   [576, 640)  m of the 32 columns, fp16
// and w = d * q + m. d has 11 significant bits and q 4, so d * q is exact in fp32 and one FMA rounds once, as
// gguf-py's fp32 (d * q) + m does. Q8_0 (the tied embedding, our LM head), Q8_0_BLOCK_BYTES:
//   [0, 1024)    32 steps x 32 bytes: byte j of step e is column j's int8 code
//   [1024, 1088) d of the 32 columns, fp16
// and w = d * q: 11 significant bits times 8 (sign included) is exact in fp32, as gguf-py's q * d is. Either way
// every weight is bitwise the dequantized one.

// float(q & 15) of each lane of q, exactly: a lookup (vpermps reads the index's low 4 bits) instead of and +
// vcvtdq2ps. On Intel cores vcvtdq2ps and the shifts share port 0 and vpermps runs on port 5: a Q4_1 block of one
// bf16 row on the AMX kernel, from L2, took 250 -> 174 cycles on the Intel AMX host (scratch timing, round 40).
inline __m512 nibble_to_float(__m512i q) {
  return _mm512_permutexvar_ps(q, _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
}

// The two weight vectors of step e of a pair's Q4_1 block (columns 0-15 and 16-31), dequantized.
struct Q4_1Block {
  static constexpr int64_t BYTES = Q4_1_BLOCK_BYTES;
  __m512 d0, d1, m0, m1;
  const uint8_t* codes;
  explicit Q4_1Block(const uint8_t* blk)
      : d0(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 512)))),
        d1(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 544)))),
        m0(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 576)))),
        m1(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 608)))),
        codes(blk) {}
  void step(int64_t e, __m512& w0, __m512& w1) const {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + e * 16)));
    w0 = _mm512_fmadd_ps(d0, nibble_to_float(q), m0);
    w1 = _mm512_fmadd_ps(d1, nibble_to_float(_mm512_srli_epi32(q, 4)), m1);
  }
};

// The same for a pair's Q8_0 block.
struct Q8_0Block {
  static constexpr int64_t BYTES = Q8_0_BLOCK_BYTES;
  __m512 d0, d1;
  const uint8_t* codes;
  explicit Q8_0Block(const uint8_t* blk)
      : d0(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 1024)))),
        d1(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 1056)))),
        codes(blk) {}
  void step(int64_t e, __m512& w0, __m512& w1) const {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + e * 32));
    w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
  }
};

// column_pair for GGUF codes, rows [m0, m0 + R) in one pass, each step's weights dequantized in registers: the
// FMA chain of column_pair on the dequantized weight (acc = x * w + acc, k ascending), so the same bits. A step
// reads 16 (Q4_1) or 32 (Q8_0) bytes of codes where fp32 reads 128; the block two ahead is asked for a line a step.
template <typename Block, int R>
inline void column_pair_gguf(const float* x, int64_t x_stride, float* y, int64_t y_stride, const uint8_t* w,
                             const float* bias, int64_t m0, int64_t n, int64_t blocks, float* panel = nullptr) {
  __m512 acc[2][R];
  for (int c = 0; c < 2; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * x_stride;
  for (int64_t b = 0; b < blocks; ++b) {
    const Block blk(w + b * Block::BYTES);
    for (int64_t e = 0; e < GGUF_K; ++e) {
      if (e < Block::BYTES / 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk.codes) + 2 * Block::BYTES + e * 64, _MM_HINT_T0);
      __m512 w0, w1;
      blk.step(e, w0, w1);
      const int64_t s = b * GGUF_K + e;
      if (panel != nullptr) {
        _mm512_store_ps(panel + s * 2 * LANES, w0);
        _mm512_store_ps(panel + s * 2 * LANES + LANES, w1);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(xr[r][s]);
        acc[0][r] = _mm512_fmadd_ps(xv, w0, acc[0][r]);
        acc[1][r] = _mm512_fmadd_ps(xv, w1, acc[1][r]);
      }
    }
  }
  store_pair<float, R>(acc, y, y_stride, bias, m0, 0, n);  // y, bias and n start at the pair's first column
}

template <typename Block, int R = FLOAT_ROWS>
inline void column_pair_gguf_rows(int64_t rows, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                                  const uint8_t* w, const float* bias, int64_t m0, int64_t n, int64_t blocks,
                                  float* panel = nullptr) {
  if constexpr (R > 1) {
    if (rows < R)
      return column_pair_gguf_rows<Block, R - 1>(rows, x, x_stride, y, y_stride, w, bias, m0, n, blocks, panel);
  }
  column_pair_gguf<Block, R>(x, x_stride, y, y_stride, w, bias, m0, n, blocks, panel);
}

// A pair's whole panel dequantized into fp32 in run()'s packed layout [K, 2, 16] (panel: 64-byte aligned), the
// next pair's codes asked for a block's lines at each block.
template <typename Block>
inline void dequantize_pair(const uint8_t* w, int64_t blocks, const uint8_t* next, float* panel) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (next != nullptr)
      for (int64_t l = 0; l < Block::BYTES / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next) + b * Block::BYTES + l * 64, _MM_HINT_T1);
    const Block blk(w + b * Block::BYTES);
    for (int64_t e = 0; e < GGUF_K; ++e) {
      __m512 w0, w1;
      blk.step(e, w0, w1);
      _mm512_store_ps(panel + (b * GGUF_K + e) * 2 * LANES, w0);
      _mm512_store_ps(panel + (b * GGUF_K + e) * 2 * LANES + LANES, w1);
    }
  }
}

// y = x W^T (+ b), W as GGUF codes packed [N/32, K/32, Block::BYTES]. Up to FLOAT_ROWS rows: one pass, the
// weights dequantized in registers (Q4_1 is a fifth of fp32's bytes: 1 row ran 4.3x, 8 rows 2.6x the fp32 kernel
// on SmolLM2's projections from memory). More rows: the first pass dequantizes in registers as one pass does and
// stores each step's two weight vectors into a thread-local fp32 panel (73 KB at K = 576), and run()'s later
// passes read that panel from L2, where dequantizing in every pass was slower at 64-128 rows (docs/benchmarks.md,
// "Round 21"). Before round 44 the panel was dequantized in a pass of its own before the row passes: a decode
// step's fp32 matmuls (30 layers and the LM head, taking turns, best of 5) at 16 / 32 / 64 rows took 26.7 / 46.0 /
// 86.8 ms, now 22.9 / 43.0 / 83.5; in bf16 (run_gguf_bf16, the same change) 14.9 / 24.6 / 44.0 -> 12.9 / 22.5 /
// 42.2. Past SMALL_BATCH_MAX_ROWS rows, run_panel_chunks. Either way a row's result is column_pair's on the
// dequantized weight, bitwise, whatever its batch.
template <typename Block>
void run_gguf(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(1), pairs = packed.size(0);
  if (m == 0) return;
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t passes = (m + FLOAT_ROWS - 1) / FLOAT_ROWS;
  const int64_t rows_per_pass = (m + passes - 1) / passes;
  const int64_t pair_bytes = blocks * Block::BYTES;
  if (m > SMALL_BATCH_MAX_ROWS) {
    run_panel_chunks<float>(m, xp, x.stride(0), yp, out.stride(0), bias, n, pairs, k,
                            dequantized_chunk<float>(wp, pair_bytes, k * 2 * LANES,
                                                     [blocks](const uint8_t* w, const uint8_t* next, float* panel) {
                                                       dequantize_pair<Block>(w, blocks, next, panel);
                                                     }));
    return;
  }
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    float* panel = passes > 1 ? thread_scratch<float>(k * 2 * LANES) : nullptr;
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint8_t* w = wp + pair * pair_bytes;
      const int64_t col = pair * 2 * LANES;
      const float* b = bias ? bias + col : nullptr;
      if (passes == 1) {
        column_pair_gguf_rows<Block>(m, xp, x.stride(0), yp + col, out.stride(0), w, b, 0, n - col, blocks);
        continue;
      }
      // The first pass dequantizes in registers and lays the panel out for the others (see run_gguf's note).
      column_pair_gguf_rows<Block>(rows_per_pass, xp, x.stride(0), yp + col, out.stride(0), w, b, 0, n - col, blocks,
                                   panel);
      for (int64_t m0 = rows_per_pass; m0 < m; m0 += rows_per_pass)
        column_pair_rows<float>(std::min(rows_per_pass, m - m0), xp, x.stride(0), yp + col, out.stride(0), panel, b,
                                m0, 0, n - col, k, nullptr, 0);
    }
  });
}

// small_linear_silu_mul for fp32 x (prefill-sized steps, small_linear_silu_mul_takes): the chunk walk of run_gguf
// (codes) or run() (dense fp32) past SMALL_BATCH_MAX_ROWS rows, each pass into a [rows, 32] tile on the stack whose
// 16 gate and 16 up columns silu_mul16_f32 turns into the pass's 16 columns of act. The tile holds g + bg and u + bu
// as store_pair writes them, and silu_mul16_f32 is silu_and_mul_f32's arithmetic (fused_layers.cpp), so act is
// bitwise silu_and_mul(small_linear(x)); the [M, 2I] fp32 gate_up (12.6 MB a 1,024-row slice of SmolLM2) never goes
// to memory. Block: Q4_1Block or Q8_0Block for GGUF codes, void for a dense fp32 pack.
template <typename Block>
void run_silu_mul_f32(at::Tensor& act, const at::Tensor& x, const at::Tensor& packed, const float* bias) {
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(0), x_stride = x.stride(0);
  if (m == 0) return;
  const float* xp = x.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  const int64_t a_stride = act.stride(0);
  const int64_t panel_elems = k * 2 * LANES;
  const auto panel_pass = [&](int64_t rows, int64_t m0, int64_t pair, const float* panel) {
    alignas(64) float tile[FLOAT_ROWS * 2 * LANES];
    column_pair_rows<float>(rows, xp + m0 * x_stride, x_stride, tile, 2 * LANES, panel,
                            bias ? bias + pair * 2 * LANES : nullptr, 0, 0, 2 * LANES, k, nullptr, 0);
    for (int64_t r = 0; r < rows; ++r)
      _mm512_storeu_ps(ap + (m0 + r) * a_stride + pair * LANES,
                       silu_mul16_f32(_mm512_load_ps(tile + r * 2 * LANES), _mm512_load_ps(tile + r * 2 * LANES + LANES)));
  };
  if constexpr (std::is_void_v<Block>) {
    const float* dense = packed.data_ptr<float>();
    walk_panel_chunks<float>(m, pairs, k, [=](int64_t p0, int64_t, int64_t) { return dense + p0 * panel_elems; },
                             panel_pass);
  } else {
    const int64_t blocks = packed.size(1);
    walk_panel_chunks<float>(m, pairs, k,
                             dequantized_chunk<float>(packed.data_ptr<uint8_t>(), blocks * Block::BYTES, panel_elems,
                                                      [blocks](const uint8_t* w, const uint8_t* next, float* panel) {
                                                        dequantize_pair<Block>(w, blocks, next, panel);
                                                      }),
                             panel_pass);
  }
}
#endif

#if defined(STREAMKV_AMX)
// bf16 on AMX (Intel's Advanced Matrix Extensions, 8 tile registers of 16 rows x 64 bytes):
//   tile 0, 1: C, fp32 [16 rows, 16 columns] of the pair's blocks 0 and 1 for row block 0; 2, 3: for block 1
//   tile 4, 5: A, 16 rows of x x 32 bf16 of k (row blocks 0 and 1)
//   tile 6, 7: B, 16 pairs of k x the 16 columns of block 0 / 1 as (k, k+1) pairs: in the packed layout
//              these are the step's lines of that block, 128 bytes apart, so a tile loads straight from it
// tdpbf16ps multiplies bf16 pairs exactly and sums them into the fp32 tile (Intel SDM: round-to-nearest-even,
// denormal inputs and outputs taken as zero), k ascending 32 at a time; a row's result does not depend on
// the rows beside it, so it is the same in every batch. One tdpbf16ps is 16 x 16 x 32 products, so even a
// single row streams the weight at memory speed, and at 128 rows the kernel still reads more than 30 GB/s of
// weights where oneDNN's bf16 matmul stalls on the same tiles (docs/benchmarks.md, "Round 15").
constexpr int64_t AMX_ROWS = 16;       // rows of x in an A tile
constexpr int64_t AMX_K = 32;          // bf16 of k per tile step (16 pairs, 64 bytes a row)
constexpr int64_t AMX_STEP_BYTES = 2048;  // one tile step of a pair's panel: 16 pairs x 2 blocks x 64 bytes
// The order of a thread's tile passes. Up to AMX_PANEL_MAJOR_ROWS rows (decode batches) pair by pair: each
// pair's panel comes from memory once and its later passes read it from L1/L2. With more rows, pass by pass
// over AMX_CHUNK_BYTES of the thread's panels at a time: a pass's 32 rows of x (36 KB at K = 576, 96 KB at
// 1,536) stay in L1 or L2 while the chunk's panels come from L2, and x is read once a chunk, not once a pair.
// Pair by pair, a prefill-sized x was read from L3 once for every pair: 4,096 rows of gate_up ran in 12.3 ms
// (oneDNN 4.3), pass by pass in 5.6 (oneDNN 4.0, the same run); a whole decode step's matmuls at 48 / 64
// rows took 15.5-15.7 / 16.9-17.0 ms pass by pass against 14.7-14.9 / 15.5 pair by pair (docs/benchmarks.md,
// "Round 16").
constexpr int64_t AMX_PANEL_MAJOR_ROWS = 128;
constexpr int64_t AMX_CHUNK_BYTES = 1 << 20;

// One pass of k_tiles tile steps for the row block at a (and the one 16 rows below when TWO); step(t) gives tile
// step t's 2 KB of bf16 weights in the panel layout (the two B tiles, 64 bytes apart with rows 128 apart). The C
// tiles land in c_out [16 or 32 rows][32 floats]. between(t) runs after step t's tile products are issued: work for
// the vector units (the previous pass's stores, run_amx_passes) while the tiles compute. No software prefetch on a
// dense panel: asking for it 2 or 4 steps ahead (into L1 or L2), or for the next panel during the later passes as
// run() does, timed the same as none (load_tests/bench_small_linear.py, 1-128 rows, docs/benchmarks.md "Round 15").
template <bool TWO, typename Step, typename Between>
inline void amx_pass_steps(const char* a, int64_t a_stride, int64_t k_tiles, float* c_out, const Step& step,
                           const Between& between) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < k_tiles; ++t) {
    const char* b = step(t);
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + 64, 128);
    _tile_loadd(4, a + t * AMX_K * 2, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, a + AMX_ROWS * a_stride + t * AMX_K * 2, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    between(t);
  }
  _tile_stored(0, c_out, 128);
  _tile_stored(1, c_out + LANES, 128);
  if constexpr (TWO) {
    _tile_stored(2, c_out + AMX_ROWS * 32, 128);
    _tile_stored(3, c_out + AMX_ROWS * 32 + LANES, 128);
  }
}

// K a multiple of 32 (the tiles take whole steps); other shapes run the vdpbf16ps kernel.
bool amx_takes(int64_t k) { return k % AMX_K == 0; }

// Loads this thread's tile configuration: tiles 0-5 (C and A) of ac_rows rows, 6-7 (B) of 16; 64 bytes a row.
inline void load_tile_config(int64_t ac_rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 6 ? ac_rows : AMX_ROWS;
    cfg.colsb[t] = 64;
  }
  load_tiles(cfg);
}

// Rows [r_begin, r_end) of a pass's results c [rows][32] fp32 for pair `pair` plus the bias, into rows r0 + r of
// y (T: float or bf16), its columns past n (the zero block padding N to a multiple of 32) left out.
template <typename T>
inline void store_pass(const float* c, int64_t r_begin, int64_t r_end, int64_t pair, int64_t n, const float* bias,
                       T* y, int64_t y_stride, int64_t r0) {
  for (int cb = 0; cb < 2; ++cb) {
    const int64_t col = (2 * pair + cb) * LANES;
    const int64_t live = std::min<int64_t>(LANES, n - col);
    if (live <= 0) break;
    const __mmask16 mask = first_lanes(live);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t r = r_begin; r < r_end; ++r)
      store_row(y + (r0 + r) * y_stride + col, mask, _mm512_add_ps(_mm512_load_ps(c + r * 32 + cb * LANES), bv));
  }
}

// The walk every AMX matmul here shares. Each thread loads the tile configuration (tiles 0-5, C and A: tile_rows
// rows; 6-7, B: 16 rows; 64 bytes a row), takes a contiguous range of the pairs and calls
// tile_pass(state, pair, pass, w) for each of `passes` row passes of each pair, w the pair's panel, in the order
// AMX_PANEL_MAJOR_ROWS picks for m rows; a row's result is the same in either order. panels(p0, p1) gives pair p0's
// panel with those of pairs p0 + 1 .. p1 - 1 after it (panel_bytes apart), read until its next call on the same
// thread. state is the thread's State, default-constructed on its stack; finish(state) runs after its last pass.
template <typename State, typename Panels, typename TilePass, typename Finish>
void amx_walk_panels(int64_t m, int64_t tile_rows, int64_t pairs, int64_t passes, int64_t panel_bytes,
                     const Panels& panels, const TilePass& tile_pass, const Finish& finish) {
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    State state;
    load_tile_config(tile_rows);
    if (m <= AMX_PANEL_MAJOR_ROWS) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const char* w = panels(pair, pair + 1);
        for (int64_t pass = 0; pass < passes; ++pass) tile_pass(state, pair, pass, w);
      }
    } else {
      const int64_t chunk = panel_bytes > 0 ? std::max<int64_t>(1, AMX_CHUNK_BYTES / panel_bytes) : end - begin;
      for (int64_t p0 = begin; p0 < end; p0 += chunk) {
        const int64_t p1 = std::min(end, p0 + chunk);
        const char* w = panels(p0, p1);
        for (int64_t pass = 0; pass < passes; ++pass)
          for (int64_t pair = p0; pair < p1; ++pair) tile_pass(state, pair, pass, w + (pair - p0) * panel_bytes);
      }
    }
    finish(state);
    _tile_release();
  });
}

// A thread's pass whose stores wait for the tile steps of its next pass (run_amx_passes): the two C buffers in
// turn, c[cur ^ 1] the pending one, its rows [done, rows) not yet stored (rows 0: none pending). On the thread's
// stack (amx_walk_panels' State).
struct PendingPass {
  alignas(64) float c[2][2 * AMX_ROWS * 32];
  int cur = 0;
  int64_t rows = 0, done = 0, pair = 0, r0 = 0;
};

// x [M, K] bf16 @ W^T on AMX tiles, each pair's panel in run<at::BFloat16>'s packed layout, every pass's fp32
// sums handed to store(c, r_begin, r_end, pair, r0): rows [r_begin, r_end) of c [rows][32], the pass's rows
// r0 .. of the pair's 32 columns (no bias). Rows go 32 at a time (two A tiles against the same two B tiles); past
// 16 rows x is copied into rows padded to a multiple of 16 with zeros, so a tile never reads past x. panels and
// panel_bytes as in amx_walk_panels: the packed weight itself (run_amx), or codes dequantized into a buffer
// (run_gguf_bf16). pass_fn.run<TWO>(a, a_stride, panel, c, between, pass, passes) runs one pass's k_tiles tile steps
// over a panel into c (TWO: 32 rows, else 16), pass `pass` of `passes` over that pair: PanelPass, or CodesPass on
// codes that it dequantizes a tile step at a time.
// A pass's stores run a few rows after each tile step of the thread's next pass (its last pass's at the end), so
// the vector units convert and store while the tiles compute instead of between them.
template <typename Panels, typename Pass, typename Store>
void run_amx_passes(const at::Tensor& x, int64_t pairs, int64_t k_tiles, int64_t panel_bytes, const Panels& panels,
                    const Pass& pass_fn, const Store& store) {
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) return;
  // Fewer than 16 rows (a small decode batch): the A and C tiles are configured with m rows, so a tile step
  // costs what m rows cost. More: whole tiles, the last block's missing rows zeros.
  const int64_t tile_rows = std::min(m, AMX_ROWS);
  const int64_t mp = m < AMX_ROWS ? m : padded(m, AMX_ROWS);
  at::Tensor xs = x;
  if (mp != m) {
    xs = at::zeros({mp, k}, x.options());
    xs.narrow(0, 0, m).copy_(x);
  }
  const char* xp = reinterpret_cast<const char*>(xs.data_ptr<at::BFloat16>());
  const int64_t x_stride = xs.stride(0) * 2;
  const int64_t blocks = (mp + AMX_ROWS - 1) / AMX_ROWS, passes = (blocks + 1) / 2;
  const auto drain = [&](PendingPass& p, int64_t upto) {
    if (upto <= p.done) return;
    store(p.c[p.cur ^ 1], p.done, upto, p.pair, p.r0);
    p.done = upto;
  };
  amx_walk_panels<PendingPass>(
      m, tile_rows, pairs, passes, panel_bytes, panels,
      [&](PendingPass& p, int64_t pair, int64_t pass, const char* w) {
        const int64_t r0 = 2 * pass * AMX_ROWS;
        const bool two = 2 * pass + 1 < blocks;
        const int64_t prev = p.rows;
        const auto between = [&](int64_t t) { drain(p, (t + 1) * prev / k_tiles); };
        if (two)
          pass_fn.template run<true>(xp + r0 * x_stride, x_stride, w, p.c[p.cur], between, pass, passes);
        else
          pass_fn.template run<false>(xp + r0 * x_stride, x_stride, w, p.c[p.cur], between, pass, passes);
        drain(p, prev);
        p.rows = std::min<int64_t>(two ? 2 * AMX_ROWS : AMX_ROWS, m - r0);
        p.done = 0;
        p.pair = pair;
        p.r0 = r0;
        p.cur ^= 1;
      },
      [&](PendingPass& p) { drain(p, p.rows); });
}

// run_amx_passes' store for out [M, N] bf16 = x W^T (+ bias): each pass stored by store_pass.
inline auto out_store(at::Tensor& out, const float* bias, int64_t n) {
  return [yp = out.data_ptr<at::BFloat16>(), y_stride = out.stride(0), bias, n](
             const float* c, int64_t r_begin, int64_t r_end, int64_t pair, int64_t r0) {
    store_pass(c, r_begin, r_end, pair, n, bias, yp, y_stride, r0);
  };
}

// One pass of amx_pass_steps over a panel in pack_small_linear's bf16 layout (k_tiles tile steps).
struct PanelPass {
  int64_t k_tiles;
  template <bool TWO, typename Between>
  void run(const char* a, int64_t a_stride, const char* w, float* c, const Between& between, int64_t = 0,
           int64_t = 1) const {
    amx_pass_steps<TWO>(a, a_stride, k_tiles, c, [w](int64_t t) { return w + t * AMX_STEP_BYTES; }, between);
  }
};

// run_amx_passes over a packed bf16 weight (pack_small_linear), each pass handed to store.
template <typename Store>
void dense_passes(const at::Tensor& x, const at::Tensor& packed, const Store& store) {
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  const int64_t k_tiles = x.size(1) / AMX_K, panel_bytes = k_tiles * AMX_STEP_BYTES;
  run_amx_passes(x, packed.size(0), k_tiles, panel_bytes, [&](int64_t p0, int64_t) { return wp + p0 * panel_bytes; },
                 PanelPass{k_tiles}, store);
}

// out = x W^T (+ bias) on a packed bf16 weight.
void run_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  dense_passes(x, packed, out_store(out, bias, n));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 x on GGUF codes (run_gguf_bf16): a bf16 model loaded from the GGUF holds bf16(d * q + m) or bf16(d * q), the
// fp32 dequantization rounded once to nearest-even. Each pair's panel is dequantized exactly in fp32, as run_gguf does
// it, rounded by vcvtne2ps2bf16 (nearest-even; it reads a subnormal as zero, and d * q + m of fp16 d and m is zero or
// at least 2^-24, never subnormal) and laid out as pack_small_linear lays out a bf16 weight, so the panel holds the
// bf16 weight's packed bytes and the tile (or vdpbf16ps) kernel's results are bitwise those on the bf16 weight
// (column_pair_codes_bf16 takes the same lines from registers without storing them). Its own code layout
// (pack_small_linear_q4_1 / _q8_0 with bf16) puts each step pair's codes in the panel's lane order, (column j, k),
// (column j, k + 1), ..., so a 16-byte load is 8 columns x 2 k and two of them round into one 64-byte line of the panel
// with no shuffle. A step pair of a pair reads 32 (Q4_1) or 64 (Q8_0) bytes of codes where bf16 reads 128. A 32-k block
// of a pair (the lines of 16 bytes):
//   Q4_1, Q4_1_BF16_LINES: line 2 t + h, t < 16, h < 2: byte 2 j + i holds column 8 h + j's code at k = 2 t + i
//        (low nibble) and column 16 + 8 h + j's (high); lines 32-35 d and 36-39 m of the 32 columns, fp16
//   Q8_0, Q8_0_BF16_LINES: line 4 t + 2 c + h: byte 2 j + i is column 16 c + 8 h + j's int8 code at k = 2 t + i;
//        lines 64-67 d of the 32 columns, fp16
constexpr int64_t Q4_1_BF16_LINES = 40;
constexpr int64_t Q8_0_BF16_LINES = 68;

// Lane l of the result is lane 8 h + l / 2 of v: each of 8 columns' d (or m) twice, for its (k, k + 1) lanes.
inline __m512 column_pairs(__m512 v, int h) {
  const __m512i index = _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                                             4, 3, 2, 1, 0), 1),
                                         _mm512_set1_epi32(8 * h));
  return _mm512_permutexvar_ps(index, v);
}

inline __m512 half_to_float16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Asks for the lines of the block at `ahead` (none when null) into L1, at most two at each of a block's 16 dequantize
// steps (a dequantize's, or column_pair_codes_bf16's) (Q4_1's 10 lines: none at 6 of them): spread out, so the requests
// of a block do not all wait for the core's few L1 miss buffers at once.
template <int64_t BYTES>
inline void ask_spread(const char* ahead, int64_t t) {
  constexpr int64_t LINES = (BYTES + 63) / 64;
  if (ahead == nullptr) return;
  for (int64_t l = t * LINES / 16; l < (t + 1) * LINES / 16; ++l) _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
}

// One 32-k block of a pair: its scales read once, then step(t) gives step pair t's two 64-byte lines of the bf16
// panel (column blocks 0 and 1, each 16 columns x (k, k + 1)), dequantized exactly in fp32 and rounded once.
// dequantize() lays the block's 16 step pairs out as 16 x 64 bf16 of the panel, asking for the lines of the block
// at `ahead` on the way (ask_spread); column_pair_codes_bf16 takes the lines straight from step().
struct Q4_1Bf16 {
  static constexpr int64_t BYTES = Q4_1_BF16_LINES * 16;
  __m512 d[2][2], m[2][2];  // [column block][half]
  const uint8_t* codes;
  explicit Q4_1Bf16(const uint8_t* blk) : codes(blk) {
    for (int c = 0; c < 2; ++c) {
      const __m512 dc = half_to_float16(blk + 512 + 32 * c), mc = half_to_float16(blk + 576 + 32 * c);
      for (int h = 0; h < 2; ++h) {
        d[c][h] = column_pairs(dc, h);
        m[c][h] = column_pairs(mc, h);
      }
    }
  }
  void step(int64_t t, __m512i (&line)[2]) const {
    __m512 w[2][2];
    for (int h = 0; h < 2; ++h) {
      const __m512i q =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (2 * t + h) * 16)));
      w[0][h] = _mm512_fmadd_ps(d[0][h], nibble_to_float(q), m[0][h]);
      w[1][h] = _mm512_fmadd_ps(d[1][h], nibble_to_float(_mm512_srli_epi32(q, 4)), m[1][h]);
    }
    for (int c = 0; c < 2; ++c) line[c] = (__m512i)_mm512_cvtne2ps_pbh(w[c][1], w[c][0]);
  }
  static void dequantize(const uint8_t* blk, uint16_t* dst, const char* ahead = nullptr);
};

struct Q8_0Bf16 {
  static constexpr int64_t BYTES = Q8_0_BF16_LINES * 16;
  __m512 d[2][2];
  const uint8_t* codes;
  explicit Q8_0Bf16(const uint8_t* blk) : codes(blk) {
    for (int c = 0; c < 2; ++c) {
      const __m512 dc = half_to_float16(blk + 1024 + 32 * c);
      for (int h = 0; h < 2; ++h) d[c][h] = column_pairs(dc, h);
    }
  }
  void step(int64_t t, __m512i (&line)[2]) const {
    for (int c = 0; c < 2; ++c) {
      __m512 w[2];
      for (int h = 0; h < 2; ++h) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (4 * t + 2 * c + h) * 16));
        w[h] = _mm512_mul_ps(d[c][h], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
      }
      line[c] = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
    }
  }
  static void dequantize(const uint8_t* blk, uint16_t* dst, const char* ahead = nullptr);
};

template <typename Layout>
inline void dequantize_block_bf16(const uint8_t* blk, uint16_t* dst, const char* ahead) {
  const Layout block(blk);
  for (int64_t t = 0; t < GGUF_K / 2; ++t) {
    ask_spread<Layout::BYTES>(ahead, t);
    __m512i line[2];
    block.step(t, line);
    for (int c = 0; c < 2; ++c) _mm512_store_si512(dst + t * 4 * LANES + c * 2 * LANES, line[c]);
  }
}
inline void Q4_1Bf16::dequantize(const uint8_t* blk, uint16_t* dst, const char* ahead) {
  dequantize_block_bf16<Q4_1Bf16>(blk, dst, ahead);
}
inline void Q8_0Bf16::dequantize(const uint8_t* blk, uint16_t* dst, const char* ahead) {
  dequantize_block_bf16<Q8_0Bf16>(blk, dst, ahead);
}

// A pair's whole panel dequantized into bf16 in pack_small_linear's layout [K/2, 2, 16, 2] (panel: 64-byte
// aligned), the next pair's codes asked for a block's lines at each block (next: none when null).
template <typename Layout>
inline void dequantize_pair_bf16(const uint8_t* w, int64_t blocks, const uint8_t* next, uint16_t* panel) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (next != nullptr)
      for (int64_t l = 0; l < Layout::BYTES / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next) + b * Layout::BYTES + l * 64, _MM_HINT_T1);
    Layout::dequantize(w + b * Layout::BYTES, panel + b * GGUF_K * 2 * LANES);
  }
}

// How far ahead CodesPass (AMX) and column_pair_codes_bf16 (vdpbf16ps) ask for codes: the block CODES_AHEAD_BLOCKS
// after the one they dequantize (past the pair's end, the next pair's blocks, which follow in memory), its lines spread
// over that block's steps (ask_spread). Timed on AMX (on Zen 4, into L2 timed within the drift, round 42). Before, each
// block's 10 (Q4_1) or 17 (Q8_0) lines were asked for at once, 2 blocks ahead: a bf16 decode step's matmuls
// (load_tests/bench_small_linear.py --dtypes gguf_bf16, three turns against that build) at 1 / 8 rows took 8.17-9.27 /
// 7.60-7.78 ms, now 7.74-7.85 / 7.26-7.40; 32-64 rows level. All at once 7 or 15 blocks ahead, or into L2 (prefetcht2),
// timed no better; spread 9 ahead as 5; asking for the next pair's codes during the second pass of 33-64 rows was
// slower (docs/benchmarks.md, "Round 41").
constexpr int64_t CODES_AHEAD_BLOCKS = 5;

#if defined(STREAMKV_AMX)

// amx_pass_steps over a pair's codes: a GGUF block of 32 k is one tile step, so each block is dequantized into a
// 2 KB tile step and loaded from L1: the weights take no trip through a whole panel. Block t + 1 is dequantized
// before block t's tiles load, so the tiles read stores made a step earlier and their products run beside the
// next block's vector work (one row from L2, with nibble_to_float: 174 -> 158 cycles a block). With one pass a
// pair the steps take turns in two buffers; with two (33-64 rows) the first pass lays the whole panel out in this
// thread's scratch (k x 32 bf16: 36 KB at K = 576) and the second runs PanelPass over it from L1 / L2 instead of
// dequantizing again (64 rows from L2: 509 -> 392 cycles a block). The tile sums are PanelPass's on those bytes.
template <typename Layout>
struct CodesPass {
  int64_t blocks;
  template <bool TWO, typename Between>
  void run(const char* a, int64_t a_stride, const char* w, float* c_out, const Between& between, int64_t pass,
           int64_t passes) const {
    constexpr int64_t STEP = AMX_STEP_BYTES / 2;  // bf16 of a tile step
    uint16_t* panel = passes > 1 ? thread_scratch<uint16_t>(blocks * STEP) : nullptr;
    if (pass > 0) {  // the pair's first pass on this thread laid its panel out
      PanelPass{blocks}.run<TWO>(a, a_stride, reinterpret_cast<const char*>(panel), c_out, between);
      return;
    }
    alignas(64) uint16_t ring[2][STEP];
    const auto buffer = [&](int64_t t) { return panel != nullptr ? panel + t * STEP : ring[t & 1]; };
    const auto* codes = reinterpret_cast<const uint8_t*>(w);
    if (blocks > 0)  // K = 0: no block; the outputs are the bias
      Layout::dequantize(codes, buffer(0), w + CODES_AHEAD_BLOCKS * Layout::BYTES);
    amx_pass_steps<TWO>(
        a, a_stride, blocks, c_out,
        [&](int64_t t) {
          if (t + 1 < blocks)
            Layout::dequantize(codes + (t + 1) * Layout::BYTES, buffer(t + 1),
                               w + (t + 1 + CODES_AHEAD_BLOCKS) * Layout::BYTES);
          return reinterpret_cast<const char*>(buffer(t));
        },
        between);
  }
};
#endif

// The most rows run_gguf_bf16 and run_silu_mul run through CodesPass on AMX: two passes of 32 rows, the first
// dequantizing the codes a tile step at a time, the second reading the panel the first laid out. Round 31 measured
// the old form (the second pass dequantizing again) against panels dequantized before the passes: a decode step's
// matmuls (load_tests/bench_small_linear.py --dtypes gguf_bf16, three alternations, as a share of oneDNN's time in
// the same run) 48 rows 0.70-0.76 -> 0.68-0.70, 64 rows 0.73-0.78 -> 0.69-0.77; at 96 and 128 rows the dequantized
// panels stay faster (24.5 / 28.3 against 26.3 / 35.4 ms; docs/benchmarks.md, "Round 31").
constexpr int64_t AMX_CODES_MAX_ROWS = 64;

#if defined(STREAMKV_AMX)
// amx_walk_panels' panels(p0, p1) on GGUF codes in Layout's order (packed [pairs, blocks, ...] as run_gguf_bf16
// takes them): pairs p0 .. p1 - 1 dequantized into this thread's scratch end to end (k x 32 bf16 a pair, the
// layout of pack_small_linear's bf16 panels), each pair once a call.
template <typename Layout>
auto dequantized_panels(const uint8_t* wp, int64_t pairs, int64_t blocks, int64_t k) {
  const int64_t pair_bytes = blocks * Layout::BYTES, panel_elems = k * 2 * LANES;
  return [=](int64_t p0, int64_t p1) {
    uint16_t* panel = thread_scratch<uint16_t>((p1 - p0) * panel_elems);
    for (int64_t pair = p0; pair < p1; ++pair) {
      const uint8_t* w = wp + pair * pair_bytes;
      dequantize_pair_bf16<Layout>(w, blocks, pair + 1 < pairs ? w + pair_bytes : nullptr,
                                   panel + (pair - p0) * panel_elems);
    }
    return reinterpret_cast<const char*>(panel);
  };
}

// run_amx_passes over GGUF codes in Layout's order (packed [pairs, blocks, ...]), each pass handed to store: up to
// AMX_CODES_MAX_ROWS rows (decode batches) CodesPass on the codes themselves; more rows, over panels dequantized
// into a thread-local buffer, one pair at a time up to AMX_PANEL_MAJOR_ROWS rows and a chunk of pairs
// (AMX_CHUNK_BYTES of bf16) past them, each panel dequantized once a call.
template <typename Layout, typename Store>
void codes_passes(const at::Tensor& x, const at::Tensor& packed, const Store& store) {
  const int64_t k = x.size(1), k_tiles = k / AMX_K, pairs = packed.size(0), blocks = packed.size(1);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (x.size(0) <= AMX_CODES_MAX_ROWS) {
    const int64_t pair_bytes = blocks * Layout::BYTES;
    const char* codes = reinterpret_cast<const char*>(wp);
    run_amx_passes(x, pairs, k_tiles, pair_bytes, [&](int64_t p0, int64_t) { return codes + p0 * pair_bytes; },
                   CodesPass<Layout>{blocks}, store);
    return;
  }
  run_amx_passes(x, pairs, k_tiles, k * 2 * LANES * 2, dequantized_panels<Layout>(wp, pairs, blocks, k),
                 PanelPass{k_tiles}, store);
}
#endif

// column_pair for bf16 x on GGUF codes (no AMX), rows [m0, m0 + R) in one pass: each step pair's two lines
// dequantized in registers (Layout::step) and used at once, where the panel path stores them and loads them back.
// The same vdpbf16ps chain on the same bf16 lines, k ascending, so the same bits as column_pair on the panel.
template <typename Layout, int R>
inline void column_pair_codes_bf16(const at::BFloat16* x, int64_t x_stride, at::BFloat16* y, int64_t y_stride,
                                   const uint8_t* w, const float* bias, int64_t m0, int64_t n, int64_t blocks,
                                   uint16_t* panel = nullptr) {
  __m512 acc[2][R];
  for (int c = 0; c < 2; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  const at::BFloat16* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * x_stride;
  for (int64_t b = 0; b < blocks; ++b) {
    const Layout block(w + b * Layout::BYTES);
    const char* ahead = reinterpret_cast<const char*>(w) + (b + CODES_AHEAD_BLOCKS) * Layout::BYTES;
    for (int64_t t = 0; t < GGUF_K / 2; ++t) {
      ask_spread<Layout::BYTES>(ahead, t);
      __m512i line[2];
      block.step(t, line);
      const int64_t s = b * (GGUF_K / 2) + t;
      if (panel != nullptr)
        for (int c = 0; c < 2; ++c) _mm512_store_si512(panel + s * 4 * LANES + c * 2 * LANES, line[c]);
      for (int r = 0; r < R; ++r) {
        int32_t x_pair;
        std::memcpy(&x_pair, xr[r] + 2 * s, sizeof(x_pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(x_pair);
        for (int c = 0; c < 2; ++c) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], xv, (__m512bh)line[c]);
      }
    }
  }
  store_pair<at::BFloat16, R>(acc, y, y_stride, bias, m0, 0, n);  // y, bias and n start at the pair's first column
}

template <typename Layout, int R = FLOAT_ROWS>
inline void column_pair_codes_bf16_rows(int64_t rows, const at::BFloat16* x, int64_t x_stride, at::BFloat16* y,
                                        int64_t y_stride, const uint8_t* w, const float* bias, int64_t n,
                                        int64_t blocks, uint16_t* panel = nullptr) {
  if constexpr (R > 1) {
    if (rows < R)
      return column_pair_codes_bf16_rows<Layout, R - 1>(rows, x, x_stride, y, y_stride, w, bias, n, blocks, panel);
  }
  column_pair_codes_bf16<Layout, R>(x, x_stride, y, y_stride, w, bias, 0, n, blocks, panel);
}

// y = x W^T (+ b) for bf16 x and out, W as GGUF codes in Layout's order, packed [N/32, K/32, Layout::BYTES / 16,
// 16]. On AMX, codes_passes; without AMX, up to FLOAT_ROWS rows one pass of column_pair_codes_bf16 (the codes
// dequantized in registers), past them that pass first, storing the dequantized lines into the pair's panel
// for run()'s later passes of vdpbf16ps (see run_gguf's note). Either way a
// row's result is the dense bf16 kernel's on the dequantized bf16 weight, bitwise, whatever its batch.
template <typename Layout>
void run_gguf_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(1), pairs = packed.size(0);
  if (m == 0) return;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t pair_bytes = blocks * Layout::BYTES;
  const int64_t panel_elems = k * 2 * LANES;  // bf16 of a pair's panel
#if defined(STREAMKV_AMX)
  if (amx_takes(k) && amx_on()) {
    codes_passes<Layout>(x, packed, out_store(out, bias, n));
    return;
  }
#endif
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
  if (m > SMALL_BATCH_MAX_ROWS) {
    run_panel_chunks<at::BFloat16>(
        m, xp, x.stride(0), yp, out.stride(0), bias, n, pairs, k / 2,
        dequantized_chunk<at::BFloat16>(wp, pair_bytes, panel_elems,
                                        [blocks](const uint8_t* w, const uint8_t* next, at::BFloat16* panel) {
                                          dequantize_pair_bf16<Layout>(w, blocks, next,
                                                                       reinterpret_cast<uint16_t*>(panel));
                                        }));
    return;
  }
  const int64_t passes = (m + FLOAT_ROWS - 1) / FLOAT_ROWS;
  const int64_t rows_per_pass = (m + passes - 1) / passes;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    uint16_t* panel = passes > 1 ? thread_scratch<uint16_t>(panel_elems) : nullptr;
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint8_t* w = wp + pair * pair_bytes;
      const int64_t col = pair * 2 * LANES;
      if (passes == 1) {
        column_pair_codes_bf16_rows<Layout>(m, xp, x.stride(0), yp + col, out.stride(0), w, bias ? bias + col : nullptr,
                                            n - col, blocks);
        continue;
      }
      // The first pass dequantizes in registers and lays the panel out for the others (see run_gguf's note).
      column_pair_codes_bf16_rows<Layout>(rows_per_pass, xp, x.stride(0), yp + col, out.stride(0), w,
                                          bias ? bias + col : nullptr, n - col, blocks, panel);
      for (int64_t m0 = rows_per_pass; m0 < m; m0 += rows_per_pass)
        column_pair_rows<at::BFloat16>(std::min(rows_per_pass, m - m0), xp, x.stride(0), yp + col, out.stride(0),
                                       reinterpret_cast<const at::BFloat16*>(panel), bias ? bias + col : nullptr,
                                       m0, 0, n - col, k / 2, nullptr, 0);
    }
  });
}

// small_linear_silu_mul on vdpbf16ps (a CPU with AVX512-BF16, no AMX or AMX switched off): the chunk walk of
// run_gguf_bf16 (codes) or run() (dense bf16) past 128 rows, each pass into a [rows, 32] tile on the stack, which
// silu_mul_tile then turns into the pass's 16 columns of act; the [M, 2I] gate_up never goes to memory. The tile holds g and u as
// store_pair rounds them (the bias added in fp32, then bf16), so act is bitwise silu_and_mul(small_linear(x)), as on
// AMX (run_silu_mul).
inline void silu_mul_tile(const at::BFloat16* tile, int64_t rows, const float* table, at::BFloat16* act,
                          int64_t act_stride, int64_t r0, int64_t pair) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256i g = _mm256_load_si256(reinterpret_cast<const __m256i*>(tile + r * 2 * LANES));
    const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(tile + r * 2 * LANES + LANES));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + (r0 + r) * act_stride + pair * LANES),
                        bf16_round16(streamkv::silu_mul16(g, u, table)));
  }
}

// Layout: Q4_1Bf16 or Q8_0Bf16 for GGUF codes, void for a dense bf16 pack.
template <typename Layout>
void run_silu_mul_vnni(at::Tensor& act, const at::Tensor& x, const at::Tensor& packed, const float* bias) {
  constexpr bool codes = !std::is_void_v<Layout>;
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(0), x_stride = x.stride(0);
  if (m == 0) return;
  const float* table = streamkv::bf16_silu_table();  // built here, before the parallel region
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* ap = act.data_ptr<at::BFloat16>();
  const int64_t a_stride = act.stride(0);
  const int64_t panel_elems = k * 2 * LANES;  // bf16 of a pair's panel
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  int64_t blocks = 0, pair_bytes = panel_elems * 2;
  if constexpr (codes) blocks = packed.size(1), pair_bytes = blocks * Layout::BYTES;
  // One pass of rows [m0, m0 + rows) against a pair's panel (bf16, run()'s layout), through the tile into act.
  const auto panel_pass = [&](int64_t rows, int64_t m0, int64_t pair, const at::BFloat16* panel) {
    alignas(64) at::BFloat16 tile[FLOAT_ROWS * 2 * LANES];
    column_pair_rows<at::BFloat16>(rows, xp + m0 * x_stride, x_stride, tile, 2 * LANES, panel,
                                   bias ? bias + pair * 2 * LANES : nullptr, 0, 0, 2 * LANES, k / 2, nullptr, 0);
    silu_mul_tile(tile, rows, table, ap, a_stride, m0, pair);
  };
  // Every row count takes the chunk walk: the MLP sends this path prefill-sized steps alone
  // (small_linear_silu_mul_takes), and a row's bits do not depend on the walk.
  if constexpr (codes) {
    walk_panel_chunks<at::BFloat16>(
        m, pairs, k / 2,
        dequantized_chunk<at::BFloat16>(wp, pair_bytes, panel_elems,
                                        [blocks](const uint8_t* w, const uint8_t* next, at::BFloat16* panel) {
                                          dequantize_pair_bf16<Layout>(w, blocks, next,
                                                                       reinterpret_cast<uint16_t*>(panel));
                                        }),
        panel_pass);
  } else {
    const at::BFloat16* dense = packed.data_ptr<at::BFloat16>();
    walk_panel_chunks<at::BFloat16>(
        m, pairs, k / 2, [=](int64_t p0, int64_t, int64_t) { return dense + p0 * panel_elems; }, panel_pass);
  }
}
#endif

#if defined(STREAMKV_AMX)
// SwiGLU's gate_up with SiLU-and-mul in its epilogue, for bf16 batches of any size (small_linear_silu_mul). W is
// gate_up [2I, K] with its rows interleaved 16 at a time (pair q: gate rows 16 q .. 16 q + 15, then the same rows
// of up), so a pass's 32 columns are 16 gate columns and their 16 up columns, and act [M, I] comes straight out of
// the pass: the [M, 2I] gate_up (25 MB at 4,096 rows of SmolLM2) no longer goes to memory for silu_and_mul to read
// back. g and u are rounded to bf16 with the bias as store_pass rounds them, and act = bf16(silu(g) * u) is
// silu_and_mul_bf16's product (fused_layers.cpp: both round silu_table.h's silu_mul16), so act is bitwise
// silu_and_mul(small_linear(x)) on the same weight, whatever the batch.
inline void store_silu_mul_pass(const float* c, int64_t r_begin, int64_t r_end, int64_t pair, const float* bias,
                                const float* table, at::BFloat16* act, int64_t act_stride, int64_t r0) {
  const __m512 bg = bias ? _mm512_loadu_ps(bias + 2 * pair * LANES) : _mm512_setzero_ps();
  const __m512 bu = bias ? _mm512_loadu_ps(bias + (2 * pair + 1) * LANES) : _mm512_setzero_ps();
  for (int64_t r = r_begin; r < r_end; ++r) {
    const __m256i g = bf16_round16(_mm512_add_ps(_mm512_load_ps(c + r * 32), bg));
    const __m256i u = bf16_round16(_mm512_add_ps(_mm512_load_ps(c + r * 32 + LANES), bu));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + (r0 + r) * act_stride + pair * LANES),
                        bf16_round16(streamkv::silu_mul16(g, u, table)));
  }
}

// act [M, I] from x [M, K] on the interleaved gate_up, packed dense (pack_small_linear, bf16) or as bf16 GGUF codes:
// the walk of run_amx or run_gguf_bf16 (dense_passes, codes_passes), each pass stored by store_silu_mul_pass.
void run_silu_mul(at::Tensor& act, const at::Tensor& x, const at::Tensor& packed, const float* bias) {
  const float* table = streamkv::bf16_silu_table();  // built here, before the parallel region
  at::BFloat16* ap = act.data_ptr<at::BFloat16>();
  const int64_t a_stride = act.stride(0);
  const auto store = [&](const float* c, int64_t r_begin, int64_t r_end, int64_t pair, int64_t r0) {
    store_silu_mul_pass(c, r_begin, r_end, pair, bias, table, ap, a_stride, r0);
  };
  if (packed.scalar_type() == at::kBFloat16)
    dense_passes(x, packed, store);
  else if (packed.size(2) == Q4_1_BF16_LINES)
    codes_passes<Q4_1Bf16>(x, packed, store);
  else
    codes_passes<Q8_0Bf16>(x, packed, store);
}
#endif

#if defined(STREAMKV_AMX)
// fp32 x on GGUF codes on AMX tiles, for prefill-sized batches (GGUF_F32_AMX_MIN_ROWS rows and more; fewer run
// run_gguf's FMA chain). tdpbf16ps multiplies bf16 exactly and sums in fp32, so fp32 arithmetic is built from
// exact pieces:
//   x = x1 + x2 + x3, three bf16: x1 = bf16(x) to nearest, x2 = bf16(x - x1), x3 = x - x1 - x2, 8 + 8 + 8 of
//       fp32's 24 significant bits, exactly (vcvtneps2bf16 reads a subnormal as zero: a piece below 2^-126 is lost)
//   a code is exact in bf16: Q8_0's q (-128..127), and Q4_1's q - 8 (-8..7; its weight d q + m is
//       d (q - 8) + m' with m' = 8 d + m, near zero where a block's weights straddle zero)
// so every product is exact, and a 32-k block's tiles sum S = sum_k x_k q_k in fp32 (Intel SDM: round to
// nearest even; x1's tile step, then x2's, then x3's). y += d S + m' sum_k x_k in fp32 (no m' for Q8_0), block
// after block, then the bias: the fp32 dot product of x with the exact weights, summed in another order than
// run_gguf's FMA chain on fl(d q + m), so its last bits differ from the decode rows', as oneDNN's fp32 matmul's
// did when it took these rows. Where d S and m' sum x nearly cancel (one huge x against a weight near zero) the
// two roundings count relative to the larger terms. A pass of 32 rows with a value past F32_AMX_MAX_ABS, an inf
// or a NaN runs run_gguf's FMA chain instead (bitwise its results): x1 would round up to inf near FLT_MAX, x - x1
// is NaN for an inf, and S (up to 32 x 128 |x|) would overflow long before x w does.
//   tiles 0-3: C, [16 rows, 16 columns] of (row block 0 / 1) x (column block 0 / 1), one block's S
//   tiles 4, 5: A, 16 rows x 32 bf16 of one piece of one block, row blocks 0 and 1
//   tiles 6, 7: B, the block's codes as bf16 (k, k + 1) pairs x 16 columns, column blocks 0 and 1
constexpr int64_t GGUF_F32_AMX_MIN_ROWS = 129;  // = GGUF_F32_AMX_MIN_ROWS in streamkv/model/linear.py
constexpr int64_t F32_PIECES = 3;
constexpr float F32_AMX_MAX_ABS = 0x1p100f;  // |S| <= 4,096 x 2^100, far below FLT_MAX

// A pair's prepared block: its codes as two B tiles (2 KB), then d and m' (zeros for Q8_0) as fp32 (256 bytes).
constexpr int64_t F32_BLOCK_TILE_BYTES = 2048;
constexpr int64_t F32_BLOCK_BYTES = F32_BLOCK_TILE_BYTES + 2 * 2 * LANES * 4;

// bf16 of -8..7 in lanes 0..15 (vpermw's table: Q4_1 code q -> q - 8).
inline __m512i bf16_of_centred_codes() {
  alignas(64) uint16_t t[32] = {};
  for (int i = 0; i < 16; ++i) {
    const float f = static_cast<float>(i - 8);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    t[i] = static_cast<uint16_t>(u >> 16);  // exact: at most 4 significant bits
  }
  return _mm512_load_si512(t);
}

// The 32 bytes of k steps 2t and 2t + 1 of 16 columns, interleaved: byte 2 j is column j's code at 2t, byte
// 2 j + 1 its code at 2t + 1.
inline __m256i pair_bytes(const uint8_t* step0, const uint8_t* step1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(step0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(step1));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)), _mm_unpackhi_epi8(a, b), 1);
}

// A Q4_1 block of run_gguf's layout (Q4_1Block) -> its B tiles of q - 8 and fp32 d, m' = 8 d + m (one rounding)
// (F32_BLOCK_BYTES at dst).
struct Q4_1F32Tiles {
  static constexpr bool HAS_MIN = true;
  static void prepare(const uint8_t* blk, char* dst, __m512i table) {
    auto* tiles = reinterpret_cast<uint16_t*>(dst);
    for (int64_t t = 0; t < GGUF_K / 2; ++t) {
      const __m512i q = _mm512_cvtepu8_epi16(pair_bytes(blk + 2 * t * 16, blk + (2 * t + 1) * 16));
      const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi16(0xF)), hi = _mm512_srli_epi16(q, 4);
      _mm512_store_si512(tiles + t * 32, _mm512_permutexvar_epi16(lo, table));
      _mm512_store_si512(tiles + 512 + t * 32, _mm512_permutexvar_epi16(hi, table));
    }
    auto* scales = reinterpret_cast<float*>(dst + F32_BLOCK_TILE_BYTES);
    for (int c = 0; c < 2; ++c) {
      const __m512 d = half_to_float16(blk + 512 + 32 * c);
      _mm512_store_ps(scales + c * LANES, d);
      _mm512_store_ps(scales + 2 * LANES + c * LANES,
                      _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d, half_to_float16(blk + 576 + 32 * c)));
    }
  }
};

// The same for a Q8_0 block (Q8_0Block's layout); no m.
struct Q8_0F32Tiles {
  static constexpr bool HAS_MIN = false;
  static void prepare(const uint8_t* blk, char* dst, __m512i) {
    auto* tiles = reinterpret_cast<uint16_t*>(dst);
    for (int64_t t = 0; t < GGUF_K / 2; ++t)
      for (int c = 0; c < 2; ++c) {
        const __m256i q = pair_bytes(blk + 2 * t * 32 + c * 16, blk + (2 * t + 1) * 32 + c * 16);
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
        _mm512_store_si512(tiles + c * 512 + t * 32, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));  // exact: |q| <= 128
      }
    auto* scales = reinterpret_cast<float*>(dst + F32_BLOCK_TILE_BYTES);
    for (int c = 0; c < 2; ++c) {
      _mm512_store_ps(scales + c * LANES, half_to_float16(blk + 1024 + 32 * c));
      _mm512_store_ps(scales + 2 * LANES + c * LANES, _mm512_setzero_ps());
    }
  }
};

// rows rows of x (x_stride floats apart) -> xs [rows][K/32][3][32] bf16, the three pieces of each block side by
// side (x = x1 + x2 + x3, run_gguf_amx_f32), and xsum [rows][K/32], each block's sum of x in fp32 (16 lanes plus
// 16, then vreduce's order). Returns false when a value is past F32_AMX_MAX_ABS in magnitude, inf or NaN.
inline bool split_rows(const float* x, int64_t x_stride, int64_t rows, int64_t blocks, uint16_t* xs, float* xsum) {
  const __m512 limit = _mm512_set1_ps(F32_AMX_MAX_ABS);
  __mmask16 out_of_range = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    uint16_t* dst = xs + r * blocks * F32_PIECES * GGUF_K;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 v[2] = {_mm512_loadu_ps(xr + b * GGUF_K), _mm512_loadu_ps(xr + b * GGUF_K + LANES)};
      for (const __m512& h : v)  // not (|x| <= limit): past it, or NaN
        out_of_range |= _mm512_cmp_ps_mask(_mm512_abs_ps(h), limit, _CMP_NLE_UQ);
      xsum[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      for (int64_t i = 0; i < F32_PIECES; ++i) {
        const __m512bh p = _mm512_cvtne2ps_pbh(v[1], v[0]);
        _mm512_storeu_si512(dst + (b * F32_PIECES + i) * GGUF_K, (__m512i)p);
        const __m512i w = (__m512i)p;
        v[0] = _mm512_sub_ps(v[0], bf16_widen16(_mm512_castsi512_si256(w)));
        v[1] = _mm512_sub_ps(v[1], bf16_widen16(_mm512_extracti64x4_epi64(w, 1)));
      }
    }
  }
  return out_of_range == 0;
}

// One pass of 32 rows (a 32-row block of xs at a, a_stride bytes a row) over a pair's prepared blocks w: its
// 32 x 32 results, before the bias, into acc [32][32].
template <typename Tiles>
inline void f32_pass(const char* a, int64_t a_stride, const float* xsum, int64_t blocks, const char* w, float* acc) {
  alignas(64) float c[2 * AMX_ROWS * 32];
  for (int64_t i = 0; i < 2 * AMX_ROWS * 2; ++i) _mm512_store_ps(acc + i * LANES, _mm512_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    const char* blk = w + b * F32_BLOCK_BYTES;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(6, blk, 64);
    _tile_loadd(7, blk + 1024, 64);
    for (int64_t i = 0; i < F32_PIECES; ++i) {
      const char* ap = a + (b * F32_PIECES + i) * GGUF_K * 2;
      _tile_loadd(4, ap, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, ap + AMX_ROWS * a_stride, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + LANES, 128);
    _tile_stored(2, c + AMX_ROWS * 32, 128);
    _tile_stored(3, c + AMX_ROWS * 32 + LANES, 128);
    const float* scales = reinterpret_cast<const float*>(blk + F32_BLOCK_TILE_BYTES);
    const __m512 d[2] = {_mm512_load_ps(scales), _mm512_load_ps(scales + LANES)};
    const __m512 mn[2] = {_mm512_load_ps(scales + 2 * LANES), _mm512_load_ps(scales + 3 * LANES)};
    for (int64_t r = 0; r < 2 * AMX_ROWS; ++r) {
      const __m512 xs = _mm512_set1_ps(xsum[r * blocks + b]);
      for (int h = 0; h < 2; ++h) {
        float* at = acc + r * 32 + h * LANES;
        __m512 y = _mm512_fmadd_ps(d[h], _mm512_load_ps(c + r * 32 + h * LANES), _mm512_load_ps(at));
        if constexpr (Tiles::HAS_MIN) y = _mm512_fmadd_ps(mn[h], xs, y);
        _mm512_store_ps(at, y);
      }
    }
  }
}

// y = x W^T (+ b) for fp32 x [M, K] (M >= GGUF_F32_AMX_MIN_ROWS) on W's GGUF codes in run_gguf's layout. Each
// thread takes a contiguous range of pairs and, AMX_CHUNK_BYTES of prepared blocks at a time, runs every 32-row
// pass over each pair of the chunk (as amx_walk_panels does past AMX_PANEL_MAJOR_ROWS rows). A pass's rows are
// split into their pieces in a thread-local buffer (72 KB of x makes 108 KB of pieces at K = 576) just before
// the chunk's pairs read them from L2: split once for the whole x, the pieces (1.5x x's bytes) went to memory
// and back, and a K = 1,536 matmul of 4,096 rows ran slower than oneDNN's. K = 0 takes run_gguf.
template <typename Block, typename Tiles>
void run_gguf_amx_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  const int64_t m = x.size(0), blocks = packed.size(1), pairs = packed.size(0);
  const int64_t a_stride = blocks * F32_PIECES * GGUF_K * 2, pass_rows = 2 * AMX_ROWS;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = out.stride(0), pair_prep = blocks * F32_BLOCK_BYTES;
  const int64_t chunk = std::max<int64_t>(1, AMX_CHUNK_BYTES / pair_prep);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    load_tile_config(AMX_ROWS);
    const int64_t prepared_bytes = std::min(chunk, end - begin) * pair_prep;
    char* prepared = thread_scratch<char>(prepared_bytes + pass_rows * (a_stride + blocks * 4));
    auto* pieces = reinterpret_cast<uint16_t*>(prepared + prepared_bytes);
    auto* xsum = reinterpret_cast<float*>(prepared + prepared_bytes + pass_rows * a_stride);
    const __m512i table = bf16_of_centred_codes();
    alignas(64) float acc[2 * AMX_ROWS * 32];
    for (int64_t p0 = begin; p0 < end; p0 += chunk) {
      const int64_t p1 = std::min(end, p0 + chunk);
      for (int64_t pair = p0; pair < p1; ++pair)
        for (int64_t b = 0; b < blocks; ++b)
          Tiles::prepare(wp + (pair * blocks + b) * Block::BYTES,
                         prepared + (pair - p0) * pair_prep + b * F32_BLOCK_BYTES, table);
      for (int64_t r0 = 0; r0 < m; r0 += pass_rows) {
        const int64_t rows = std::min(pass_rows, m - r0);
        if (!split_rows(xp + r0 * x_stride, x_stride, rows, blocks, pieces, xsum)) {
          for (int64_t pair = p0; pair < p1; ++pair) {
            const int64_t col = pair * 2 * LANES;
            for (int64_t m0 = r0; m0 < r0 + rows; m0 += FLOAT_ROWS)
              column_pair_gguf_rows<Block>(std::min<int64_t>(FLOAT_ROWS, r0 + rows - m0), xp, x_stride, yp + col,
                                           y_stride, wp + pair * blocks * Block::BYTES,
                                           bias ? bias + col : nullptr, m0, n - col, blocks);
          }
          continue;
        }
        if (rows < pass_rows) {  // the missing rows are zeros
          std::memset(reinterpret_cast<char*>(pieces) + rows * a_stride, 0, (pass_rows - rows) * a_stride);
          std::memset(xsum + rows * blocks, 0, (pass_rows - rows) * blocks * sizeof(float));
        }
        for (int64_t pair = p0; pair < p1; ++pair) {
          f32_pass<Tiles>(reinterpret_cast<const char*>(pieces), a_stride, xsum, blocks,
                          prepared + (pair - p0) * pair_prep, acc);
          store_pass(acc, 0, rows, pair, n, bias, yp, y_stride, r0);
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(STREAMKV_AVX2_LINEAR)
// column_pair's contract on AVX2 for fp32: rows [m0, m0 + R) of x against the columns of pair `pair` a tile
// covers, over the steps [s0, s1) of k. A call past the first block of k picks its sums up from y, where the
// block before left them, and the last block adds the bias: every output is still one fp32 FMA chain over k
// ascending (a sum parked in y and reloaded keeps its bits), as on AVX-512, so a row's result never depends
// on its batch, its pass or its tile.
//
// Every loop over a tile's accumulators is unrolled (#pragma GCC unroll) so they live in registers: in round
// 9's kernel an epilogue loop that left early indexed them at run time, GCC kept the array on the stack and
// stored all 12 every step of k, which held the kernel to half of oneDNN's rate at 32 rows.
constexpr int AVX2_ROWS = 3;        // rows of a pass of 3 x 32 tiles (up to AVX2_WIDE_MAX_ROWS rows)
constexpr int AVX2_TILE_ROWS = 6;   // rows of a pass of 6 x 16 tiles (more rows)
constexpr int64_t AVX2_WIDE_MAX_ROWS = 8;
// Most steps of k per block once a pair is walked by more than one pass of rows; k is split into even blocks
// under that bound. Up to AVX2_SMALL_K_ROWS rows, AVX2_K_BLOCK: the pair's 32 columns x 128 steps are 16 KB,
// so every pass after the first reads them from L1 while the first streams them from memory (192 steps
// measured no better; K = 576: four blocks of 116, one of 112). Past those rows each weight line serves enough FMAs
// that L2 feeds it, and the blocks' cost dominates instead (each call parks and reloads its 12 sums and
// restarts its loop): AVX2_WIDE_K_BLOCK (one block at K = 576, three of 512 at 1,536), 8-10% faster from 256
// to 4,096 rows than blocks of 128 (docs/benchmarks.md, "Round 11").
constexpr int64_t AVX2_K_BLOCK = 128;
constexpr int64_t AVX2_SMALL_K_ROWS = 32;
constexpr int64_t AVX2_WIDE_K_BLOCK = 576;
// Most rows of x per walk over the weights (run_avx2): a decode batch of up to 128 rows streams W once.
constexpr int64_t AVX2_ROW_BLOCK = 128;

template <int R, int NV>
inline void column_pair_avx2(const float* x, int64_t x_stride, float* y, int64_t y_stride, const float* packed,
                             const float* bias, int64_t m0, int64_t pair, int64_t half, int64_t n, int64_t k,
                             int64_t s0, int64_t s1, bool fetch, const char* ahead, int64_t ahead_lines) {
  static_assert(NV * R <= 12 && (NV == 2 || NV == 4), "the tile must fit the 16 ymm registers");
  const int64_t col0 = pair * 2 * LANES + half * 8 * NV;
  __m256 acc[NV][R];
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c) {
    const int64_t col = col0 + 8 * c;
    const int64_t live = std::min<int64_t>(8, n - col);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      if (s0 == 0 || live <= 0) {
        acc[c][r] = _mm256_setzero_ps();
      } else if (live == 8) {
        acc[c][r] = _mm256_loadu_ps(y + (m0 + r) * y_stride + col);
      } else {
        alignas(32) float t[8] = {};
        std::memcpy(t, y + (m0 + r) * y_stride + col, live * sizeof(float));
        acc[c][r] = _mm256_load_ps(t);
      }
    }
  }
  const float* w = packed + pair * k * 2 * LANES + half * 8 * NV;
  const float* xr[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * x_stride;
  const auto step = [&](int64_t s) __attribute__((always_inline)) {
    const float* ps = w + s * 2 * LANES;
    __m256 wv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) wv[c] = _mm256_loadu_ps(ps + 8 * c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xr[r] + s);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[c][r] = _mm256_fmadd_ps(xv, wv[c], acc[c][r]);
    }
  };
  // The block's first pass asks for its lines 32 steps ahead (they come from L2 or memory); the first calls
  // also ask for lines of the next pair's panel. The other passes find the block in L1.
  const auto fetch_ahead = [&](int64_t s) __attribute__((always_inline)) {
    const char* ps = reinterpret_cast<const char*>(w + s * 2 * LANES);
    _mm_prefetch(ps + 4096, _MM_HINT_T0);
    if constexpr (NV == 4) _mm_prefetch(ps + 4096 + 64, _MM_HINT_T0);
  };
  int64_t s = s0;
  for (const int64_t next_end = s0 + std::min(ahead_lines, s1 - s0); s < next_end; ++s) {
    _mm_prefetch(ahead + (s - s0) * 64, _MM_HINT_T1);
    if (fetch) fetch_ahead(s);
    step(s);
  }
  if (fetch) {
    for (; s < s1; ++s) {
      fetch_ahead(s);
      step(s);
    }
  } else {
#pragma GCC unroll 4
    for (; s < s1; ++s) step(s);
  }
  const bool last = s1 == k;
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c) {
    const int64_t col = col0 + 8 * c;
    const int64_t live = std::min<int64_t>(8, n - col);
    if (live <= 0) continue;  // the zero columns padding N to a multiple of 32
    alignas(32) float b[8] = {};
    if (bias && last) std::memcpy(b, bias + col, live * sizeof(float));
    const __m256 bv = _mm256_load_ps(b);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 v = last ? _mm256_add_ps(acc[c][r], bv) : acc[c][r];
      float* dst = y + (m0 + r) * y_stride + col;
      if (live == 8) {
        _mm256_storeu_ps(dst, v);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, v);
        std::memcpy(dst, t, live * sizeof(float));
      }
    }
  }
}

// column_pair_avx2 for `rows` (1 .. R) rows: the instantiation with exactly that many.
template <int NV, int R = 12 / NV>
inline void column_pair_avx2_rows(int64_t rows, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                                  const float* packed, const float* bias, int64_t m0, int64_t pair, int64_t half,
                                  int64_t n, int64_t k, int64_t s0, int64_t s1, bool fetch, const char* ahead,
                                  int64_t ahead_lines) {
  if constexpr (R > 1) {
    if (rows < R)
      return column_pair_avx2_rows<NV, R - 1>(rows, x, x_stride, y, y_stride, packed, bias, m0, pair, half, n, k,
                                              s0, s1, fetch, ahead, ahead_lines);
  }
  column_pair_avx2<R, NV>(x, x_stride, y, y_stride, packed, bias, m0, pair, half, n, k, s0, s1, fetch, ahead,
                          ahead_lines);
}

// run()'s walk on AVX2. A thread takes its pairs front to back. Up to 3 rows: one pass of 3 x 32 tiles over the
// whole of k, each pair's panel streamed once. 4-8 rows: passes of up to 3 rows (3 x 32 tiles); more rows:
// passes of up to 6 (each 16-column half of the pair under a 6 x 16 tile); with more than one pass, block by
// block of k (even blocks of at most AVX2_K_BLOCK steps, L1-resident, up to AVX2_SMALL_K_ROWS rows; of at most
// AVX2_WIDE_K_BLOCK past them), every pass over the block. The
// first pass over a block asks for its lines ahead and the calls share out the prefetch of the next pair's
// panel into L2; a single pass (1-3 rows) asks for nothing: the hardware prefetcher follows its one sequential
// stream, and asking made 1 row 13% slower on the Zen 3 EPYC of round 10 (bench_small_linear, 17.9 vs 20.3 ms).
void run_avx2_rows(const float* xp, int64_t x_stride, float* yp, int64_t y_stride, const at::Tensor& packed,
                   const float* bias, int64_t n, int64_t m) {
  const int64_t pairs = packed.size(0), k = packed.size(1);
  const float* wp = packed.data_ptr<float>();
  const bool wide = m <= AVX2_WIDE_MAX_ROWS;  // 3 x 32 tiles; 6 x 16 past
  const int64_t passes = (m + (wide ? AVX2_ROWS : AVX2_TILE_ROWS) - 1) / (wide ? AVX2_ROWS : AVX2_TILE_ROWS);
  // Passes as even as they go (32 rows: 6 6 5 5 5 5, not 6 6 6 6 6 2: a 2-row tile keeps 4 FMA chains, too few
  // to cover the FMA latency).
  const int64_t base_rows = m / passes, extra_rows = m % passes;
  const int64_t k_max = m <= AVX2_SMALL_K_ROWS ? AVX2_K_BLOCK : AVX2_WIDE_K_BLOCK;
  const int64_t even_blocks = std::max<int64_t>(1, (k + k_max - 1) / k_max);
  const int64_t k_block = passes == 1 ? std::max<int64_t>(k, 1) : (k + even_blocks - 1) / even_blocks;
  const int64_t blocks = std::max<int64_t>(1, (k + k_block - 1) / k_block);  // one (bias only) when K = 0
  const int64_t halves = wide ? 1 : 2;
  const int64_t panel_lines = 2 * k;
  const int64_t calls = passes * blocks * halves;
  const int64_t share = calls > 1 ? (panel_lines + calls - 1) / calls : 0;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const char* next = reinterpret_cast<const char*>(wp + (pair + 1) * k * 2 * LANES);  // at most one past the end
      int64_t call = 0;
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t s0 = block * k_block, s1 = std::min(k, s0 + k_block);
        for (int64_t pass = 0, m0 = 0; pass < passes; m0 += base_rows + (pass < extra_rows), ++pass) {
          const int64_t rows = base_rows + (pass < extra_rows);
          for (int64_t half = 0; half < halves; ++half, ++call) {
            const int64_t first = std::min(call * share, panel_lines);
            const int64_t lines = pair + 1 < end ? std::min(std::min(share, panel_lines - first), s1 - s0) : 0;
            const char* ahead = lines > 0 ? next + first * 64 : nullptr;
            if (wide)
              column_pair_avx2_rows<4>(rows, xp, x_stride, yp, y_stride, wp, bias, m0, pair, 0, n, k, s0, s1,
                                       passes > 1 && m0 == 0, ahead, lines);
            else
              column_pair_avx2_rows<2>(rows, xp, x_stride, yp, y_stride, wp, bias, m0, pair, half, n, k, s0, s1,
                                       passes > 1 && m0 == 0, ahead, lines);
          }
        }
      }
    }
  });
}

// Rows in blocks of at most AVX2_ROW_BLOCK, each walked as above: a block's slice of x for one block of k
// (128 rows x 576 steps, 288 KB) stays in L2 while every pair's passes read it. Without the blocks, 1,024 rows
// and more read x from L3 for every pair, and 4,096 rows ran at 130-145 GFLOP/s where blocks of 512 run ~170
// (blocks of 128 rows with the longer blocks of k: ~180).
// Each output is the same FMA chain whatever block, pass or tile computes it.
void run_avx2(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  const int64_t m = x.size(0);
  if (m == 0) return;
  const int64_t row_blocks = (m + AVX2_ROW_BLOCK - 1) / AVX2_ROW_BLOCK;
  const int64_t base = m / row_blocks, extra = m % row_blocks;
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  for (int64_t b = 0, r0 = 0; b < row_blocks; r0 += base + (b < extra), ++b)
    run_avx2_rows(xp + r0 * x.stride(0), x.stride(0), yp + r0 * out.stride(0), out.stride(0), packed, bias, n,
                  base + (b < extra));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// Pair steps per int32 partial sum: 256 * 2 * 127 * 32767 < 2^31, so no partial sum can overflow.
constexpr int64_t INT8_FLUSH_STEPS = 256;

inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) { return static_cast<float>(v); }

// 16 elements of x as fp32 (bf16 widens exactly), the first `live` of them; zeros past.
inline __m512 load_x(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
inline __m512 load_x(const at::BFloat16* p, __mmask16 live) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// Rows of x -> int16 codes [M, kp] (zeros past K) and one scale per row: x[r, k] ~= xq[r, k] * xs[r],
// xs = max|x[r]| / 32767, xq = x * (32767 / max|x[r]|) in fp32, rounded to nearest-even. A row with a
// non-finite element gets xs = NaN (its outputs are NaN); an all-zero row gets codes 0. store(r, i, codes, live)
// keeps codes i .. i + 15 of row r (int16, the first `live` of them): stored as they are (run_int8) or split
// (run_amx_int8).
template <typename T, typename Store>
void quantize_rows(const T* x, int64_t stride, int64_t m, int64_t k, int64_t kp, float* xs, const Store& store) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * stride;
      __m512 vmax = _mm512_setzero_ps();
      __mmask16 bad = 0;
      for (int64_t i = 0; i < k; i += LANES) {
        const __m512 v = load_x(row + i, first_lanes(k - i));
        bad |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN | +Inf | -Inf | SNaN
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      }
      const float absmax = _mm512_reduce_max_ps(vmax);
      const float inv = (bad == 0 && absmax > 0.f) ? 32767.f / absmax : 0.f;
      xs[r] = bad == 0 ? absmax / 32767.f : std::numeric_limits<float>::quiet_NaN();
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t i = 0; i < kp; i += LANES) {
        const __m512 v = _mm512_mul_ps(load_x(row + i, first_lanes(k - i)), vinv);
        store(r, i, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)), kp - i);  // nearest-even, saturating
      }
    }
  });
}

// 16 int32 partial sums added to 16 float64 totals; exact while a total stays below 2^53, as every int8
// matmul's does (|sum| < 2^31 per 512 k).
inline void add_exact(double* total, __m512i part) {
  const __m512d lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(part));
  const __m512d hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(part, 1));
  _mm512_store_pd(total, _mm512_add_pd(_mm512_load_pd(total), lo));
  _mm512_store_pd(total + 8, _mm512_add_pd(_mm512_load_pd(total + 8), hi));
}

// 16 float64 totals of integers rounded once to fp32 (nearest-even).
inline __m512 rounded_total(const double* total) {
  const __m256 lo = _mm512_cvtpd_ps(_mm512_load_pd(total)), hi = _mm512_cvtpd_ps(_mm512_load_pd(total + 8));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// The int8 kernels' epilogue for pair `pair`, rows [m0, m0 + rows) of y: y = sum * (wscale[col] * xs[row])
// + bias in one fp32 FMA, stored as T (the zero columns padding N to a multiple of 32 are not stored);
// sum(c, r) gives column block c's 16 sums of row m0 + r. Both paths store through it, so they round alike.
template <typename T, typename Sums>
inline void store_int8_pair(T* y, int64_t y_stride, int64_t m0, int64_t rows, int64_t pair, int64_t n,
                            const float* wscale, const float* bias, const float* xs, const Sums& sum) {
  for (int c = 0; c < 2; ++c) {
    const int64_t col = (2 * pair + c) * LANES;
    const int64_t live = std::min<int64_t>(LANES, n - col);
    if (live <= 0) break;
    const __mmask16 mask = first_lanes(live);
    const __m512 sc = _mm512_maskz_loadu_ps(mask, wscale + col);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r)
      store_row(y + (m0 + r) * y_stride + col, mask,
                _mm512_fmadd_ps(sum(c, r), _mm512_mul_ps(sc, _mm512_set1_ps(xs[m0 + r])), b));
  }
}

// The two column blocks of pair `pair` for rows [m0, m0 + rows): int16 x pairs against int8 weight pairs
// widened to int16 (vpmovsxbw), multiplied and summed exactly in int32 (vpdpwssd), added exactly to float64 totals
// every INT8_FLUSH_STEPS steps and rounded to fp32 once; y = sum * (wscale[col] * xs[row]) + bias. A step of k reads one 64-byte line
// (both blocks' 16 columns x 2 k), and consecutive pairs are consecutive in memory: one sequential stream.
template <typename T>
inline void column_pair_int8(const int16_t* xq, int64_t xq_stride, const float* xs, T* y, int64_t y_stride,
                             const int8_t* packed, const float* wscale, const float* bias, int64_t m0,
                             int64_t rows, int64_t pair, int64_t n, int64_t steps) {
  constexpr int NB = 2;
  alignas(64) double total[NB][ROWS][LANES];  // each output's exact integer sum so far (below 2^53)
  for (int c = 0; c < NB; ++c)
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < LANES; h += 8) _mm512_store_pd(&total[c][r][h], _mm512_setzero_pd());
  const int8_t* w = packed + pair * steps * 2 * 2 * LANES;
  const int16_t* xr[ROWS];
  for (int r = 0; r < ROWS; ++r) xr[r] = xq + (m0 + std::min<int64_t>(r, rows - 1)) * xq_stride;
  for (int64_t s0 = 0; s0 < steps; s0 += INT8_FLUSH_STEPS) {
    const int64_t s1 = std::min(steps, s0 + INT8_FLUSH_STEPS);
    __m512i acc[NB][ROWS];
    for (int c = 0; c < NB; ++c)
      for (int r = 0; r < ROWS; ++r) acc[c][r] = _mm512_setzero_si512();
    for (int64_t s = s0; s < s1; ++s) {
      const int8_t* p = w + s * 4 * LANES;
      _mm_prefetch(reinterpret_cast<const char*>(p) + 2048, _MM_HINT_T0);
      __m512i wv[NB];
      for (int c = 0; c < NB; ++c)
        wv[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 2 * LANES)));
      for (int r = 0; r < ROWS; ++r) {
        if (r >= rows) break;
        int32_t x_pair;
        std::memcpy(&x_pair, xr[r] + 2 * s, sizeof(x_pair));
        const __m512i xv = _mm512_set1_epi32(x_pair);
        for (int c = 0; c < NB; ++c) acc[c][r] = _mm512_dpwssd_epi32(acc[c][r], xv, wv[c]);
      }
    }
    for (int c = 0; c < NB; ++c)
      for (int r = 0; r < ROWS; ++r) {
        if (r >= rows) break;
        add_exact(total[c][r], acc[c][r]);
      }
  }
  store_int8_pair(y, y_stride, m0, rows, pair, n, wscale, bias, xs,
                  [&](int c, int64_t r) { return rounded_total(total[c][r]); });
}

template <typename T>
void run_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* wscale,
              const float* bias, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t pairs = packed.size(0);
  const int64_t steps = packed.size(1);  // K / 2, rounded up
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> xs;
  xq.resize(m * 2 * steps);
  xs.resize(m);
  int16_t* xqp = xq.data();
  quantize_rows(x.data_ptr<T>(), x.stride(0), m, k, 2 * steps, xs.data(),
                [xqp, kp = 2 * steps](int64_t r, int64_t i, __m256i codes, int64_t live) {
                  _mm256_mask_storeu_epi16(xqp + r * kp + i, first_lanes(live), codes);
                });
  const float* xsp = xs.data();
  T* yp = out.data_ptr<T>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair)
      for (int64_t m0 = 0; m0 < m; m0 += ROWS)
        column_pair_int8<T>(xqp, 2 * steps, xsp, yp, out.stride(0), wp, wscale, bias, m0, std::min(ROWS, m - m0),
                            pair, n, steps);
  });
}

#if defined(STREAMKV_AMX) && defined(__AMX_INT8__)
#define STREAMKV_AMX_INT8 1
// run_int8 on AMX tiles (tdpbssd, tdpbusd: int8 x int8 and uint8 x int8 products summed exactly into int32
// tiles), bitwise run_int8's results. Each int16 code of x is split, xq = 256 * hi + lo with hi = xq >> 8 in
// [-128, 127] and lo = xq & 255 in [0, 255], so sum(xq q) = 256 * sum(hi q) + sum(lo q). Neither tile sum can
// overflow below K = 65,536 (|lo q| <= 255 * 127 a product), so each runs over the whole of k, and
// 256 * hi + lo is joined in float64 (exact) and rounded to fp32 once: the integer and the rounding run_int8's
// float64 totals give. Both store through store_int8_pair, so a row's result is the same whichever kernel its
// batch takes.
//   tile 0, 1: C, int32 [rows, 16], hi x block 0 / 1; 2, 3: lo x block 0 / 1
//   tile 4, 5: A, rows of hi / lo x 64 k
//   tile 6, 7: B, 16 quads of k x the 16 columns of block 0 / 1, byte 4 j + i = q[column j, 4 r + i]
// One tdpbssd is 16 x 16 x 64 products, so the four of a 64-k step give 16 rows x 32 columns at bf16 tiles'
// rate on half the weight bytes; run_int8's vpdpwssd was compute-bound from 16 rows.
constexpr int64_t AMX_INT8_K = 64;  // int8 of k per tile step
constexpr int64_t AMX_INT8_MAX_K = 65536;  // past it a tile's int32 sum of lo x q could overflow
constexpr int64_t AMX_INT8_STEP_BYTES = 2048;  // one tile step of a pair's panel: 16 quads x 2 blocks x 64 bytes
// Fewest rows of x that take the tiles. At one row run_int8 streams the weight faster (6.3-6.5 against 6.9-7.2
// ms for a decode step's matmuls), at 2-4 rows the two are within the noise of each other, from 6 the tiles
// lead (load_tests/bench_small_linear.py, docs/benchmarks.md "Round 30").
constexpr int64_t AMX_INT8_MIN_ROWS = 4;

// Tile step t of a pair's B tiles from its packed steps (pack_small_linear_int8: per step, 2 k of block 0's 16
// columns then block 1's) into 2 KB at dst: row r of block c at r * 128 + c * 64 interleaves the 16-bit (k, k + 1)
// pairs of steps 32 t + 2 r and 32 t + 2 r + 1 column by column. Steps past the weight's are zeros.
inline void int8_quad_step(const int8_t* w, int64_t steps, int64_t t, int8_t* dst) {
  alignas(64) static const uint16_t order[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i idx0 = _mm512_load_si512(order[0]), idx1 = _mm512_load_si512(order[1]);
  for (int64_t r = 0; r < AMX_ROWS; ++r) {
    const int64_t e = 32 * t + 2 * r;
    const __m512i a = e < steps ? _mm512_loadu_si512(w + e * 64) : _mm512_setzero_si512();
    const __m512i b = e + 1 < steps ? _mm512_loadu_si512(w + (e + 1) * 64) : _mm512_setzero_si512();
    _mm512_store_si512(dst + r * 128, _mm512_permutex2var_epi16(a, idx0, b));
    _mm512_store_si512(dst + r * 128 + 64, _mm512_permutex2var_epi16(a, idx1, b));
  }
}

// One row block's sums over k_tiles tile steps into out [rows][32] fp32, 256 * hi + lo rounded once; step(t) gives
// tile step t's 2 KB of B tiles (int8_quad_step's layout).
template <typename Step>
inline void amx_int8_pass(const int8_t* hi, const uint8_t* lo, int64_t a_stride, int64_t k_tiles, int64_t rows,
                          float* out, const Step& step) {
  alignas(64) int32_t sums[4][AMX_ROWS * LANES];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t = 0; t < k_tiles; ++t) {
    const int8_t* b = step(t);
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + 64, 128);
    _tile_loadd(4, hi + t * AMX_INT8_K, a_stride);
    _tile_loadd(5, lo + t * AMX_INT8_K, a_stride);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  const __m512d step256 = _mm512_set1_pd(256.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 2; ++c) {
      const __m512i h = _mm512_load_si512(sums[c] + r * LANES), l = _mm512_load_si512(sums[2 + c] + r * LANES);
      alignas(64) double total[LANES];
      for (int half = 0; half < 2; ++half) {
        const __m256i hh = half ? _mm512_extracti64x4_epi64(h, 1) : _mm512_castsi512_si256(h);
        const __m256i ll = half ? _mm512_extracti64x4_epi64(l, 1) : _mm512_castsi512_si256(l);
        _mm512_store_pd(total + 8 * half, _mm512_fmadd_pd(_mm512_cvtepi32_pd(hh), step256, _mm512_cvtepi32_pd(ll)));
      }
      _mm512_store_ps(out + r * 32 + c * LANES, rounded_total(total));
    }
}

// run_int8's contract on AMX tiles, 16 rows a pass; the walk (and its panel buffers) as run_amx_passes'.
template <typename T>
void run_amx_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* wscale,
                  const float* bias, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) return;
  const int64_t pairs = packed.size(0), steps = packed.size(1);
  const int64_t kp = padded(k, AMX_INT8_K), k_tiles = kp / AMX_INT8_K;
  const int64_t tile_rows = std::min(m, AMX_ROWS), mp = m < AMX_ROWS ? m : padded(m, AMX_ROWS);
  thread_local std::vector<float> xs;
  thread_local std::vector<int8_t> hi_codes;
  thread_local std::vector<uint8_t> lo_codes;
  xs.resize(m);
  hi_codes.resize(mp * kp);
  lo_codes.resize(mp * kp);
  int8_t* hi = hi_codes.data();
  uint8_t* lo = lo_codes.data();
  std::memset(hi + m * kp, 0, (mp - m) * kp);  // the padding rows of the last tile: zeros
  std::memset(lo + m * kp, 0, (mp - m) * kp);
  quantize_rows(x.data_ptr<T>(), x.stride(0), m, k, kp, xs.data(), [=](int64_t r, int64_t i, __m256i codes, int64_t) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + r * kp + i), _mm256_cvtepi16_epi8(_mm256_srai_epi16(codes, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + r * kp + i),
                     _mm256_cvtepi16_epi8(_mm256_and_si256(codes, _mm256_set1_epi16(0xFF))));
  });
  const float* xsp = xs.data();
  T* yp = out.data_ptr<T>();
  const int64_t y_stride = out.stride(0);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t pair_bytes = steps * 4 * LANES;
  const int64_t passes = (mp + AMX_ROWS - 1) / AMX_ROWS;
  // One pass a pair (up to 16 rows): each tile step is laid out in L1 just before its tiles load (CodesPass lays
  // its steps out one ahead); more: whole panels (k_tiles steps a pair), laid out once a call and walked as
  // run_amx_passes walks them.
  const bool streamed = passes == 1;
  const int64_t panel_bytes = streamed ? pair_bytes : k_tiles * AMX_INT8_STEP_BYTES;
  const auto panels = [&](int64_t p0, int64_t p1) {
    if (streamed) return reinterpret_cast<const char*>(wp + p0 * pair_bytes);
    int8_t* panel = thread_scratch<int8_t>((p1 - p0) * panel_bytes);
    for (int64_t pair = p0; pair < p1; ++pair)
      for (int64_t t = 0; t < k_tiles; ++t)
        int8_quad_step(wp + pair * pair_bytes, steps, t, panel + (pair - p0) * panel_bytes + t * AMX_INT8_STEP_BYTES);
    return reinterpret_cast<const char*>(panel);
  };
  struct NoState {};
  amx_walk_panels<NoState>(m, tile_rows, pairs, passes, panel_bytes, panels, [&](NoState&, int64_t pair, int64_t pass,
                                                                               const char* w) {
    alignas(64) float acc[AMX_ROWS * 32];
    const int64_t r0 = pass * AMX_ROWS, rows = std::min<int64_t>(AMX_ROWS, m - r0);
    const int8_t* wq = reinterpret_cast<const int8_t*>(w);
    if (streamed) {
      alignas(64) int8_t buffer[2][AMX_INT8_STEP_BYTES];
      amx_int8_pass(hi + r0 * kp, lo + r0 * kp, kp, k_tiles, rows, acc, [&](int64_t t) {
        for (int64_t l = 0; l < AMX_INT8_STEP_BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(wq) + (t + 2) * AMX_INT8_STEP_BYTES + l, _MM_HINT_T0);
        int8_quad_step(wq, steps, t, buffer[t & 1]);
        return static_cast<const int8_t*>(buffer[t & 1]);
      });
    } else {
      // Pair by pair (decode batches), the first pass brings the next pair's packed weight into L2, a tile step's
      // 2 KB a step, so memory streams it while the tiles run; spreading it over every pass timed the same or
      // slower at 24-96 rows (docs/benchmarks.md, "Round 30").
      const char* next = pass == 0 && m <= AMX_PANEL_MAJOR_ROWS && pair + 1 < pairs
                             ? reinterpret_cast<const char*>(wp + (pair + 1) * pair_bytes)
                             : nullptr;
      amx_int8_pass(hi + r0 * kp, lo + r0 * kp, kp, k_tiles, rows, acc, [wq, next](int64_t t) {
        if (next != nullptr)
          for (int64_t l = 0; l < AMX_INT8_STEP_BYTES; l += 64) _mm_prefetch(next + t * AMX_INT8_STEP_BYTES + l, _MM_HINT_T1);
        return wq + t * AMX_INT8_STEP_BYTES;
      });
    }
    store_int8_pair(yp, y_stride, r0, rows, pair, n, wscale, bias, xsp,
                    [&](int c, int64_t r) { return _mm512_load_ps(acc + r * 32 + c * LANES); });
  }, [](NoState&) {});
}
#endif
#endif


}  // namespace

// The fp32 kernel's instruction set: "avx512" (run), "avx2" (run_avx2; rows in blocks, every batch size) or
// "" (none). Either kernel takes every batch size (streamkv/model/linear.py).
const char* small_linear_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(STREAMKV_AVX2_LINEAR)
  return "avx2";
#else
  return "";
#endif
}

bool small_linear_supported() { return *small_linear_isa() != '\0'; }

// bf16 weights need AVX512-BF16 (vdpbf16ps); an AVX2 build, or AVX-512 without it, runs fp32 only.
bool small_linear_bf16_supported() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The optional bias [N] as a contiguous float32 tensor (undefined when absent).
static at::Tensor bias_f32(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [N]");
  return bias->to(at::kFloat).contiguous();
}

// Whether small_linear_int8 runs batches from AMX_INT8_MIN_ROWS rows on AMX tiles in this process (built for
// AMX-INT8, permitted, not switched off); K of 1 to AMX_INT8_MAX_K, other K on vpdpwssd.
bool small_linear_int8_amx() {
#if defined(STREAMKV_AMX_INT8)
  return amx_on();
#else
  return false;
#endif
}

bool small_linear_int8_supported() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// GGUF Q4_1 and Q8_0 codes under fp32 x (run_gguf).
bool small_linear_gguf_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// ... and under bfloat16 x (run_gguf_bf16: the bf16 rounding of those weights, on the bf16 kernels).
bool small_linear_gguf_bf16_supported() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// GGUF Q4_1 blocks of a [N, K] weight -> run_gguf's layout [N/32, K/32, 640], or with bf16 run_gguf_bf16's
// [N/32, K/32, 40, 16] (N padded to a multiple of 32 with zero columns): codes [N, K/2] uint8, GGUF's order within
// each block of 32 (byte i: element i in the low nibble, element 16 + i in the high); d, m [N, K/32] float16, the
// blocks' scales and minima. W[n, k] = d * q + m in fp32.
at::Tensor pack_small_linear_q4_1(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, bool bf16) {
  TORCH_CHECK(small_linear_gguf_supported(), "Q4_1 small_linear needs AVX-512");
  TORCH_CHECK(codes.dim() == 2 && !codes.is_cuda() && codes.scalar_type() == at::kByte,
              "codes must be a CPU uint8 [N, K/2]");
  const int64_t n = codes.size(0), k = 2 * codes.size(1), blocks = k / GGUF_K;
  TORCH_CHECK(k % GGUF_K == 0, "Q4_1 needs K to be a multiple of 32, not ", k);
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == blocks && t->scalar_type() == at::kHalf &&
                    !t->is_cuda(),
                "d and m must be CPU float16 [N, K/32]");
  const at::Tensor c = codes.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const int64_t pairs = padded(n, 2 * LANES) / (2 * LANES);
  TORCH_CHECK(!bf16 || small_linear_gguf_bf16_supported(), "bf16 GGUF small_linear needs AVX512-BF16");
  at::Tensor out = bf16 ? at::zeros({pairs, blocks, Q4_1_BLOCK_BYTES / 16, 16}, codes.options())
                        : at::zeros({pairs, blocks, Q4_1_BLOCK_BYTES}, codes.options());
  uint8_t* o = out.data_ptr<uint8_t>();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
  // By pairs: the rows of one pair share bytes (column j's nibble beside column 16 + j's).
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t row = p0 * 2 * LANES; row < std::min(n, p1 * 2 * LANES); ++row) {
      const int64_t col = row % (2 * LANES), high = col / LANES, j = col % LANES;
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = o + ((row / (2 * LANES)) * blocks + b) * Q4_1_BLOCK_BYTES;
        const uint8_t* src = cp + row * (k / 2) + b * (GGUF_K / 2);
        for (int64_t e = 0; e < GGUF_K; ++e) {
          const uint8_t q = e < GGUF_K / 2 ? src[e] & 0xF : src[e - GGUF_K / 2] >> 4;
          // bf16: line 2 t + h (t = e / 2, h = j / 8), byte 2 (j % 8) + e % 2 (see Q4_1Bf16)
          const int64_t at = bf16 ? (e / 2 * 2 + j / 8) * 16 + 2 * (j % 8) + e % 2 : e * LANES + j;
          blk[at] |= static_cast<uint8_t>(q << (4 * high));
        }
        std::memcpy(blk + 512 + 2 * col, dp + row * blocks + b, 2);
        std::memcpy(blk + 576 + 2 * col, mp + row * blocks + b, 2);
      }
    }
  });
  return out;
}

// GGUF Q8_0 blocks of a [N, K] weight -> run_gguf's layout [N/32, K/32, 1088], or with bf16 run_gguf_bf16's
// [N/32, K/32, 68, 16] (N padded to a multiple of 32 with zero columns): codes [N, K] int8; d [N, K/32] float16,
// the blocks' scales. W[n, k] = d * q in fp32.
at::Tensor pack_small_linear_q8_0(const at::Tensor& codes, const at::Tensor& d, bool bf16) {
  TORCH_CHECK(small_linear_gguf_supported(), "Q8_0 small_linear needs AVX-512");
  TORCH_CHECK(codes.dim() == 2 && !codes.is_cuda() && codes.scalar_type() == at::kChar,
              "codes must be a CPU int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1), blocks = k / GGUF_K;
  TORCH_CHECK(k % GGUF_K == 0, "Q8_0 needs K to be a multiple of 32, not ", k);
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && d.size(1) == blocks && d.scalar_type() == at::kHalf && !d.is_cuda(),
              "d must be CPU float16 [N, K/32]");
  const at::Tensor c = codes.contiguous(), dc = d.contiguous();
  const int64_t pairs = padded(n, 2 * LANES) / (2 * LANES);
  TORCH_CHECK(!bf16 || small_linear_gguf_bf16_supported(), "bf16 GGUF small_linear needs AVX512-BF16");
  const auto bytes = codes.options().dtype(at::kByte);
  at::Tensor out = bf16 ? at::zeros({pairs, blocks, Q8_0_BLOCK_BYTES / 16, 16}, bytes)
                        : at::zeros({pairs, blocks, Q8_0_BLOCK_BYTES}, bytes);
  uint8_t* o = out.data_ptr<uint8_t>();
  const auto* cp = reinterpret_cast<const uint8_t*>(c.data_ptr<int8_t>());
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t row = p0 * 2 * LANES; row < std::min(n, p1 * 2 * LANES); ++row) {
      const int64_t col = row % (2 * LANES);
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = o + ((row / (2 * LANES)) * blocks + b) * Q8_0_BLOCK_BYTES;
        const uint8_t* src = cp + row * k + b * GGUF_K;
        // bf16: line 4 t + 2 c + h (t = e / 2, c = col / 16, h = col % 16 / 8), byte 2 (col % 8) + e % 2
        for (int64_t e = 0; e < GGUF_K; ++e)
          blk[bf16 ? (e / 2 * 4 + col / 8) * 16 + 2 * (col % 8) + e % 2 : e * 2 * LANES + col] = src[e];
        std::memcpy(blk + 1024 + 2 * col, dp + row * blocks + b, 2);
      }
    }
  });
  return out;
}

// weight [N, K] (fp32 or bf16) -> the packed layout above (same dtype).
at::Tensor pack_small_linear(const at::Tensor& weight) {
  TORCH_CHECK(small_linear_supported(), "small_linear needs AVX-512, or AVX2 with FMA");
  TORCH_CHECK(weight.dim() == 2 && !weight.is_cuda(), "weight must be a CPU [N, K]");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "weight must be float32 or bfloat16");
  TORCH_CHECK(dtype == at::kFloat || small_linear_bf16_supported(), "bf16 small_linear needs AVX512-BF16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t np = padded(n, 2 * LANES), pairs = np / (2 * LANES);
  if (dtype == at::kFloat) {
    at::Tensor w = at::zeros({np, k}, weight.options());
    w.narrow(0, 0, n).copy_(weight);
    // [N/32, 2, 16, K] -> [N/32, K, 2, 16]
    return w.view({pairs, 2, LANES, k}).permute({0, 3, 1, 2}).contiguous().view({pairs, k, 2 * LANES});
  }
  const int64_t kp = padded(k, 2);
  at::Tensor w = at::zeros({np, kp}, weight.options());
  w.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [N/32, 2, 16, K/2, 2] -> [N/32, K/2, 2, 16, 2]
  return w.view({pairs, 2, LANES, kp / 2, 2}).permute({0, 3, 1, 2, 4}).contiguous().view({pairs, kp / 2, 4 * LANES});
}

// out [M, N] = x [M, K] @ W^T (+ bias [N], fp32 or the weight's dtype), W given packed; N = out.size(1).
void small_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(small_linear_supported(), "small_linear needs AVX-512, or AVX2 with FMA");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "x and out must be [M, K] and [M, N] with unit last strides");
  if (packed.scalar_type() == at::kByte) {  // GGUF codes (pack_small_linear_q4_1 / _q8_0)
    TORCH_CHECK(small_linear_gguf_supported(), "GGUF small_linear needs AVX-512");
    TORCH_CHECK((dtype == at::kFloat || (dtype == at::kBFloat16 && small_linear_gguf_bf16_supported())) &&
                    out.scalar_type() == dtype,
                "GGUF codes take float32 x and out, or bfloat16 ones with AVX512-BF16");
    const bool bf16 = dtype == at::kBFloat16;
    // The layout of each dtype (pack_small_linear_q4_1 / _q8_0 with bf16 or without) and which quantization.
    const bool fits = bf16 ? packed.dim() == 4 && packed.size(3) == 16 : packed.dim() == 3;
    const int64_t block_bytes = fits ? packed.size(2) * (bf16 ? 16 : 1) : 0;
    const bool q4_1 = block_bytes == Q4_1_BLOCK_BYTES;
    TORCH_CHECK(packed.is_contiguous() && (q4_1 || block_bytes == Q8_0_BLOCK_BYTES),
                "packed must come from pack_small_linear_q4_1 or pack_small_linear_q8_0 with bf16=",
                bf16 ? "True" : "False", " for ", bf16 ? "bfloat16" : "float32", " x");
    const int64_t n = out.size(1), k = x.size(1);
    TORCH_CHECK(packed.size(0) == padded(n, 2 * LANES) / (2 * LANES) && packed.size(1) * 32 == k,
                "packed was made for another N or K than ", n, " x ", k);
    const at::Tensor b32 = bias_f32(bias, n);
#if defined(__AVX512F__)
    const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
    if (!bf16) {
#if defined(STREAMKV_AMX)
      if (x.size(0) >= GGUF_F32_AMX_MIN_ROWS && x.size(1) > 0 && amx_on()) {
        if (q4_1)
          run_gguf_amx_f32<Q4_1Block, Q4_1F32Tiles>(out, x, packed, bp, n);
        else
          run_gguf_amx_f32<Q8_0Block, Q8_0F32Tiles>(out, x, packed, bp, n);
        return;
      }
#endif
      if (q4_1)
        run_gguf<Q4_1Block>(out, x, packed, bp, n);
      else
        run_gguf<Q8_0Block>(out, x, packed, bp, n);
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (bf16) {
      if (q4_1)
        run_gguf_bf16<Q4_1Bf16>(out, x, packed, bp, n);
      else
        run_gguf_bf16<Q8_0Bf16>(out, x, packed, bp, n);
    }
#endif
    return;
  }
  TORCH_CHECK(packed.scalar_type() == dtype && out.scalar_type() == dtype, "x, packed and out dtypes differ");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(dtype == at::kFloat || small_linear_bf16_supported(), "bf16 small_linear needs AVX512-BF16");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == 2 * LANES * (dtype == at::kFloat ? 1 : 2),
              "packed must come from pack_small_linear");
  const int64_t n = out.size(1), k = x.size(1);
  TORCH_CHECK(packed.size(0) == padded(n, 2 * LANES) / (2 * LANES), "packed has ", packed.size(0) * 2 * LANES,
              " columns for N = ", n);
  TORCH_CHECK(dtype == at::kFloat ? packed.size(1) == k : packed.size(1) == padded(k, 2) / 2,
              "packed was made for another K than ", k);
  const at::Tensor b32 = bias_f32(bias, n);
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
  if (dtype == at::kFloat) {
    run<float>(out, x, packed, bp, n);
    return;
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (k % 2 != 0) {  // bf16 goes in (k, k+1) pairs: an odd K takes a zero column, as the packed weight has
    at::Tensor even = at::zeros({x.size(0), k + 1}, x.options());
    even.narrow(1, 0, k).copy_(x);
    run<at::BFloat16>(out, even, packed, bp, n);
    return;
  }
#if defined(STREAMKV_AMX)
  if (amx_takes(k) && amx_on()) {
    run_amx(out, x, packed, bp, n);
    return;
  }
#endif
  run<at::BFloat16>(out, x, packed, bp, n);
#endif
#if defined(STREAMKV_AVX2_LINEAR)
  run_avx2(out, x, packed, bp, n);
#endif
}

// int8 weight q [N, K] -> packed [N/32, K/2, 64] int8: per pair of column blocks and pair of k, block 0's
// 16 columns x 2 k then block 1's (N padded to a multiple of 32 with zero columns, K to 2 with a zero).
at::Tensor pack_small_linear_int8(const at::Tensor& q) {
  TORCH_CHECK(small_linear_int8_supported(), "small_linear_int8 needs AVX-512 VNNI");
  TORCH_CHECK(q.dim() == 2 && !q.is_cuda() && q.scalar_type() == at::kChar, "q must be a CPU int8 [N, K]");
  const int64_t n = q.size(0), k = q.size(1);
  const int64_t np = padded(n, 2 * LANES), kp = padded(k, 2);
  at::Tensor w = at::zeros({np, kp}, q.options());
  w.narrow(0, 0, n).narrow(1, 0, k).copy_(q);
  // [N/32, 2, 16, K/2, 2] -> [N/32, K/2, 2, 16, 2]
  return w.view({np / (2 * LANES), 2, LANES, kp / 2, 2})
      .permute({0, 3, 1, 2, 4})
      .contiguous()
      .view({np / (2 * LANES), kp / 2, 4 * LANES});
}

// out [M, N] = (x [M, K] @ q^T) * scale [N] (+ bias [N]); x and out float32 or bfloat16, q packed int8.
void small_linear_int8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(small_linear_int8_supported(), "small_linear_int8 needs AVX-512 VNNI");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dtype, "x and out dtypes differ");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "x and out must be [M, K] and [M, N] with unit last strides");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == 4 * LANES,
              "packed must come from pack_small_linear_int8");
  const int64_t n = out.size(1), k = x.size(1);
  TORCH_CHECK(packed.size(0) == padded(n, 2 * LANES) / (2 * LANES), "packed has ", packed.size(0) * 2 * LANES,
              " columns for N = ", n);
  TORCH_CHECK(packed.size(1) == padded(k, 2) / 2, "packed was made for another K than ", k);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous(),
              "scale must be a contiguous float32 [N]");
  const at::Tensor b32 = bias_f32(bias, n);
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
#if defined(STREAMKV_AMX_INT8)
  if (x.size(0) >= AMX_INT8_MIN_ROWS && k > 0 && k <= AMX_INT8_MAX_K && amx_on()) {
    if (dtype == at::kFloat)
      run_amx_int8<float>(out, x, packed, scale.data_ptr<float>(), bp, n);
    else
      run_amx_int8<at::BFloat16>(out, x, packed, scale.data_ptr<float>(), bp, n);
    return;
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  if (dtype == at::kFloat)
    run_int8<float>(out, x, packed, scale.data_ptr<float>(), bp, n);
  else
    run_int8<at::BFloat16>(out, x, packed, scale.data_ptr<float>(), bp, n);
#endif
}

// Whether small_linear_silu_mul runs in this build: bf16 (f32 false) with AVX512-BF16, on AMX tiles while they are on
// (run_silu_mul), else on vdpbf16ps (run_silu_mul_vnni); fp32 with AVX-512 (run_silu_mul_f32).
bool small_linear_silu_mul_supported(bool f32) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#elif defined(__AVX512F__)
  return f32;
#else
  (void)f32;
  return false;
#endif
}

// Whether the MLP runs `rows` rows fused. bf16: any batch on AMX tiles; on vdpbf16ps, prefill-sized ones (past
// SMALL_BATCH_MAX_ROWS) alone. There a 32 x 128-token bf16 prefill step took 2,495 -> 2,381 ms fused, but a decode
// step at 32 rows 37.0 -> 39.1 ms: per pair, SiLU's table lookups between the passes pushed the panel out of the
// cache, where unfused they run in their own pass (docs/benchmarks.md "Round 45"). fp32 (f32 true): prefill-sized
// batches, and not while AMX is on (where small_linear's fp32 GGUF prefill sums on tiles, in another order). Fused
// or not, act has the same bits.
bool small_linear_silu_mul_takes(int64_t rows, bool f32) {
  if (!small_linear_silu_mul_supported(f32)) return false;
#if defined(STREAMKV_AMX)
  if (amx_on()) return !f32 && rows >= 1;
#endif
#if defined(__AVX512F__)
  return rows > SMALL_BATCH_MAX_ROWS;
#else
  (void)rows;  // nothing is supported without AVX-512: returned false above
  return false;
#endif
}

// act [M, I] = silu(x Wg^T (+ bg)) * (x Wu^T (+ bu)): bitwise silu_and_mul(act, small_linear(x, W)) for the same W,
// without the [M, 2I] gate_up in memory. bf16 (run_silu_mul, run_silu_mul_vnni): each factor rounded to bf16 first, as
// small_linear stores them. fp32 (run_silu_mul_f32). W is gate_up with its rows interleaved 16 at a time (gate rows
// 16 q .. 16 q + 15, then up's), packed by pack_small_linear or pack_small_linear_q4_1 / _q8_0 (bf16=True for bf16 x);
// bias [2I] in the same order. I must be a multiple of 16 and K of 32. Raises where
// small_linear_silu_mul_supported(x is float32) is false.
void small_linear_silu_mul(at::Tensor act, const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias) {
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(small_linear_silu_mul_supported(f32), "small_linear_silu_mul needs ", f32 ? "AVX-512" : "AVX512-BF16");
#if defined(__AVX512F__)  // the code layouts' constants exist there only; the check raised
  TORCH_CHECK(x.is_cpu() && act.is_cpu() && packed.is_cpu() && (!bias.has_value() || bias->is_cpu()),
              "small_linear_silu_mul takes CPU tensors");
  TORCH_CHECK((f32 || x.scalar_type() == at::kBFloat16) && act.scalar_type() == x.scalar_type(),
              "x and act must be both float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && act.dim() == 2 && act.stride(1) == 1 && act.size(0) == x.size(0),
              "x and act must be [M, K] and [M, I] with unit last strides");
  const int64_t i = act.size(1), k = x.size(1), n = 2 * i;
  TORCH_CHECK(i > 0 && i % LANES == 0 && k > 0 && k % 32 == 0,
              "small_linear_silu_mul needs I a multiple of 16 and K of 32, got I = ", i, ", K = ", k);
  TORCH_CHECK(packed.is_contiguous() && packed.dim() >= 1 && packed.size(0) == n / (2 * LANES), "packed has ",
              packed.dim() >= 1 ? packed.size(0) * 2 * LANES : 0, " rows for 2I = ", n);
  const at::Tensor b32 = bias_f32(bias, n);
  const float* b = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (f32) {
    const bool dense = packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(1) == k &&
                       packed.size(2) == 2 * LANES;
    const bool codes = packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(1) * 32 == k &&
                       (packed.size(2) == Q4_1_BLOCK_BYTES || packed.size(2) == Q8_0_BLOCK_BYTES);
    TORCH_CHECK(dense || codes,
                "packed must come from pack_small_linear (float32) or pack_small_linear_q4_1 / _q8_0 with "
                "bf16=False, for K = ", k);
    if (dense)
      run_silu_mul_f32<void>(act, x, packed, b);
    else if (packed.size(2) == Q4_1_BLOCK_BYTES)
      run_silu_mul_f32<Q4_1Block>(act, x, packed, b);
    else
      run_silu_mul_f32<Q8_0Block>(act, x, packed, b);
    return;
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const bool dense = packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(1) == k / 2 &&
                     packed.size(2) == 4 * LANES;
  const bool codes = packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(1) * 32 == k &&
                     packed.size(3) == 16 && (packed.size(2) == Q4_1_BF16_LINES || packed.size(2) == Q8_0_BF16_LINES);
  TORCH_CHECK(dense || codes,
              "packed must come from pack_small_linear (bfloat16) or pack_small_linear_q4_1 / _q8_0 with bf16=True, "
              "for K = ", k);
#if defined(STREAMKV_AMX)
  if (amx_on()) return run_silu_mul(act, x, packed, b);
#endif
  if (dense)
    run_silu_mul_vnni<void>(act, x, packed, b);
  else if (packed.size(2) == Q4_1_BF16_LINES)
    run_silu_mul_vnni<Q4_1Bf16>(act, x, packed, b);
  else
    run_silu_mul_vnni<Q8_0Bf16>(act, x, packed, b);
#endif
}

#ifndef STREAMKV_NO_PYBIND  // left out of streamkv_decode_ops (decode_layer.cpp), which calls the ops directly
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear_supported", &small_linear_supported, "whether this build has the fp32 kernel");
  m.def("small_linear_isa", &small_linear_isa, "the fp32 kernel's instruction set: avx512, avx2 or empty (none)");
  m.def("small_linear_bf16_supported", &small_linear_bf16_supported, "whether this build has the bf16 kernel");
  m.def("amx", &streamkv::amx_on,
        "whether this extension's AMX kernels (bf16, int8, fp32 prefill) run in this process");
  m.def("set_amx", &streamkv::set_amx, "switch this extension's AMX kernels; returns the state before", py::arg("on"));
  m.def("pack_small_linear", &pack_small_linear, "pack a [N, K] weight for small_linear");
  m.def("small_linear", &small_linear, "out = x @ W^T (+ bias) for few rows, W packed (CPU, fp32/bf16, or GGUF codes)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("small_linear_int8_supported", &small_linear_int8_supported, "whether this build has the int8 kernel");
  m.def("small_linear_int8_amx", &small_linear_int8_amx,
        "whether the int8 kernel runs batches of 4 rows and more on AMX tiles in this process");
  m.def("small_linear_gguf_supported", &small_linear_gguf_supported,
        "whether this build runs GGUF Q4_1 and Q8_0 codes (float32 x)");
  m.def("small_linear_gguf_bf16_supported", &small_linear_gguf_bf16_supported,
        "whether this build also runs them under bfloat16 x (the weights rounded to bf16)");
  m.def("pack_small_linear_q4_1", &pack_small_linear_q4_1,
        "pack GGUF Q4_1 codes [N, K/2] with their float16 d, m [N, K/32] for small_linear (float32 x, or bf16)",
        py::arg("codes"), py::arg("d"), py::arg("m"), py::arg("bf16") = false);
  m.def("pack_small_linear_q8_0", &pack_small_linear_q8_0,
        "pack GGUF Q8_0 codes [N, K] int8 with their float16 d [N, K/32] for small_linear (float32 x, or bf16)",
        py::arg("codes"), py::arg("d"), py::arg("bf16") = false);
  m.def("small_linear_silu_mul_supported", &small_linear_silu_mul_supported,
        "whether small_linear_silu_mul runs in this build for bf16 x (AVX512-BF16: AMX tiles while on, else "
        "vdpbf16ps) or float32 x (f32=True; AVX-512)",
        py::arg("f32") = false);
  m.def("small_linear_silu_mul_takes", &small_linear_silu_mul_takes,
        "whether the MLP runs this many rows through small_linear_silu_mul (bf16: any on AMX, > 128 on vdpbf16ps; "
        "float32 with f32=True: > 128, AMX off)",
        py::arg("rows"), py::arg("f32") = false);
  m.def("small_linear_silu_mul", &small_linear_silu_mul,
        "act = silu(x W_gate^T + b_gate) * (x W_up^T + b_up) in x's dtype (bf16 or float32), W = gate_up with rows "
        "interleaved 16 at a time, packed, and the bias [2I] in the same order",
        py::arg("act"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("greedy_head", &greedy_head,
        "tokens = argmax of x W^T (fp32 W as small_linear's Q8_0 or fp32 pack) from approx, its bf16 estimate, "
        "computing exactly only the logits its error bound cannot rule out (greedy_head.cpp); -1 where a row "
        "needs the full head; returns the number computed",
        py::arg("tokens"), py::arg("x"), py::arg("approx"), py::arg("packed"), py::arg("row_norms"));
  m.def("pack_small_linear_int8", &pack_small_linear_int8, "pack an int8 [N, K] weight for small_linear_int8");
  m.def("small_linear_int8", &small_linear_int8,
        "out = (x @ q^T) * scale (+ bias) for few rows, q packed int8 (CPU, fp32/bf16 x)", py::arg("out"),
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias") = py::none());
}
#endif
