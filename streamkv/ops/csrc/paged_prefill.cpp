// Paged causal attention of prefill / chunk rows on the CPU: reads K/V in place through the block table.
//
// Sequence b has query_len = query_start_loc[b+1] - query_start_loc[b] new rows at positions
// seq_len - query_len .. seq_len - 1; row r sees positions 0 ..= seq_len - query_len + r. Its new K/V
// are already in the pool (write_kv runs first), so every key, cached or new, is read from the blocks.
// Sequences with query_len == 1 (decodes) are left to paged_decode: their out rows are not written.
//
// One task per (sequence, KV head, tile of query rows; on AMX tiles, for a short chunk over a long context, and
// partition of its keys: make_tasks). A tile's M = rows x G query vectors
// (vector m = row m / G, query head h * G + m % G) share each load of K and V (kv_tile.h):
//
//   for each 64-key tile of the context, up to the tile's last position:
//     Kt [D][64] fp32   the keys transposed (16x16 blocks in registers): Kt[d] is 4 zmm of 64 keys' d-th component
//     Vb [64][D] fp32   the values, each row times its scale (int8 / fp8)
//     for each group of R query vectors (register blocking):
//       s_i  = sum_d broadcast(q_i[d]) * Kt[d]          no horizontal sum
//       s_i *= key scales; lanes past the vector's position masked (the causal diagonal)
//       online softmax: m_i' = max(m_i, max s_i), acc_i *= e^(m_i - m_i'), l_i = l_i e^(..) + sum p_i
//       acc_i += sum_j broadcast(p_ij) * Vb[j]           D/16 zmm accumulators per vector
//   out = acc / l
//
// bf16 query on bf16 KV (AVX512-BF16): the same loop on bf16 pairs, vdpbf16ps for both products.
// Key tiles wholly above a group's diagonal are skipped; slots past the tile's last position (another
// sequence's, or the unwritten tail of the last block) are never read. Everything accumulates in fp32.
// Tasks run longest first off a shared counter, so a causal triangle of unequal tiles balances.

#include <ATen/Parallel.h>

#include "amx.h"
#include "kv_row.h"
#include "ops.h"
#include "kv_tile.h"
#include "simd_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

namespace {

using namespace streamkv;

struct Task {
  int64_t seq;
  int64_t kv_head;
  int64_t row0;   // first query row of the tile, within the sequence's chunk
  int64_t rows;   // query rows in the tile
  int64_t cost;   // keys x rows it reads, to run the longest first
  // A key split (prefill_amx alone): the task reads keys [k_begin, k_end), one partition, and stores its rows'
  // partials at this offset of the scratch for merge_partials. Otherwise it reads every key its rows see and writes
  // their out rows itself.
  int64_t k_begin = 0;
  int64_t k_end = std::numeric_limits<int64_t>::max();
  int64_t partial = -1;
};

// Keys per partition (prefill_amx): each row's softmax state restarts at every multiple of PARTITION and the
// partitions' partials are merged in order (merge_partial), in a task that reads them all or across key-split tasks
// alike, so a row's result depends on the fixed partition edges alone. A short chunk over a long context can then be
// split by its keys (make_tasks), so the context is read once rather than once for each tile of its rows. 2,048
// rather than 1,024: the restarts cost a 4,096-token prompt's attention 4-5% at 1,024, 1-3% at 2,048
// (docs/benchmarks.md "Round 38").
constexpr int64_t PARTITION = 2048;

// A key-split sequence (make_tasks): partition p's partial of its chunk's vector m (row m / group, query head
// h * group + m % group) for KV head h sits at base + ((p * kv_heads + h) * vectors + m) * (D + 2): acc [D], max, sum;
// parts: the partitions of its last row (a row sees those up to its own position / PARTITION).
struct Split {
  int64_t seq, parts, base, vectors;
};

// Runs tasks[i] for every i, longest first, on all threads (a shared counter: dynamic scheduling).
template <typename F>
void run_tasks(const std::vector<Task>& tasks, F&& body) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) body(tasks[i]);
  });
}

// Portable kernel: any head_dim; per query vector, scores over its visible keys, softmax, weighted V.
template <typename q_t, typename kv_t>
void prefill_generic(const Layout<q_t, kv_t>& L, const std::vector<Task>& tasks, float scale) {
  const int64_t D = L.head_dim;
  int64_t max_len = 0;
  for (const Task& t : tasks) max_len = std::max<int64_t>(max_len, L.seq_lens[t.seq]);
  run_tasks(tasks, [&](const Task& t) {
    thread_local std::vector<float> q, acc, scores;
    q.resize(D), acc.resize(D), scores.resize(max_len);
    const int64_t len = L.seq_lens[t.seq];
    const int64_t start = L.starts[t.seq];
    const int64_t ctx0 = len - (L.starts[t.seq + 1] - start);
    for (int64_t r = t.row0; r < t.row0 + t.rows; ++r) {
      const int64_t visible = ctx0 + r + 1;
      for (int64_t g = 0; g < L.group; ++g) {
        const int64_t head = t.kv_head * L.group + g;
        const q_t* src = L.query_row(start + r, head);
        for (int64_t i = 0; i < D; ++i) q[i] = static_cast<float>(src[i]) * scale;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < visible; ++p) {
          const kv_t* k = L.key(t.seq, t.kv_head, p);
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < D; ++i) s += q[i] * to_float(k[i]);
          scores[p] = s * row_scale(k, D);
          m = std::max(m, scores[p]);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0.f;
        for (int64_t p = 0; p < visible; ++p) {
          const float w = std::exp(scores[p] - m);
          sum += w;
          const kv_t* v = L.key(t.seq, t.kv_head, p) + L.v_offset;
          const float wv = w * row_scale(v, D);
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) acc[i] += wv * to_float(v[i]);
        }
        q_t* dst = L.out_row(start + r, head);
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<q_t>(acc[i] / sum);
      }
    }
  });
}

#if defined(__AVX512F__)
// The vectorised kernels' per-task working set, in per-thread buffers: the task's rows x group query vectors,
// padded to a multiple of `pad` (the padding repeats the last row's position with a zero query: finite, never
// written out), each vector's key position, running max, sum and fp32 output, and one tile of K
// (transposed) and V.
template <typename qv_t>
struct TaskVectors {
  qv_t* q;
  float* acc;
  float* maxes;
  float* sums;
  float* kt;
  float* vb;
  int64_t* pos;
  int64_t start;    // the sequence's first row of query and out
  int64_t vectors;  // rows x group
  int64_t padded;   // vectors rounded up to `pad`
};

// Lays task t out for a kernel whose vectors hold D elements of qv_t: put(dst, src) stores the query vector
// src (nullptr for the zero padding) at dst. max_vectors bounds every task's padded vectors; tiles is the number of
// 64-key K/V tiles (kt, vb) the kernel holds at once.
template <int64_t D, typename qv_t, typename q_t, typename kv_t, typename Put>
TaskVectors<qv_t> task_vectors(const Layout<q_t, kv_t>& L, const Task& t, int64_t max_vectors, int64_t pad,
                               int64_t tiles, Put&& put) {
  thread_local std::vector<qv_t> q_buf;
  thread_local std::vector<float> acc_buf, max_buf, sum_buf, kt_buf, vb_buf;
  thread_local std::vector<int64_t> pos_buf;
  q_buf.resize(max_vectors * D), acc_buf.resize(max_vectors * D), max_buf.resize(max_vectors);
  sum_buf.resize(max_vectors), pos_buf.resize(max_vectors), kt_buf.resize(tiles * D * KEYS), vb_buf.resize(tiles * KEYS * D);
  const int64_t start = L.starts[t.seq], vectors = t.rows * L.group;
  TaskVectors<qv_t> v{q_buf.data(), acc_buf.data(), max_buf.data(), sum_buf.data(), kt_buf.data(),
                      vb_buf.data(),  pos_buf.data(), start,         vectors,        (vectors + pad - 1) / pad * pad};
  const int64_t ctx0 = L.seq_lens[t.seq] - (L.starts[t.seq + 1] - start);
  for (int64_t m = 0; m < v.padded; ++m) {
    const int64_t r = std::min(m, vectors - 1) / L.group;
    v.pos[m] = ctx0 + t.row0 + r;
    put(v.q + m * D, m < vectors ? L.query_row(start + t.row0 + r, t.kv_head * L.group + m % L.group) : nullptr);
    std::fill(v.acc + m * D, v.acc + m * D + D, 0.f);
    v.maxes[m] = -std::numeric_limits<float>::infinity();
    v.sums[m] = 0.f;
  }
  return v;
}

// An output row: acc / sum, rounded to the query's dtype.
template <int64_t D, typename q_t>
inline void write_row(q_t* dst, const float* acc, float sum) {
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<q_t>(acc[i] * inv);
}

// Every real vector's output row, from acc [vectors][D] and sums (the task's own by default).
template <int64_t D, typename qv_t, typename q_t, typename kv_t>
void write_task_out(const Layout<q_t, kv_t>& L, const Task& t, const TaskVectors<qv_t>& v, const float* acc = nullptr,
                    const float* sums = nullptr) {
  if (acc == nullptr) acc = v.acc, sums = v.sums;
  for (int64_t m = 0; m < v.vectors; ++m)
    write_row<D>(L.out_row(v.start + t.row0 + m / L.group, t.kv_head * L.group + m % L.group), acc + m * D, sums[m]);
}

// Merging a row's softmax state (max M, sum L, accumulators A [D]) with a partition's partial (m, l, a), as
// flash-decoding merges its splits (Dao et al., "Flash-Decoding for long-context inference", 2023):
//   M' = max(M, m),  L = L e^(M - M') + l e^(m - M'),  A = A e^(M - M') + a e^(m - M').
// A partition the row sees none of (m = -inf) leaves the state as it was. merge_factors takes 16 rows' (M, m) in its
// lanes and gives M', e^(M - M') and e^(m - M') (exp16 is lane for lane, so one row's are the same bits in any lane);
// L = fma(l, cb, L ca). Both callers (a task's own partitions in prefill_amx, merge_partials across key-split tasks)
// go through these, so their roundings are the same.
inline void merge_factors(__m512 M, __m512 m, __m512& top, __m512& ca, __m512& cb) {
  top = _mm512_max_ps(M, m);
  ca = exp16(_mm512_sub_ps(M, top));
  cb = exp16(_mm512_sub_ps(m, top));
}

template <int64_t D>
inline void merge_acc(float* A, const float* a, float ca, float cb) {
  const __m512 va = _mm512_set1_ps(ca), vb = _mm512_set1_ps(cb);
  for (int64_t i = 0; i < D; i += 16)
    _mm512_storeu_ps(A + i, _mm512_fmadd_ps(_mm512_loadu_ps(a + i), vb, _mm512_mul_ps(_mm512_loadu_ps(A + i), va)));
}

template <int64_t D>
inline void merge_partial(float& M, float& L, float* A, float m, float l, const float* a) {
  if (m == -std::numeric_limits<float>::infinity()) return;
  __m512 top, ca, cb;
  merge_factors(_mm512_set1_ps(M), _mm512_set1_ps(m), top, ca, cb);
  L = _mm512_cvtss_f32(_mm512_fmadd_ps(_mm512_set1_ps(l), cb, _mm512_mul_ps(_mm512_set1_ps(L), ca)));
  merge_acc<D>(A, a, _mm512_cvtss_f32(ca), _mm512_cvtss_f32(cb));
  M = _mm512_cvtss_f32(top);
}

// The out rows of every key-split sequence: each row's partials merged in partition order.
template <int64_t D, typename q_t, typename kv_t>
void merge_partials(const Layout<q_t, kv_t>& L, const std::vector<Split>& splits, const float* scratch,
                    int64_t kv_heads) {
  std::vector<std::pair<int64_t, int64_t>> rows;  // (split, row)
  for (size_t i = 0; i < splits.size(); ++i)
    for (int64_t r = 0; r < splits[i].vectors / L.group; ++r) rows.emplace_back(i, r);
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 8, [&](int64_t lo, int64_t hi) {
    alignas(64) float acc[D];
    for (int64_t i = lo; i < hi; ++i) {
      const Split& sp = splits[rows[i].first];
      const int64_t r = rows[i].second;
      // The row's position: its tile's tasks stored the partitions up to its own (and past it, never read).
      const int64_t pos = L.seq_lens[sp.seq] - sp.vectors / L.group + r;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t g = 0; g < L.group; ++g) {
          const int64_t m = r * L.group + g;
          auto slot = [&](int64_t p) { return scratch + sp.base + ((p * kv_heads + h) * sp.vectors + m) * (D + 2); };
          std::memcpy(acc, slot(0), D * sizeof(float));
          float max = slot(0)[D], sum = slot(0)[D + 1];
          for (int64_t p = 1; p <= pos / PARTITION; ++p)
            merge_partial<D>(max, sum, acc, slot(p)[D], slot(p)[D + 1], slot(p));
          write_row<D>(L.out_row(L.starts[sp.seq] + r, h * L.group + g), acc, sum);
        }
      }
    }
  });
}

// Scores of R query vectors (from q + m0 * D) against the first KN 16-key chunks of a tile (kt, see
// load_tile / load_tile_bf16), into s[i][0 .. KN): broadcast FMAs over d, no horizontal sums. DOT: bf16
// pairs through vdpbf16ps, then times the softmax scale (fp32 queries carry it already). Inlined into
// each case of the caller's switch, so s stays in registers.
template <int KN, int C, int R, bool DOT>
__attribute__((always_inline)) inline void tile_scores(__m512 (&s)[R][KC], const float* __restrict kt,
                                                       const float* __restrict q, int64_t m0, float scale) {
  constexpr int64_t D = 16 * C;
  if constexpr (DOT) {
#if defined(__AVX512BF16__)
    const int32_t* qw = reinterpret_cast<const int32_t*>(q);  // D / 2 dwords per vector
    for (int64_t e = 0; e < D / 2; ++e) {
      __m512bh kd[KN];
      for (int kc = 0; kc < KN; ++kc) kd[kc] = (__m512bh)_mm512_loadu_si512(kt + e * KEYS + 16 * kc);
      for (int i = 0; i < R; ++i) {
        const __m512bh qe = (__m512bh)_mm512_set1_epi32(qw[(m0 + i) * D + e]);  // vector stride D floats
        for (int kc = 0; kc < KN; ++kc) s[i][kc] = _mm512_dpbf16_ps(s[i][kc], qe, kd[kc]);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < R; ++i)
      for (int kc = 0; kc < KN; ++kc) s[i][kc] = _mm512_mul_ps(s[i][kc], sc);
#endif
  } else {
    for (int64_t d = 0; d < D; ++d) {
      __m512 kd[KN];
      for (int kc = 0; kc < KN; ++kc) kd[kc] = _mm512_loadu_ps(kt + d * KEYS + 16 * kc);
      for (int i = 0; i < R; ++i) {
        const __m512 qd = _mm512_set1_ps(q[(m0 + i) * D + d]);
        for (int kc = 0; kc < KN; ++kc) s[i][kc] = _mm512_fmadd_ps(qd, kd[kc], s[i][kc]);
      }
    }
  }
}

// The same contract for head_dim == 16 * C; R query vectors per register block. DOT (bf16 query and
// KV, AVX512-BF16): q.k and p.v as vdpbf16ps on bf16 pairs (two multiply-adds per lane and instruction),
// p rounded to bf16 as torch's bf16 attention rounds it; the softmax stays fp32.
template <int C, int R, bool DOT, typename q_t, typename kv_t>
void prefill_avx512(const Layout<q_t, kv_t>& L, const std::vector<Task>& tasks, int64_t max_rows, float scale) {
  constexpr int64_t D = 16 * C;
  const int64_t max_vectors = (max_rows * L.group + R - 1) / R * R;
  run_tasks(tasks, [&](const Task& t) {
    const TaskVectors<float> v = task_vectors<D, float>(L, t, max_vectors, R, 1, [&](float* dst, const q_t* src) {
      if (src == nullptr) {
        std::fill(dst, dst + D, 0.f);
      } else if constexpr (DOT) {
        std::memcpy(dst, src, D * sizeof(q_t));  // bf16 pairs as they are; the scale goes on the scores
      } else {
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<float>(src[i]) * scale;
      }
    });
    float* __restrict q = v.q;
    float* __restrict acc = v.acc;
    float* __restrict maxes = v.maxes;
    float* __restrict sums = v.sums;
    float* __restrict kt = v.kt;
    float* __restrict vb = v.vb;
    const int64_t* __restrict pos = v.pos;
    const int64_t padded = v.padded;
    const int64_t last = pos[padded - 1];
    alignas(64) float kscale[KEYS];
    for (int64_t k0 = 0; k0 <= last; k0 += KEYS) {
      const int64_t n = std::min<int64_t>(KEYS, last + 1 - k0);  // keys of this tile any vector may see
      if constexpr (DOT) {
#if defined(__AVX512BF16__)
        load_tile_bf16<C>(L, t.seq, t.kv_head, k0, n, kt, vb);
#endif
      } else {
        load_tile<C>(L, t.seq, t.kv_head, k0, n, kt, vb, kscale);
      }
      for (int64_t m0 = 0; m0 < padded; m0 += R) {
        if (pos[m0 + R - 1] < k0) continue;  // the whole group sits above this tile's diagonal
        // Keys of this tile that any vector of the group sees: the causal diagonal cuts the tile short for
        // the first rows of a task, and scores (and P.V pairs) past them would only be masked to zero.
        const int64_t seen = std::min<int64_t>(n, pos[m0 + R - 1] - k0 + 1);
        __m512 s[R][KC];
        for (int i = 0; i < R; ++i)
          for (int kc = 0; kc < KC; ++kc) s[i][kc] = _mm512_setzero_ps();
        switch ((seen + 15) / 16) {
          case 1: tile_scores<1, C, R, DOT>(s, kt, q, m0, scale); break;
          case 2: tile_scores<2, C, R, DOT>(s, kt, q, m0, scale); break;
          case 3: tile_scores<3, C, R, DOT>(s, kt, q, m0, scale); break;
          default: tile_scores<KC, C, R, DOT>(s, kt, q, m0, scale); break;
        }
        alignas(64) float p[R][KEYS];
        alignas(64) float m_old[16], m_new[16];
        float tile_sum[R] = {};
        for (int i = 0; i < R; ++i) {
          const int64_t visible = std::min<int64_t>(n, pos[m0 + i] - k0 + 1);
          m_old[i] = m_new[i] = maxes[m0 + i];
          if (visible <= 0) {  // the vector sees none of this tile: p = 0, alpha = e^0
            for (int kc = 0; kc < KC; ++kc) _mm512_store_ps(p[i] + 16 * kc, _mm512_setzero_ps());
            continue;
          }
          __mmask16 live[KC];
          __m512 tile_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (int kc = 0; kc < KC; ++kc) {
            live[kc] = lanes_below(visible - 16 * kc);
            if constexpr (is_quantized<kv_t>) s[i][kc] = _mm512_mul_ps(s[i][kc], _mm512_load_ps(kscale + 16 * kc));
            tile_max = _mm512_mask_max_ps(tile_max, live[kc], tile_max, s[i][kc]);
          }
          m_new[i] = std::max(m_old[i], _mm512_reduce_max_ps(tile_max));
          const __m512 mv = _mm512_set1_ps(m_new[i]);
          __m512 sum = _mm512_setzero_ps();
          for (int kc = 0; kc < KC; ++kc) {
            __m512 e = _mm512_maskz_mov_ps(live[kc], exp16(_mm512_sub_ps(s[i][kc], mv)));
            if constexpr (DOT) {
#if defined(__AVX512BF16__)
              // p as bf16, kept in the first half of p[i]; the sum counts the rounded weights.
              const __m256i pb = (__m256i)_mm512_cvtneps_pbh(e);
              _mm256_store_si256(reinterpret_cast<__m256i*>(p[i]) + kc, pb);
              e = bf16_widen16(pb);
#endif
            } else {
              _mm512_store_ps(p[i] + 16 * kc, e);
            }
            sum = _mm512_add_ps(sum, e);
          }
          tile_sum[i] = _mm512_reduce_add_ps(sum);
          maxes[m0 + i] = m_new[i];
        }
        // alpha_i = e^(m_old - m_new): 1 while the max holds, 0 on the first tile (m_old = -inf).
        const __mmask16 group_lanes = static_cast<__mmask16>((1u << R) - 1);
        alignas(64) float alpha[16];
        const __m512 diff = _mm512_sub_ps(_mm512_maskz_load_ps(group_lanes, m_old), _mm512_maskz_load_ps(group_lanes, m_new));
        _mm512_store_ps(alpha, exp16(diff));
        for (int i = 0; i < R; ++i)
          if (m_old[i] == -std::numeric_limits<float>::infinity()) alpha[i] = 0.f;
        for (int i = 0; i < R; ++i) sums[m0 + i] = sums[m0 + i] * alpha[i] + tile_sum[i];
        __m512 a[R][C];
        for (int i = 0; i < R; ++i) {
          const __m512 al = _mm512_set1_ps(alpha[i]);
          for (int c = 0; c < C; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (m0 + i) * D + 16 * c), al);
        }
        if constexpr (DOT) {
#if defined(__AVX512BF16__)
          for (int64_t jp = 0; jp < (seen + 1) / 2; ++jp) {
            __m512bh v[C];
            for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vb + jp * D + 16 * c);
            for (int i = 0; i < R; ++i) {
              const __m512bh w = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(p[i])[jp]);
              for (int c = 0; c < C; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], w, v[c]);
            }
          }
#endif
        } else {
          for (int64_t j = 0; j < seen; ++j) {
            __m512 v[C];
            for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vb + j * D + 16 * c);
            for (int i = 0; i < R; ++i) {
              const __m512 w = _mm512_set1_ps(p[i][j]);
              for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(w, v[c], a[i][c]);
            }
          }
        }
        for (int i = 0; i < R; ++i)
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (m0 + i) * D + 16 * c, a[i][c]);
      }
    }
    write_task_out<D>(L, t, v);
  });
}
#endif

#if defined(STREAMKV_AMX)
// bf16 query on bf16 KV on AMX tiles (tdpbf16ps): prefill_avx512's loop with its two products as tile
// products, 16 query vectors (one tile's rows) at a time, two such groups together wherever there are two; the
// online softmax between them stays AVX-512 fp32, its exponentials exp2_16 of the scores times scale * log2(e)
// (eight instructions a chunk with the fmsub, where it took fourteen; a 4,096-token prompt's attention 35-37 ->
// 30-33 ms a layer, docs/benchmarks.md "Round 35").
// The softmax runs over blocks of BLOCK = 512 keys (eight of load_tile_bf16's 64-key tiles), so a vector's
// per-block work (two horizontal reductions, the rescale factor's exp, the rescale of its accumulators)
// is paid once per 512 keys; at 64 keys it was a third of a long prompt's attention time. Taking the block max over
// the raw scores needs scale > 0; paged_prefill sends any other scale to prefill_avx512.
// A block's kt and vb (64 KiB each at head dim 64, 128 at 128) live in L2, and the tile loads of their B tiles
// bounded the tile products: so two groups of 16 vectors (G = 2) go through a block together wherever there are two,
// each B tile load feeding both (a 4,096-token prompt's attention 32.1 -> 29.0 ms a layer, the same bits; with
// make_tasks' larger tasks and the block max on four chains, 25-26 ms: docs/benchmarks.md "Round 36").
// Tiles, all 16 rows x 64 bytes, group g's in the second of each pair (G = 1: the first alone):
//   scores:  0, 1  S of group 0 [16 vectors x 16 keys] fp32, one or two 16-key chunks of a 64-key tile;  2, 3  group 1
//            4, 5  A: each group's bf16 queries, 32 dims (a row of 64 bytes; q_buf holds them end to end)
//            6, 7  B: kt's rows for 16 dim pairs x 16 keys (load_tile_bf16's layout is the tile's (k, k+1) pairs)
//            (at head dim 64, amx_scores_resident: 0-3 the groups' queries for the whole block, 4, 5 S, 6, 7 B)
//   P . V:   0, 1  group 0's fp32 sums for 32 dims, loaded from acc once a block and stored back;  2, 3  group 1
//            4, 5  A: each group's P [16 vectors x 32 keys] bf16, the rounded softmax weights
//            6, 7  B: vb's rows for 16 key pairs x 16 dims
// The same products as prefill_avx512's DOT path (bf16 pairs multiplied exactly, summed in fp32 in k order,
// p rounded to bf16 and the sum counting the rounded weights); tdpbf16ps treats denormal inputs and outputs as
// zero, as vdpbf16ps does. A vector's result depends only on its own row of each tile and on the block
// boundaries, which sit at fixed positions (0, 512, ...), so it is the same in any task split, batch and chunk.
// Key pairs past the block's last key are zeroed in vb before a P . V step can read them (their weights are 0,
// and 0 x NaN would not be). A row's softmax restarts at each PARTITION edge (2,048 keys: four blocks), its partitions
// merged in order by merge_partial in the task or, for a key-split task's one partition, by merge_partials after all
// tasks: a key split is again a fixed boundary, and the result the same in any split.
constexpr int SUBTILES = 8;                  // 64-key tiles per softmax block
constexpr int64_t BLOCK = SUBTILES * KEYS;   // keys per softmax block
constexpr int BLOCK_CHUNKS = BLOCK / 16;     // 16-key chunks per block
static_assert(PARTITION % BLOCK == 0, "a partition is whole softmax blocks");

// S [G * 16 vectors][NB * 16 keys] (row stride BLOCK floats; group g's queries at q + g * 16 * D, its scores at
// s + g * 16 * BLOCK) = q . kt for NB (1 or 2) 16-key chunks from kt, summed over the dim pairs in order from zero.
template <int G, int NB, int64_t D>
__attribute__((always_inline)) inline void amx_scores(const at::BFloat16* q, const float* kt, float* s) {
  constexpr int64_t V = 16;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (G > 1) _tile_zero(2);
  if constexpr (G > 1 && NB > 1) _tile_zero(3);
  for (int64_t t = 0; t < D / 32; ++t) {
    const float* b = kt + 16 * t * KEYS;  // dim pairs 16t .. 16t + 15
    _tile_loadd(4, q + 32 * t, D * 2);
    if constexpr (G > 1) _tile_loadd(5, q + V * D + 32 * t, D * 2);
    _tile_loadd(6, b, KEYS * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (G > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, b + 16, KEYS * 4);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (G > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, s, BLOCK * 4);
  if constexpr (NB > 1) _tile_stored(1, s + 16, BLOCK * 4);
  if constexpr (G > 1) _tile_stored(2, s + V * BLOCK, BLOCK * 4);
  if constexpr (G > 1 && NB > 1) _tile_stored(3, s + V * BLOCK + 16, BLOCK * 4);
}

// amx_scores over a block's first `seen` keys at head dim 64 (the same sums, bit for bit), with the G groups' queries
// loaded into tiles 0-3 (0-1 for G = 1) once per call, that is once per block and pair of groups, rather than once for
// each pair of chunks: a 16-key chunk then loads only kt's two B tiles from L2 (tiles 4, 5: each group's S; 6, 7: B).
// A 4,096-token prompt's attention 24.8-25.9 -> 22.9-23.1 ms a layer (docs/benchmarks.md "Round 37").
template <int G>
__attribute__((always_inline)) inline void amx_scores_resident(const at::BFloat16* q, const float* kt, float* s,
                                                               int64_t seen) {
  constexpr int64_t V = 16, D = 64;
  _tile_loadd(0, q, D * 2);
  _tile_loadd(1, q + 32, D * 2);
  if constexpr (G > 1) {
    _tile_loadd(2, q + V * D, D * 2);
    _tile_loadd(3, q + V * D + 32, D * 2);
  }
  const int64_t chunks = (seen + 15) / 16;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const float* b = kt + (ch / 4) * (D / 2) * KEYS + 16 * (ch % 4);
    _tile_zero(4);
    if constexpr (G > 1) _tile_zero(5);
    _tile_loadd(6, b, KEYS * 4);
    _tile_dpbf16ps(4, 0, 6);
    if constexpr (G > 1) _tile_dpbf16ps(5, 2, 6);
    _tile_loadd(7, b + 16 * KEYS, KEYS * 4);
    _tile_dpbf16ps(4, 1, 7);
    if constexpr (G > 1) _tile_dpbf16ps(5, 3, 7);
    _tile_stored(4, s + 16 * ch, BLOCK * 4);
    if constexpr (G > 1) _tile_stored(5, s + V * BLOCK + 16 * ch, BLOCK * 4);
  }
}

// acc [G * 16 vectors][D] += P [G * 16][BLOCK] bf16 (its first 32 * units keys) . vb (the first 16 * units key
// pairs), 32 dims a pass; group g's weights at p + g * 16 * BLOCK, its sums at acc + g * 16 * D. Each sum takes the
// key pairs in order.
template <int G, int64_t D>
__attribute__((always_inline)) inline void amx_pv(const uint16_t* p, const float* vb, int64_t units, float* acc) {
  constexpr int64_t V = 16;
  for (int64_t c0 = 0; c0 < D / 16; c0 += 2) {
    float* a = acc + 16 * c0;
    _tile_loadd(0, a, D * 4);
    _tile_loadd(1, a + 16, D * 4);
    if constexpr (G > 1) {
      _tile_loadd(2, a + V * D, D * 4);
      _tile_loadd(3, a + V * D + 16, D * 4);
    }
    for (int64_t u = 0; u < units; ++u) {
      const float* b = vb + 16 * u * D + 16 * c0;  // key pairs 16u .. 16u + 15, dims 16 c0 ..
      _tile_loadd(4, p + 32 * u, BLOCK * 2);
      if constexpr (G > 1) _tile_loadd(5, p + V * BLOCK + 32 * u, BLOCK * 2);
      _tile_loadd(6, b, D * 4);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (G > 1) _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, b + 16, D * 4);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (G > 1) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, a, D * 4);
    _tile_stored(1, a + 16, D * 4);
    if constexpr (G > 1) {
      _tile_stored(2, a + V * D, D * 4);
      _tile_stored(3, a + V * D + 16, D * 4);
    }
  }
}

template <int C>
void prefill_amx(const Layout<at::BFloat16, at::BFloat16>& L, const std::vector<Task>& tasks, int64_t max_rows,
                 float scale, float* scratch) {
  constexpr int64_t D = 16 * C;
  constexpr int64_t V = 16;  // query vectors per tile
  const int64_t max_vectors = (max_rows * L.group + V - 1) / V * V;
  run_tasks(tasks, [&](const Task& t) {
    const TaskVectors<at::BFloat16> v = task_vectors<D, at::BFloat16>(
        L, t, max_vectors, V, SUBTILES, [&](at::BFloat16* dst, const at::BFloat16* src) {
          if (src == nullptr)
            std::fill(dst, dst + D, at::BFloat16(0.f));
          else
            std::memcpy(dst, src, D * 2);
        });
    at::BFloat16* __restrict q = v.q;
    float* __restrict acc = v.acc;
    float* __restrict maxes = v.maxes;
    float* __restrict sums = v.sums;
    float* __restrict kt = v.kt;  // SUBTILES tiles of [D / 2][KEYS] dwords
    float* __restrict vb = v.vb;  // [BLOCK / 2][D] dwords: the tiles' key pairs end to end
    const int64_t* __restrict pos = v.pos;
    const int64_t padded = v.padded;
    // acc, maxes and sums hold the softmax state of the current partition's keys. At its end (PARTITION) a task that
    // reads every key merges them into its rows' running state (racc, rmax, rsum: the first partition copied, as the
    // merge into an empty state would give it; a task of one partition writes its rows from acc) and a key-split task
    // stores them in the scratch; then they restart.
    thread_local std::vector<float> run_buf;
    run_buf.resize(max_vectors * (D + 2));
    float* __restrict racc = run_buf.data();
    float* __restrict rmax = racc + max_vectors * D;
    float* __restrict rsum = rmax + max_vectors;
    bool first_partition = true;  // still true at the end: the task had one partition
    auto end_partition = [&](bool last_one) {
      if (t.partial >= 0) {
        for (int64_t m = 0; m < v.vectors; ++m) {
          float* slot = scratch + t.partial + m * (D + 2);
          std::memcpy(slot, acc + m * D, D * sizeof(float));
          slot[D] = maxes[m], slot[D + 1] = sums[m];
        }
        return;  // a key-split task's only partition
      }
      if (first_partition) {
        if (last_one) return;  // the one partition: acc and sums are the result
        std::memcpy(racc, acc, v.vectors * D * sizeof(float));
        std::memcpy(rmax, maxes, v.vectors * sizeof(float));
        std::memcpy(rsum, sums, v.vectors * sizeof(float));
      } else {  // merge_partial, 16 vectors' factors at a time (a NaN max is merged, as there)
        const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t m0 = 0; m0 < v.vectors; m0 += 16) {
          const __m512 m = _mm512_loadu_ps(maxes + m0);
          const __mmask16 k = lanes_below(v.vectors - m0) & _mm512_cmp_ps_mask(m, none, _CMP_NEQ_UQ);
          __m512 top, ca, cb;
          merge_factors(_mm512_loadu_ps(rmax + m0), m, top, ca, cb);
          const __m512 l =
              _mm512_fmadd_ps(_mm512_loadu_ps(sums + m0), cb, _mm512_mul_ps(_mm512_loadu_ps(rsum + m0), ca));
          _mm512_mask_storeu_ps(rsum + m0, k, l);
          _mm512_mask_storeu_ps(rmax + m0, k, top);
          alignas(64) float fa[16], fb[16];
          _mm512_store_ps(fa, ca), _mm512_store_ps(fb, cb);
          for (int i = 0; i < 16; ++i)
            if ((k >> i) & 1) merge_acc<D>(racc + (m0 + i) * D, acc + (m0 + i) * D, fa[i], fb[i]);
        }
      }
      first_partition = false;
      if (last_one) return;
      std::fill(acc, acc + padded * D, 0.f);
      std::fill(maxes, maxes + padded, -std::numeric_limits<float>::infinity());
      std::fill(sums, sums + padded, 0.f);
    };
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    load_tiles(cfg);
    const int64_t last = std::min(pos[padded - 1], t.k_end - 1);
    for (int64_t k0 = t.k_begin; k0 <= last; k0 += BLOCK) {
      const int64_t n = std::min<int64_t>(BLOCK, last + 1 - k0);  // keys of this block any vector may see
      for (int64_t j = 0; j * KEYS < n; ++j)
        load_tile_bf16<C>(L, t.seq, t.kv_head, k0 + j * KEYS, std::min<int64_t>(KEYS, n - j * KEYS),
                          kt + j * (D / 2) * KEYS, vb + j * (KEYS / 2) * D);
      const int64_t pairs_read = (n + 31) / 32 * 16;  // the key pairs P . V steps read
      std::fill(vb + (n + 1) / 2 * D, vb + pairs_read * D, 0.f);
      // The group's softmax (16 vectors from m0; their scores s, weights p): p, each vector's max and sum, and its
      // accumulators rescaled; p is 0 past each vector's last key up to chunk p_chunks (what the P . V steps read).
      auto softmax = [&](int64_t m0, const float* s, uint16_t* p, int p_chunks) {
        const __m512 sc = _mm512_set1_ps(scale * kLog2e);
        for (int64_t i = 0; i < V; ++i) {
          const int64_t visible = std::min<int64_t>(n, pos[m0 + i] - k0 + 1);
          // Chunks with a key the vector sees; past them (where s may not have been computed) p is 0.
          const int live_chunks = static_cast<int>(std::clamp<int64_t>((visible + 15) / 16, 0, BLOCK_CHUNKS));
          const float* si = s + i * BLOCK;
          uint16_t* pi = p + i * BLOCK;
          const float m_old = maxes[m0 + i];
          float alpha = 1.f, block_sum = 0.f;
          if (visible > 0) {  // else p = 0 and alpha = e^0: the vector sees none of this block
            // The max of the raw scores: times scale > 0 it is the max of the scaled ones (rounding is monotonic).
            // Four chains over runs of four whole chunks; the rest, the partial chunk last, on chain 0, masked (a max of
            // scores that are not NaN is the same in any order).
            const int whole = static_cast<int>(visible / 16);
            __m512 mx[4];
            for (__m512& x : mx) x = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            int kc = 0;
            for (; kc + 4 <= whole; kc += 4)
              for (int r = 0; r < 4; ++r) mx[r] = _mm512_max_ps(mx[r], _mm512_load_ps(si + 16 * (kc + r)));
            for (; kc < live_chunks; ++kc)
              mx[0] = _mm512_mask_max_ps(mx[0], lanes_below(visible - 16 * kc), mx[0], _mm512_load_ps(si + 16 * kc));
            const __m512 block_max = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
            const float m_new = std::max(m_old, _mm512_reduce_max_ps(block_max) * scale);
            // p = 2^(s scale log2(e) - m log2(e)) = e^(s scale - m) rounded to bf16; the sum counts the rounded
            // weights, two chunks at a time (vdpbf16ps with ones: each lane adds two weights to its running sum, in
            // a fixed order).
            const __m512 mv = _mm512_set1_ps(m_new * kLog2e);
            const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
            __m512 sum = _mm512_setzero_ps();
            auto weights = [&](int kc) {
              const __mmask16 live = lanes_below(visible - 16 * kc);
              const __m512 e = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(si + 16 * kc), sc, mv));
              const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(live, e));
              _mm256_store_si256(reinterpret_cast<__m256i*>(pi + 16 * kc), pb);
              return pb;
            };
            for (int kc = 0; kc < live_chunks; kc += 2) {
              const __m256i lo = weights(kc);
              const __m256i hi = kc + 1 < live_chunks ? weights(kc + 1) : _mm256_setzero_si256();
              sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), ones);
            }
            block_sum = _mm512_reduce_add_ps(sum);
            // alpha = e^(m_old - m_new): 1 while the max holds, 0 on the first block (m_old = -inf)
            alpha = m_old == -std::numeric_limits<float>::infinity()
                        ? 0.f
                        : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m_old - m_new)));
            maxes[m0 + i] = m_new;
          }
          for (int kc = live_chunks; kc < p_chunks; ++kc)
            _mm256_store_si256(reinterpret_cast<__m256i*>(pi + 16 * kc), _mm256_setzero_si256());
          sums[m0 + i] = sums[m0 + i] * alpha + block_sum;
          if (alpha != 1.f) {
            const __m512 al = _mm512_set1_ps(alpha);
            float* a = acc + (m0 + i) * D;
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), al));
          }
        }
      };
      alignas(64) float s[2 * V * BLOCK];
      alignas(64) uint16_t p[2 * V * BLOCK];
      for (int64_t m0 = 0; m0 < padded;) {
        if (pos[m0 + V - 1] < k0) {  // the whole group sits above this block's diagonal
          m0 += V;
          continue;
        }
        // Two groups at once where there are two (the second's keys are a superset of the first's): each K / V tile
        // load from L2 serves both. The first group's scores and weights past its own keys are computed or zeroed
        // for the second's sake and never change its sums: its weights there are 0, against the values of the
        // sequence's own later keys (finite; 0 x inf would be NaN, as between one group's rows before).
        const int64_t groups = m0 + 2 * V <= padded ? 2 : 1;
        const int64_t seen = std::min<int64_t>(n, pos[m0 + groups * V - 1] - k0 + 1);
        const at::BFloat16* qg = q + m0 * D;
        if constexpr (C == 4) {  // the groups' queries fit in four tiles: kept there for the block
          if (groups == 2)
            amx_scores_resident<2>(qg, kt, s, seen);
          else
            amx_scores_resident<1>(qg, kt, s, seen);
        } else {  // head dim 128: two groups' queries are eight tiles, loaded again for each pair of chunks
          for (int64_t j = 0; j * KEYS < seen; ++j) {
            const int chunks = static_cast<int>((std::min<int64_t>(KEYS, seen - j * KEYS) + 15) / 16);
            for (int c = 0; c < chunks; c += 2) {
              const float* ktc = kt + j * (D / 2) * KEYS + 16 * c;
              float* sj = s + j * KEYS + 16 * c;
              if (groups == 2)
                c + 1 < chunks ? amx_scores<2, 2, D>(qg, ktc, sj) : amx_scores<2, 1, D>(qg, ktc, sj);
              else
                c + 1 < chunks ? amx_scores<1, 2, D>(qg, ktc, sj) : amx_scores<1, 1, D>(qg, ktc, sj);
            }
          }
        }
        const int64_t units = (seen + 31) / 32;  // 32-key steps of P . V
        const int p_chunks = static_cast<int>(2 * units);  // the 16-key chunks of p they read
        for (int64_t g = 0; g < groups; ++g) softmax(m0 + g * V, s + g * V * BLOCK, p + g * V * BLOCK, p_chunks);
        if (groups == 2)
          amx_pv<2, D>(p, vb, units, acc + m0 * D);
        else
          amx_pv<1, D>(p, vb, units, acc + m0 * D);
        m0 += groups * V;
      }
      if (k0 + BLOCK > last || (k0 + BLOCK) % PARTITION == 0) end_partition(k0 + BLOCK > last);
    }
    _tile_release();
    if (t.partial < 0) write_task_out<D>(L, t, v, first_partition ? acc : racc, first_partition ? sums : rsum);
  });
}
#endif

#if defined(STREAMKV_AVX2_KV)
// AVX2, fp32 / bf16 / int8 / fp8 rows of head_dim == 8 * C, query group G (1-4): each query row attends as a decode
// query does in decode_avx2 (the G heads of a row share each 8-key load and reduce8, softmax8, pass 2 in register
// slices across the group; a quantized row's scale times its score or weight); the task's rows share its K/V rows,
// which stay in L1/L2 between rows.
template <int C, int G, typename q_t, typename kv_t>
void prefill_avx2(const Layout<q_t, kv_t>& L, const std::vector<Task>& tasks, float scale) {
  constexpr int64_t D = 8 * C;
  constexpr int S = std::max(1, std::min(C, 12 / G));
  int64_t max_len = 0;
  for (const Task& t : tasks) max_len = std::max<int64_t>(max_len, L.seq_lens[t.seq]);
  const int64_t stride = (max_len + 7) / 8 * 8 + 8;
  run_tasks(tasks, [&](const Task& t) {
    thread_local std::vector<float> scores;
    thread_local std::vector<const kv_t*> keys;
    scores.resize(G * stride);
    const int64_t len = L.seq_lens[t.seq];
    const int64_t start = L.starts[t.seq];
    const int64_t ctx0 = len - (L.starts[t.seq + 1] - start);
    const int64_t last = ctx0 + t.row0 + t.rows;  // keys the tile's last row sees
    keys.resize(last);
    for (int64_t p = 0; p < last; ++p) keys[p] = L.key(t.seq, t.kv_head, p);
    alignas(32) float q[G][D];
    for (int64_t r = t.row0; r < t.row0 + t.rows; ++r) {
      const int64_t visible = ctx0 + r + 1;
      for (int g = 0; g < G; ++g) {
        const q_t* src = L.query_row(start + r, t.kv_head * G + g);
        for (int64_t i = 0; i < D; ++i) q[g][i] = static_cast<float>(src[i]) * scale;
      }
      for (int64_t p0 = 0; p0 < visible; p0 += 8) {
        const int64_t m = std::min<int64_t>(8, visible - p0);
        // decode_avx2's pass 1: keys past m alias the last visible one (their scores, past `visible`, are never
        // read), and the 8 dot products advance side by side, 8 independent FMA chains.
        const kv_t* key[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) key[k] = keys[p0 + std::min<int64_t>(k, m - 1)];
        for (int g = 0; g < G; ++g) {
          __m256 part[8];
          const __m256 q0 = _mm256_load_ps(q[g]);
#pragma GCC unroll 8
          for (int k = 0; k < 8; ++k) part[k] = _mm256_mul_ps(q0, load8(key[k]));
#pragma GCC unroll 8
          for (int c = 1; c < C; ++c) {
            const __m256 qc = _mm256_load_ps(q[g] + 8 * c);
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k) part[k] = _mm256_fmadd_ps(qc, load8(key[k] + 8 * c), part[k]);
          }
          __m256 sc = reduce8(part);
          if constexpr (is_quantized<kv_t>) sc = _mm256_mul_ps(sc, row_scales8(key, D));
          _mm256_storeu_ps(&scores[g * stride + p0], sc);
        }
      }
      float inv_sum[G];
      for (int g = 0; g < G; ++g) inv_sum[g] = softmax8(&scores[g * stride], visible);
      for (int c0 = 0; c0 < C; c0 += S) {
        const int w = std::min(S, C - c0);
        __m256 a[G][S];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < S; ++c) a[g][c] = _mm256_setzero_ps();
        for (int64_t p = 0; p < visible; ++p) {
          const kv_t* v = keys[p] + L.v_offset + 8 * c0;
          const float vs = row_scale(keys[p] + L.v_offset, D);  // 1 for unquantized rows
          __m256 vr[S];
          for (int c = 0; c < S; ++c) vr[c] = c < w ? load8(v + 8 * c) : _mm256_setzero_ps();
          for (int g = 0; g < G; ++g) {
            const __m256 wt = _mm256_set1_ps(scores[g * stride + p] * vs);
            for (int c = 0; c < S; ++c) a[g][c] = _mm256_fmadd_ps(wt, vr[c], a[g][c]);
          }
        }
        for (int g = 0; g < G; ++g) {
          q_t* dst = L.out_row(start + r, t.kv_head * G + g) + 8 * c0;
          alignas(32) float o[8 * S];
          for (int c = 0; c < w; ++c) _mm256_store_ps(o + 8 * c, _mm256_mul_ps(a[g][c], _mm256_set1_ps(inv_sum[g])));
          for (int64_t i = 0; i < 8 * w; ++i) dst[i] = static_cast<q_t>(o[i]);
        }
      }
    }
  });
}
#endif

// Calls f(b, ctx0, r0, rows) for each tile of up to `tile` query rows of every sequence with query_len > 1 (ctx0: the
// tokens cached before its chunk); a sequence's tiles are of equal size (100 rows in tiles of 64: 50 + 50, not 64 + 36).
template <typename F>
void for_each_tile(const int32_t* starts, const int32_t* lens, int64_t num_seqs, int64_t tile, F&& f) {
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    if (q_len <= 1) continue;
    const int64_t num_tiles = (q_len + tile - 1) / tile;
    const int64_t even = (q_len + num_tiles - 1) / num_tiles;
    for (int64_t r0 = 0; r0 < q_len; r0 += even) f(b, lens[b] - q_len, r0, std::min(even, q_len - r0));
  }
}

struct TaskPlan {
  std::vector<Task> tasks;
  int64_t max_rows = 0;
  std::vector<Split> splits;  // the key-split sequences
  int64_t scratch = 0;        // floats of their partials
};

// Tiles of query rows: up to 256, as large as keeps every thread busy (a K/V tile load serves rows x G vectors, and
// each task lays out every K/V tile up to its last row anew; 64 rows against 32: bf16 32 x 128 tokens 1.95 -> 1.73 ms
// a layer, fp32 3.6 -> 3.4, docs/benchmarks.md "Round 17"; 256 against 64: a 4,096-token prompt on AMX tiles 29.0 ->
// 27.3 ms, in fp32 96 -> 88, "Round 36"). Each task reads its whole context from the pool, so a short chunk over a
// long context split into many tasks reads it many times: 2 tasks a thread, not 4, took a follow-up turn of 30 / 100
// tokens over 4,000 cached ones 1.0 -> 0.66 / 1.7 -> 1.4 ms a layer on AMX tiles, and fp32 2.4 -> 2.1 / 5.5 -> 5.0
// ("Round 37"); 1 a thread was slower in fp32, whose tasks are compute-bound.
// key_split (the kernel is prefill_amx): a chunk of up to MAX_TILE rows over more than a partition, which the tiles of
// rows alone would split, may be split by its keys as well (below). slot: floats of one vector's partial (D + 2).
TaskPlan make_tasks(const int32_t* starts, const int32_t* lens, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                    bool key_split, int64_t slot) {
  constexpr int64_t MAX_TILE = 256;
  constexpr int64_t MAX_SCRATCH = int64_t{16} << 20;  // floats of partials (64 MiB)
  const int64_t threads = at::get_num_threads();
  TaskPlan plan;
  std::vector<int64_t> split_of(num_seqs, -1);  // index into plan.splits
  // f(task without its KV head) for every task of the tiles of up to `tile` rows.
  auto each_task = [&](int64_t tile, auto&& f) {
    for_each_tile(starts, lens, num_seqs, tile, [&](int64_t b, int64_t ctx0, int64_t r0, int64_t rows) {
      const int64_t seen = ctx0 + r0 + rows;  // keys the tile's last row sees
      if (split_of[b] < 0) return f(Task{b, 0, r0, rows, seen * rows});
      const Split& sp = plan.splits[split_of[b]];
      for (int64_t k_begin = 0, p = 0; k_begin < seen; k_begin += PARTITION, ++p) {
        const int64_t k_end = std::min(seen, k_begin + PARTITION);
        f(Task{b, 0, r0, rows, (k_end - k_begin) * rows, k_begin, k_end,
               sp.base + (p * num_kv_heads * sp.vectors + r0 * group) * slot});
      }
    });
  };
  // Halved while threads would wait on each other: fewer than 2 tasks a thread, or one task costlier than a
  // thread's share of the batch (a long prompt beside many short ones, on many threads).
  auto choose_tile = [&]() {
    int64_t tile = MAX_TILE;
    for (; tile > 4; tile /= 2) {
      int64_t n = 0, largest = 0, total = 0;
      each_task(tile, [&](const Task& t) {
        n += num_kv_heads;
        largest = std::max(largest, t.cost);
        total += t.cost * num_kv_heads;
      });
      if (n >= 2 * threads && largest * threads <= total) break;
    }
    return tile;
  };
  // The threads' finish time of the tasks of a tile size, longest first onto the least loaded thread as run_tasks
  // takes them, a task costing its keys x (rows + READ_ROWS): reading and laying out a key costs about as much as
  // scoring and weighing it for 8 rows of 3 query heads (the follow-up turns of docs/benchmarks.md "Round 38").
  constexpr int64_t READ_ROWS = 8;
  auto finish = [&](int64_t size) {
    std::vector<int64_t> costs;
    each_task(size, [&](const Task& t) {
      costs.insert(costs.end(), num_kv_heads, t.cost / t.rows * (t.rows + READ_ROWS));  // cost: keys x rows
    });
    std::sort(costs.begin(), costs.end(), std::greater<>());
    std::vector<int64_t> load(threads, 0);
    for (int64_t c : costs) *std::min_element(load.begin(), load.end()) += c;
    return *std::max_element(load.begin(), load.end());
  };
  int64_t tile = choose_tile();
  // A chunk of up to MAX_TILE rows that the tiles split (each tile reading its whole context) over more than a
  // partition is split by keys too, a task for each (KV head, tile, partition the tile's last row sees), where that
  // finishes sooner: a partition of a few keys beside a whole one can leave a thread waiting longer than a second read
  // costs. A 30-token follow-up turn over 4,000 cached tokens 0.57 -> 0.46 ms a layer, over 8,000 1.30 -> 0.96
  // (bf16 on AMX tiles, docs/benchmarks.md "Round 38").
  int64_t rows_only = -1;  // the finish time without a key split, once there is a chunk to split
  for (int64_t b = 0; key_split && b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    if (q_len <= tile || q_len > MAX_TILE || lens[b] <= PARTITION) continue;
    const Split sp{b, (lens[b] + PARTITION - 1) / PARTITION, plan.scratch, q_len * group};
    if (plan.scratch + sp.parts * num_kv_heads * sp.vectors * slot > MAX_SCRATCH) continue;
    if (rows_only < 0) rows_only = finish(tile);
    split_of[b] = static_cast<int64_t>(plan.splits.size());
    plan.splits.push_back(sp);
    plan.scratch += sp.parts * num_kv_heads * sp.vectors * slot;
  }
  if (!plan.splits.empty()) {
    const int64_t split_tile = choose_tile();
    if (finish(split_tile) < rows_only) {
      tile = split_tile;
    } else {
      std::fill(split_of.begin(), split_of.end(), -1);
      plan.splits.clear(), plan.scratch = 0;
    }
  }
  each_task(tile, [&](const Task& t) {
    plan.max_rows = std::max(plan.max_rows, t.rows);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      Task task = t;
      task.kv_head = h;
      if (task.partial >= 0) task.partial += h * plan.splits[split_of[t.seq]].vectors * slot;
      plan.tasks.push_back(task);
    }
  });
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return plan;
}

}  // namespace

// out[t, Hq, D] for the rows t of every sequence with query_len > 1: causal attention to its context.
void paged_prefill(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_tables,
                   at::Tensor seq_lens, at::Tensor query_start_loc, double scale) {
  check_query_and_cache(out, query, kv_cache);
  const auto kv_type = kv_cache.scalar_type();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, seq_lens and query_start_loc must be int32");
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) == num_seqs,
              "block_tables must be [B, max_blocks] with unit last stride");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous(), "seq_lens must be a contiguous [B]");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() && query_start_loc.numel() == num_seqs + 1,
              "query_start_loc must be a contiguous [B + 1]");
  TORCH_CHECK(!query.is_cuda() && !kv_cache.is_cuda() && !block_tables.is_cuda(), "CPU tensors only");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t block_size = kv_cache.size(2), num_blocks = kv_cache.size(1);
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0), "query_start_loc must run from 0 to T");
  // Every block a kernel will read, checked once here: a bad table is an error, not a wild read.
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 1 && q_len <= lens[b], "sequence ", b, ": query length ", q_len, " not in 1..seq_len (",
                lens[b], ")");
    if (q_len == 1) continue;
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(used <= block_tables.size(1), "sequence ", b, ": block table too short for ", lens[b], " tokens");
    for (int64_t i = 0; i < used; ++i) {
      const int32_t id = tables[b * block_tables.stride(0) + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", b, ": block id ", id, " outside the pool");
    }
  }
  const float s = static_cast<float>(scale);
  const int64_t head_dim = query.size(2), kv_heads = kv_cache.size(3);
  // prefill_amx's case below: the one kernel that splits a chunk by its keys.
  bool amx_kernel = false;
#if defined(STREAMKV_AMX) && defined(__AVX512BF16__)
  amx_kernel = query.scalar_type() == at::kBFloat16 && kv_type == at::kBFloat16 && amx_on() && s > 0 &&
               (head_dim == 64 || head_dim == 128);
#endif
  const TaskPlan plan =
      make_tasks(starts, lens, num_seqs, kv_heads, query.size(1) / kv_heads, amx_kernel, head_dim + 2);
  const std::vector<Task>& tasks = plan.tasks;
  const int64_t max_rows = plan.max_rows;
  if (tasks.empty()) return;
  dispatch_dtypes(query.scalar_type(), kv_type, [&]<typename q_t, typename kv_t>() {
    const Layout<q_t, kv_t> layout(out, query, kv_cache, block_tables, seq_lens, query_start_loc);
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
    constexpr bool dot = std::is_same_v<q_t, at::BFloat16> && std::is_same_v<kv_t, at::BFloat16>;
#else
    constexpr bool dot = false;
#endif
#if defined(STREAMKV_AMX)
    if constexpr (dot) {
      if (amx_kernel) {
        const std::unique_ptr<float[]> partials(new float[plan.scratch]);  // not zeroed: every slot read is written
        float* scratch = partials.get();
        if (head_dim == 64) {
          prefill_amx<4>(layout, tasks, max_rows, s, scratch);
          merge_partials<64>(layout, plan.splits, scratch, kv_heads);
        } else {
          prefill_amx<8>(layout, tasks, max_rows, s, scratch);
          merge_partials<128>(layout, plan.splits, scratch, kv_heads);
        }
        return;
      }
    }
#endif
    // Head dim 64, fp32 products: 6 query vectors a register block (24 accumulators in both products, two rows of a
    // 3-head group), where 4 left the FMAs waiting on loads. On the 2-core Zen 4 (op alone, taking turns) 32 x
    // 128-token prompts ran 6.9 -> 5.2 ms a layer, one 4,096-token prompt 152 -> 108, 8 x 64 rows over 1,000 cached
    // tokens 10.1 -> 7.2; in the engine, the fp32 prefill of one 4,096-token prompt 9.4 -> 7.7 s. The bits do not
    // change: each vector's sums run over d and over keys in the same order whatever the block. bf16 (vdpbf16ps)
    // stays at 4: 6 was level there, within noise either way (docs/benchmarks.md "Round 45").
    switch (query.size(2)) {
      case 64: return prefill_avx512<4, dot ? 4 : 6, dot, q_t, kv_t>(layout, tasks, max_rows, s);
      case 128: return prefill_avx512<8, 2, dot, q_t, kv_t>(layout, tasks, max_rows, s);
      default: break;
    }
#endif
#if defined(STREAMKV_AVX2_KV)
    // fp32 / bf16 rows, and int8 / fp8 rows under fp32 queries (an AVX2 model computes in fp32), as paged_decode.
    if constexpr (!is_quantized<kv_t> || std::is_same_v<q_t, float>) {
      auto avx2 = [&]<int C>() {
        switch (layout.group) {
          case 1: prefill_avx2<C, 1, q_t, kv_t>(layout, tasks, s); return true;
          case 2: prefill_avx2<C, 2, q_t, kv_t>(layout, tasks, s); return true;
          case 3: prefill_avx2<C, 3, q_t, kv_t>(layout, tasks, s); return true;
          case 4: prefill_avx2<C, 4, q_t, kv_t>(layout, tasks, s); return true;
          default: return false;
        }
      };
      if (query.size(2) == 64 && avx2.template operator()<8>()) return;
      if (query.size(2) == 128 && avx2.template operator()<16>()) return;
    }
#endif
    prefill_generic<q_t, kv_t>(layout, tasks, s);
  });
}
