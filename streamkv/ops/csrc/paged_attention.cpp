// Paged decode attention on the CPU: reads K/V in place through the block table.
//
// One task per (sequence, KV head): its G = Hq / Hkv query heads share the
// task, so every K and V row is read once from the pool and used G times.
// (The bf16 and AVX2 kernels give a task all of a sequence's KV heads once the
// batch has kTasksPerThread sequences a thread: see decode_avx512_bf16_seqs.)
// Each thread takes a contiguous run of tasks holding an equal share of the
// batch's tokens (work_split.h), not an equal count of them.
// Two passes over the context (scores, then the weighted sum of V) keep the
// scores of one task in a thread-local float buffer; for this engine's
// contexts (<= a few thousand tokens) that buffer stays in L2.
// bf16 queries on bf16 KV take pass 1 on AMX tiles where the extension's AMX
// switch is on, a block holds whole runs of 16 keys and the query group is at
// most 16 (amx_decode, amx_score_run16), both bf16 kernels alike.
//
//   kv_cache [2, num_blocks, block_size, Hkv, R]   (contiguous)
//     fp32 / bf16:   R = D, the row is the values
//     int8 / fp8:    R = D + 4, the row is D codes then a float32 scale (streamkv/attention/kv_layout.py);
//                    x = code * scale, applied once per row: to q . k after the dot, to p before the axpy
//   token p of sequence b: block block_tables[b, p / block_size], offset p % block_size
//
// Everything accumulates in fp32, whatever the cache dtype.

#include <ATen/Parallel.h>

#include "amx.h"
#include "kv_row.h"
#include "ops.h"
#include "work_split.h"
#include "simd_math.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// A task's cost in the split between threads: its tokens, plus what a task costs beyond them (its queries, the
// softmax's end, its output), counted as one block's tokens.
constexpr int64_t kTaskCostTokens = 16;

// parallel_for_by_cost's cost of task t when each task is one (sequence, KV head): the sequence's tokens, and
// kTaskCostTokens.
inline auto seq_head_cost(const int32_t* lens, int64_t num_kv_heads) {
  return [lens, num_kv_heads](int64_t t) { return std::max<int64_t>(lens[t / num_kv_heads], 0) + kTaskCostTokens; };
}

using namespace streamkv;

template <typename kv_t>
inline float dot(const float* q, const kv_t* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <typename kv_t>
inline void axpy(float a, const kv_t* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * to_float(v[i]);
}

// Portable kernel: any head_dim, auto-vectorised loops, std::exp.
template <typename q_t, typename kv_t>
void decode_generic(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_stride_s = query.stride(0), q_stride_h = query.stride(1);
  const int64_t o_stride_s = out.stride(0), o_stride_h = out.stride(1);
  const int64_t bt_stride = block_tables.stride(0);
  const int64_t row = kv_cache.size(4);                         // D, or D + 4 with a scale
  const int64_t slot_stride = num_kv_heads * row;               // one slot's rows of all heads
  const int64_t block_stride = block_size * slot_stride;
  const int64_t v_offset = kv_cache.stride(0);                  // K and V halves

  const q_t* q_ptr = query.data_ptr<q_t>();
  q_t* o_ptr = out.data_ptr<q_t>();
  const kv_t* kv_ptr = kv_cache.data_ptr<kv_t>();
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* len_ptr = seq_lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < num_seqs; ++b) max_len = std::max<int64_t>(max_len, len_ptr[b]);

  parallel_for_by_cost(num_seqs * num_kv_heads, seq_head_cost(len_ptr, num_kv_heads), [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores(group * max_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = len_ptr[b];
      const int32_t* table = bt_ptr + b * bt_stride;
      for (int64_t g = 0; g < group; ++g) {
        const q_t* src = q_ptr + b * q_stride_s + (h * group + g) * q_stride_h;
        for (int64_t i = 0; i < head_dim; ++i) q[g * head_dim + i] = static_cast<float>(src[i]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // Pass 1: scores[g, p] = q_g . k_p
      for (int64_t p = 0; p < len; ++p) {
        const kv_t* k = kv_ptr + table[p / block_size] * block_stride + (p % block_size) * slot_stride + h * row;
        const float ks = row_scale(k, head_dim);
        for (int64_t g = 0; g < group; ++g) scores[g * max_len + p] = dot(&q[g * head_dim], k, head_dim) * ks;
      }
      // Softmax per query head (max-subtracted, fp32).
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * max_len];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < len; ++p) m = std::max(m, s[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - m);
          sum += s[p];
        }
        inv_sum[g] = 1.f / sum;
      }
      // Pass 2: acc_g = sum_p softmax_gp v_p
      for (int64_t p = 0; p < len; ++p) {
        const kv_t* v =
            kv_ptr + v_offset + table[p / block_size] * block_stride + (p % block_size) * slot_stride + h * row;
        const float vs = row_scale(v, head_dim);
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * max_len + p] * vs, v, &acc[g * head_dim], head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        q_t* dst = o_ptr + b * o_stride_s + (h * group + g) * o_stride_h;
        for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<q_t>(acc[g * head_dim + i] * inv_sum[g]);
      }
    }
  });
}

#if defined(__AVX512F__)
// The horizontal sums of 16 vectors in one vector: lane k of the result is the sum of v[reduce_slot(k)]'s lanes,
// so a caller that puts key k's partial dot products in v[reduce_slot(k)] gets key k's score in lane k.
// Four rounds of shuffles and adds (15 adds) instead of 16 separate horizontal reductions.
constexpr int reduce_slot(int k) { return 4 * (k % 4) + k / 4; }

// Add is _mm512_add_ps for float partials, or an int32 add on the same bits (reduce16i).
template <typename Add>
inline __m512 reduce16_with(__m512 v[16], Add add) {
  __m512 r[8], s[4], t[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0-1 keep v[2i]'s partials, lanes 2-3 v[2i+1]'s
    r[i] = add(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  for (int i = 0; i < 4; ++i)  // lane k holds 4 partials of v[4i + k]
    s[i] = add(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88), _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xdd));
  for (int i = 0; i < 2; ++i) t[i] = add(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  const __m512d a = _mm512_castps_pd(t[0]), b = _mm512_castps_pd(t[1]);
  return add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

inline __m512 reduce16(__m512 v[16]) {
  return reduce16_with(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// reduce16 of int32 partials (exact): lane k of the result is the sum of v[reduce_slot(k)]'s lanes.
inline __m512i reduce16i(__m512i v[16]) {
  __m512 f[16];
  for (int i = 0; i < 16; ++i) f[i] = _mm512_castsi512_ps(v[i]);
  return _mm512_castps_si512(reduce16_with(f, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
}

// The lanes of scores [p, p + 16) that hold one of a sequence's len tokens.
inline __mmask16 live_lanes(int64_t len, int64_t p) {
  return len - p >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - p)) - 1);
}

// max of scores[0, len), the softmax's shift.
inline float masked_max(const float* s, int64_t len) {
  __m512 m16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p < len; p += 16) {
    const __mmask16 live = live_lanes(len, p);
    m16 = _mm512_mask_max_ps(m16, live, m16, _mm512_maskz_loadu_ps(live, s + p));
  }
  return _mm512_reduce_max_ps(m16);
}
#endif

#if defined(__AVX512F__) || defined(STREAMKV_AVX2_KV)
// Pass 1's walk over one KV head's keys: block by block in table order, in runs of up to 16 keys of one block.
// body(base, k0, n, p0) gets the block's row at slot 0, the run's first slot in it, the run's length and its
// first key's position; scores past p0 + n are scratch, overwritten by the next run or never read.
template <typename View, typename BlockRow, typename Body>
inline void for_each_key_run(const View& d, BlockRow block_row, int64_t num_blocks, int64_t len, Body&& body) {
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t block_len = std::min(d.block_size, len - j * d.block_size);
    for (int64_t k0 = 0; k0 < block_len; k0 += 16)
      body(block_row(j), k0, std::min<int64_t>(16, block_len - k0), j * d.block_size + k0);
  }
}

#if defined(__AVX512F__)
// 16 output values: fp32 as they are; bf16 rounded to nearest even as c10::BFloat16 rounds a float (a NaN becomes
// 0x7FC0, denormals kept), so the bits are those of the scalar conversion this replaced.
inline void store16(float* dst, __m512 x) { _mm512_storeu_ps(dst, x); }
inline void store16(at::BFloat16* dst, __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i bias =
      _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}

// Pass 2's accumulators back in head-dim order: lane 4L + i of vector 2w holds head dim 32w + 8L + i, of vector
// 2w + 1 dim 32w + 8L + 4 + i (i < 4), as vpunpck[lh]wd of two rows leaves them; two two-source permutes a pair.
template <int W, typename q_t>
inline void store_deinterleaved(q_t* dst, const __m512* v) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int w = 0; w < W; ++w) {
    store16(dst + 32 * w, _mm512_permutex2var_ps(v[2 * w], lo, v[2 * w + 1]));
    store16(dst + 32 * w + 16, _mm512_permutex2var_ps(v[2 * w], hi, v[2 * w + 1]));
  }
}
#endif

// A task's vectors of its G query heads: an array when the group size G is a template constant (the loops over
// the group unroll and the compiler keeps the vectors in registers), a heap array when G == 0 (any group, the
// loops' bound read at run time). With the group a run-time bound, pass 2 stored and reloaded every accumulator
// at each token: fp32 B=64 steps 10.3 -> 8.4 ms with one layer in cache (docs/benchmarks.md, "Decode attention:
// one row ahead at a time").
template <typename T, int N>
struct HeadVectors {
  explicit HeadVectors(int64_t) {}
  T& operator[](int64_t i) { return v[i]; }
  T v[N];
};
template <typename T>
struct HeadVectors<T, 0> {
  explicit HeadVectors(int64_t n) : v(n) {}
  T& operator[](int64_t i) { return v[i]; }
  std::vector<T> v;
};

// The sizes, strides and pointers the AVX-512 decode kernels read from their arguments, and the scores'
// per-head stride (max_len rounded up to 16, plus 16 lanes of scratch).
template <typename q_t, typename kv_t>
struct DecodeView {
  int64_t num_seqs, num_heads, block_size, num_kv_heads, group, q_stride_s, q_stride_h, o_stride_s, o_stride_h,
      bt_stride, row, row_bytes, slot_stride, block_stride, v_offset, max_len, padded_len;
  const q_t* q_ptr;
  q_t* o_ptr;
  const kv_t* kv_ptr;
  const int32_t* bt_ptr;
  const int32_t* len_ptr;

  DecodeView(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
             const at::Tensor& seq_lens)
      : num_seqs(query.size(0)), num_heads(query.size(1)), block_size(kv_cache.size(2)),
        num_kv_heads(kv_cache.size(3)), group(num_heads / num_kv_heads), q_stride_s(query.stride(0)),
        q_stride_h(query.stride(1)), o_stride_s(out.stride(0)), o_stride_h(out.stride(1)),
        bt_stride(block_tables.stride(0)), row(kv_cache.size(4)), row_bytes(row * static_cast<int64_t>(sizeof(kv_t))),
        slot_stride(num_kv_heads * row), block_stride(block_size * slot_stride), v_offset(kv_cache.stride(0)),
        q_ptr(query.data_ptr<q_t>()), o_ptr(out.data_ptr<q_t>()), kv_ptr(kv_cache.data_ptr<kv_t>()),
        bt_ptr(block_tables.data_ptr<int32_t>()), len_ptr(seq_lens.data_ptr<int32_t>()) {
    max_len = 0;
    for (int64_t b = 0; b < num_seqs; ++b) max_len = std::max<int64_t>(max_len, len_ptr[b]);
    padded_len = (max_len + 15) / 16 * 16 + 16;
  }
};

// Asks for one K or V row (its cache lines) ahead of its use, into L2 (prefetcht2), for every RowsAhead cursor
// (decode_avx512, the one-task-per-head bf16 and int8 kernels), decode_avx2, and the spans of the bf16 and int8
// batch kernels (decode_avx512_bf16_seqs, decode_avx512_int8_seqs). On the Intel hosts the hints T0,
// T1, T2 and NTA timed the same; on Zen 4 (AMD EPYC, 2 threads, 30 layers' pools from memory) prefetcht0 held the
// core's few L1 miss buffers and fp32 rows ran at 17 GB/s: B=32 x 160 tokens 13.3-13.7 -> 8.0-8.3 ms, B=64 x 160
// 27.8 -> 13.4-16.3, 32 x 1,000 84-89 -> 42-56 (docs/benchmarks.md, "Round 42"), as decode_avx512_bf16_seqs found
// for its spans on the Intel AMX host. The prefetch is a volatile asm, not _mm_prefetch: GCC counts a prefetch
// builtin as no side effect, so a lambda that only asks ahead is found pure and every call to it deleted (gcc 12
// -O3 dropped all of decode_avx2's prefetches).
template <typename kv_t>
inline void prefetch_row(const kv_t* row, int64_t row_bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < row_bytes; off += 64) asm volatile("prefetcht2 %0" : : "m"(p[off]));
}

// How many rows ahead of its use a row is asked for (two blocks of 16): 16 was slower on fp32 and bf16 B=64
// steps, 48 and 64 no faster.
constexpr int64_t kRowsAhead = 32;

// The rows a thread's tasks read, in the order they read them (task t's K rows in table order, then its V rows,
// then task t + 1's), each asked for kRowsAhead rows before its use: step() asks for the row at the cursor and
// moves the cursor on by one, and a kernel calls it once for each row it takes. A head's rows are strided by the
// other heads' rows and the next block sits anywhere in the pool, so the hardware prefetcher cannot follow them;
// asking for whole blocks at block boundaries (64 lines of fp32 at once, as this kernel did) filled the core's
// miss buffers and stalled the compute behind them, and left the first rows of every pass and task unasked.
// One row a step keeps the misses in flight level (docs/benchmarks.md, "Decode attention: one row ahead at a time").
template <typename View>
struct RowsAhead {
  using kv_t = std::remove_const_t<std::remove_pointer_t<decltype(View::kv_ptr)>>;
  const View& d;
  int64_t task, end;  // the cursor's task, and the end of the thread's tasks
  int64_t half = 0, block = 0, slot = 0, pos = 0, len = 0, head = 0;
  const int32_t* table = nullptr;
  const kv_t* row = nullptr;  // the cursor's row

  RowsAhead(const View& view, int64_t begin, int64_t stop) : d(view), task(begin), end(stop) {
    enter();
    for (int64_t i = 0; i < kRowsAhead; ++i) step();
  }
  void enter() {  // the cursor at the first row of its task; tasks without rows are skipped
    for (; task < end; ++task) {
      const int64_t b = task / d.num_kv_heads;
      head = task % d.num_kv_heads;
      len = d.len_ptr[b];
      table = d.bt_ptr + b * d.bt_stride;
      if (len > 0) break;
    }
    block_start();
  }
  void block_start() {
    if (task < end) row = d.kv_ptr + half * d.v_offset + table[block] * d.block_stride + head * d.row;
  }
  void step() {
    if (task >= end) return;
    prefetch_row(row, d.row_bytes);
    if (++pos == len) {
      pos = block = slot = 0;
      if (++half == 2) {
        half = 0;
        ++task;
        enter();
      } else {
        block_start();
      }
    } else if (++slot == d.block_size) {
      slot = 0;
      ++block;
      block_start();
    } else {
      row += d.slot_stride;
    }
  }
};

// The V rows of one KV head two tokens at a time, in the order of the block table: next(p) gives token p's row
// (nullptr past the last token), a step of the thread's RowsAhead for each row it gives.
template <typename kv_t, typename BlockRow, typename Ahead>
struct TokenPairs {
  BlockRow block_row;  // logical block j -> its row of this head at slot 0, V half
  Ahead& ahead;
  int64_t block_size, slot_stride, len;
  int64_t j = 0, off = 0;  // the next token sits at offset off of logical block j

  const kv_t* next(int64_t p) {
    if (p >= len) return nullptr;
    ahead.step();
    const kv_t* row = block_row(j) + off * slot_stride;
    if (++off == block_size) {
      off = 0;
      ++j;
    }
    return row;
  }
};

// How many tasks a thread must have before decode_avx2 and decode_avx512_bf16 give each task all of a sequence's
// KV heads rather than one: below it, Hkv tasks a sequence (or partition) keep a small batch spread over the threads.
constexpr int64_t kTasksPerThread = 2;

#if defined(STREAMKV_AVX2_KV)
// Sequences longer than this many tokens are read as partitions of at most this many in whole blocks (one block
// when blocks are larger), each a task of its own whose partial softmax sums are merged at the end (the split-K
// of flash-decoding): one long conversation then spreads over every thread, where one task per KV head left a
// thread with 2 of SmolLM2's 3 heads and the other with 1. The partitions depend on the sequence's length and the
// block size alone, so its result does not depend on its batch.
constexpr int64_t kPartitionTokens = 256;

// One task of decode_avx2: KV heads [h0, h0 + heads) of one sequence, over blocks [j0, j1) of its table.
struct DecodeTask {
  int64_t seq, h0, j0, j1;
  int64_t partition;  // its slot among the partial results, or -1 when it covers the whole sequence
};

// decode_avx2's tasks, in order: by sequence, then KV heads, then partitions.
class DecodeTasks {
 public:
  int64_t heads_per_task = 1;  // all of a sequence's KV heads, or one
  int64_t partitions = 0;      // tasks that cover part of a sequence
  int64_t max_keys = 0;        // the most tokens a task reads

  template <typename View>
  explicit DecodeTasks(const View& d) : block_size_(d.block_size), len_(d.len_ptr) {
    const int64_t part_blocks = std::max<int64_t>(1, kPartitionTokens / d.block_size);
    auto parts = [&](int64_t b) {
      return d.len_ptr[b] <= kPartitionTokens ? 1 : (blocks(b) + part_blocks - 1) / part_blocks;
    };
    int64_t whole_tasks = 0;
    for (int64_t b = 0; b < d.num_seqs; ++b) whole_tasks += parts(b);
    heads_per_task = whole_tasks >= kTasksPerThread * at::get_num_threads() ? d.num_kv_heads : 1;
    for (int64_t b = 0; b < d.num_seqs; ++b) {
      const int64_t n = blocks(b), p_count = parts(b), p_blocks = p_count > 1 ? part_blocks : n;
      max_keys = std::max(max_keys, std::min<int64_t>(std::max<int64_t>(d.len_ptr[b], 0), p_blocks * block_size_));
      for (int64_t h0 = 0; h0 < d.num_kv_heads; h0 += heads_per_task)
        for (int64_t p = 0; p < p_count; ++p)
          tasks_.push_back({b, h0, p * p_blocks, std::min(n, (p + 1) * p_blocks), p_count > 1 ? partitions++ : -1});
    }
  }
  int64_t size() const { return static_cast<int64_t>(tasks_.size()); }
  const DecodeTask& operator[](int64_t t) const { return tasks_[t]; }

  // parallel_for_by_cost's cost of task t: its tokens, and kTaskCostTokens.
  auto cost() const {
    return [this](int64_t t) {
      const DecodeTask& k = tasks_[t];
      const int64_t keys = std::min<int64_t>(len_[k.seq], k.j1 * block_size_) - k.j0 * block_size_;
      return std::max<int64_t>(keys, 0) + kTaskCostTokens;
    };
  }

  // The output rows of every partitioned sequence from its partitions' results, in partition order:
  // out = sum_p acc_p e^(m_p - m) / sum_p total_p e^(m_p - m), m = max_p m_p, where a partition's slot holds
  // `rows` rows of head_dim sums acc_p, then their maxima m_p, then their totals total_p (sums of e^(s - m_p)).
  template <typename View>
  void merge(const View& d, const float* partials, int64_t rows, int64_t head_dim) const {
    std::vector<int64_t> runs;  // first task of each run of one sequence's (and head's) partitions
    for (int64_t t = 0; t < size(); ++t)
      if (tasks_[t].partition >= 0 && (t == 0 || tasks_[t - 1].partition < 0 || tasks_[t - 1].seq != tasks_[t].seq ||
                                       tasks_[t - 1].h0 != tasks_[t].h0))
        runs.push_back(t);
    const int64_t stride = rows * (head_dim + 2);
    at::parallel_for(0, static_cast<int64_t>(runs.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> num(head_dim);
      for (int64_t r = begin; r < end; ++r) {
        const DecodeTask& first = tasks_[runs[r]];
        int64_t count = 0;
        while (runs[r] + count < size() && tasks_[runs[r] + count].seq == first.seq &&
               tasks_[runs[r] + count].h0 == first.h0)
          ++count;
        const float* slots = partials + first.partition * stride;  // the run's partitions are consecutive slots
        for (int64_t row = 0; row < rows; ++row) {
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t p = 0; p < count; ++p) m = std::max(m, slots[p * stride + rows * head_dim + row]);
          float den = 0;
          std::fill(num.begin(), num.end(), 0.f);
          for (int64_t p = 0; p < count; ++p) {
            const float* slot = slots + p * stride;
            const float w = std::exp(slot[rows * head_dim + row] - m);
            den += slot[rows * (head_dim + 1) + row] * w;
            for (int64_t x = 0; x < head_dim; ++x) num[x] += slot[row * head_dim + x] * w;
          }
          auto* dst = d.o_ptr + first.seq * d.o_stride_s + (first.h0 * d.group + row) * d.o_stride_h;
          using q_t = std::remove_reference_t<decltype(*dst)>;
          for (int64_t x = 0; x < head_dim; ++x) dst[x] = static_cast<q_t>(num[x] / den);
        }
      }
    });
  }

 private:
  int64_t blocks(int64_t b) const { return (std::max<int64_t>(len_[b], 0) + block_size_ - 1) / block_size_; }
  int64_t block_size_;
  const int32_t* len_;
  std::vector<DecodeTask> tasks_;
};

// The next block a task reads after the one in hand, for asking ahead: its row of the task's first head at slot 0,
// and how many heads' rows of each slot (contiguous from there) the task reads. heads == 0: none.
template <typename kv_t>
struct NextBlock {
  const kv_t* row0 = nullptr;
  int64_t heads = 0;
};

// decode_avx512's contract on AVX2 (8 lanes, 16 vector registers), for fp32 and bf16 K/V rows of head_dim == 8 * C
// and a constant query group G (1-4), and for int8 / fp8 rows (load8 widens the codes to fp32; the key's scale
// multiplies its score, the V row's its softmax weight, as decode_avx512 applies them; 30 layers' int8 pools,
// B=32 x 192 tokens: 39.8 ms on the portable loop, 7.8 here, against 22.5 for fp32 rows; docs/benchmarks.md,
// "Round 14"). A task (DecodeTasks) is one sequence's KV heads [h0, h1) over its blocks, or
// over one partition of them past kPartitionTokens: all heads when the batch has kTasksPerThread such tasks a
// thread, else one. It walks its blocks in table order, K blocks then V blocks:
// - a block's rows of all Hkv heads are one contiguous span (block_size * Hkv * D values), so a task of a whole
//   sequence reads each span once, front to back, and the hardware prefetchers follow it; one head a task reads
//   1 row in Hkv and comes back for the others (fp32, 30 layers' pools from memory, B=64 x 192-token contexts:
//   39.2 -> 33.8 ms; an engine decode step at B=64: 188 -> 178 ms; docs/benchmarks.md, "Round 12");
// - pass 1 scores 8 keys of a block at a time for each head's G query heads, with one reduce8 (the 8 key rows
//   stay in L1 for the G heads);
// - pass 2 accumulates a block's V rows in slices of S vectors per query head, G * S sums in registers, parked in
//   acc between blocks (each output element is still one sum over the tokens in order, so the result does not
//   depend on the task split); the slice width is a constant so the sums never spill (a run-time width spilled
//   all 12 to the stack at every token: 379 -> 328-341 us a layer, one thread, with the rows in L2);
// - while it reads a block, the task asks for the next one's rows (NextBlock): in pass 1 the slots of the keys it
//   scores, in pass 2 a share of the slots at each head;
// - a partition leaves its sums, max and total in `partials`; DecodeTasks::merge writes the sequence's output
//   (30 layers' pools from memory, one sequence of 2,000 / 4,000 tokens: 9.28 -> 7.05 / 19.17 -> 13.97 ms; an
//   engine decode step: 0.90 / 0.82 of before; docs/benchmarks.md, "Round 13").
template <int C, int G, typename q_t, typename kv_t>
void decode_avx2(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  constexpr int64_t head_dim = 8 * C;
  constexpr int S = std::max(1, std::min(C, (15 - G) / G));  // pass 2: G * S sums, G weights, one V vector
  const DecodeView<q_t, kv_t> view(out, query, kv_cache, block_tables, seq_lens);
  const DecodeTasks tasks(view);
  const int64_t heads_per_task = tasks.heads_per_task;
  const int64_t rows_per_task = heads_per_task * G;  // query heads
  const int64_t partial_stride = rows_per_task * (head_dim + 2);  // a partition's sums, then its maxima and totals
  std::vector<float> partials(tasks.partitions * partial_stride);
  // A task's scores: its keys, padded for the 8-key runs' stores (at most a partition's, not the longest sequence's).
  const int64_t score_stride = (tasks.max_keys + 15) / 16 * 16 + 16;

  parallel_for_by_cost(tasks.size(), tasks.cost(), [&](int64_t begin, int64_t end) {
    const auto d = view;
    // Task t's first block: its row of the task's first head at slot 0 (for asking ahead).
    auto first_block = [&](int64_t t) -> NextBlock<kv_t> {
      if (t >= end || tasks[t].j0 >= tasks[t].j1) return {};
      const DecodeTask& n = tasks[t];
      return {d.kv_ptr + d.bt_ptr[n.seq * d.bt_stride + n.j0] * d.block_stride + n.h0 * d.row, heads_per_task};
    };
    // Ask for slots [from, to) of `next`: each slot's rows of the task's heads, one contiguous span.
    auto ask = [&](const NextBlock<kv_t>& next, int64_t from, int64_t to) {
      for (int64_t slot = from; next.heads > 0 && slot < to; ++slot)
        prefetch_row(next.row0 + slot * d.slot_stride, next.heads * d.row_bytes);
    };
    // The task's queries, sums and scores: q[i][g] is query head (h0 + i) * G + g's vector, scaled.
    std::vector<float> buffers(2 * rows_per_task * head_dim + 8), scores(rows_per_task * score_stride);
    auto* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffers.data()) + 31) & ~uintptr_t(31));
    auto* q = reinterpret_cast<float(*)[G][head_dim]>(aligned);
    auto* acc = reinterpret_cast<float(*)[G][head_dim]>(aligned + rows_per_task * head_dim);
    std::vector<std::array<float, G>> total(heads_per_task), top(heads_per_task);
    auto score_row = [&](int64_t i, int g) { return scores.data() + (i * G + g) * score_stride; };
    for (int64_t t = begin; t < end; ++t) {
      const DecodeTask& task = tasks[t];
      const int64_t b = task.seq, h0 = task.h0, j0 = task.j0, j1 = task.j1;
      const int64_t len = d.len_ptr[b];
      if (j0 >= j1) {  // no keys: 0 / 0, NaN, as decode_generic gives
        for (int64_t i = 0; i < rows_per_task; ++i)
          std::fill_n(d.o_ptr + b * d.o_stride_s + (h0 * G + i) * d.o_stride_h, head_dim,
                      static_cast<q_t>(std::numeric_limits<float>::quiet_NaN()));
        continue;
      }
      const int32_t* table = d.bt_ptr + b * d.bt_stride;
      const int64_t first_token = j0 * d.block_size;
      const int64_t keys = std::min(len, j1 * d.block_size) - first_token;  // the task's tokens
      // Logical block j's row of head h0 at slot 0, K (half 0) or V (half 1).
      auto block_row = [&](int64_t j, int half) {
        return d.kv_ptr + half * d.v_offset + table[j] * d.block_stride + h0 * d.row;
      };
      auto next_block = [&](int64_t j, int half) -> NextBlock<kv_t> {
        if (j + 1 < j1) return {block_row(j + 1, half), heads_per_task};
        if (half == 0) return {block_row(j0, 1), heads_per_task};
        return first_block(t + 1);
      };
      for (int64_t i = 0; i < heads_per_task; ++i)
        for (int g = 0; g < G; ++g) {
          const q_t* src = d.q_ptr + b * d.q_stride_s + ((h0 + i) * G + g) * d.q_stride_h;
          for (int64_t x = 0; x < head_dim; ++x) q[i][g][x] = static_cast<float>(src[x]) * static_cast<float>(scale);
        }
      // Pass 1: scores[i, g, p] = q_ig . k_p, 8 keys of a block at a time, every head of the task.
      for (int64_t j = j0; j < j1; ++j) {
        const kv_t* base = block_row(j, 0);
        const NextBlock<kv_t> next = next_block(j, 0);
        const int64_t block_len = std::min(d.block_size, len - j * d.block_size);
        for (int64_t k0 = 0; k0 < block_len; k0 += 8) {
          const int64_t m = std::min<int64_t>(8, block_len - k0);
          ask(next, k0, k0 + 8 < block_len ? k0 + 8 : d.block_size);
          for (int64_t i = 0; i < heads_per_task; ++i) {
            const kv_t* first = base + k0 * d.slot_stride + i * d.row;
            // The keys past m alias the last one (their scores, past len or overwritten by the next run, are
            // never read), so every run takes the same unrolled loop: the 8 dot products advance side by side,
            // c by c, 8 independent FMA chains (one key's chain at a time left the FMA latency uncovered).
            const kv_t* key[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k) key[k] = first + std::min<int64_t>(k, m - 1) * d.slot_stride;
            for (int g = 0; g < G; ++g) {
              __m256 part[8];
              const __m256 q0 = _mm256_load_ps(q[i][g]);
#pragma GCC unroll 8
              for (int k = 0; k < 8; ++k) part[k] = _mm256_mul_ps(q0, load8(key[k]));
#pragma GCC unroll 8
              for (int c = 1; c < C; ++c) {
                const __m256 qc = _mm256_load_ps(q[i][g] + 8 * c);
#pragma GCC unroll 8
                for (int k = 0; k < 8; ++k) part[k] = _mm256_fmadd_ps(qc, load8(key[k] + 8 * c), part[k]);
              }
              __m256 sc = reduce8(part);
              if constexpr (is_quantized<kv_t>) sc = _mm256_mul_ps(sc, row_scales8(key, head_dim));
              _mm256_storeu_ps(score_row(i, g) + (j - j0) * d.block_size + k0, sc);
            }
          }
        }
      }
      // exp(score - the task's max) per query head (exp8 is exp16's arithmetic); scores past `keys` are never read.
      for (int64_t i = 0; i < heads_per_task; ++i)
        for (int g = 0; g < G; ++g) total[i][g] = exp_scores8(score_row(i, g), keys, &top[i][g]);
      // Pass 2: acc_ig += exp_igp * v_p, block by block, each head's slices of S vectors (the last C % S wide).
      for (int64_t j = j0; j < j1; ++j) {
        const kv_t* base = block_row(j, 1);
        const NextBlock<kv_t> next = next_block(j, 1);
        const int64_t block_len = std::min(d.block_size, len - j * d.block_size);
        const int64_t offset = (j - j0) * d.block_size;
        for (int64_t i = 0; i < heads_per_task; ++i) {
          // The next block's i-th share of slots, every head's rows of them: the whole next block has been
          // asked for by the time the task's last head starts on this one.
          ask(next, i * d.block_size / heads_per_task, (i + 1) * d.block_size / heads_per_task);
          auto slice = [&]<int W>(int c0) {
            __m256 a[G][W];
            for (int g = 0; g < G; ++g)
              for (int c = 0; c < W; ++c)
                a[g][c] = j == j0 ? _mm256_setzero_ps() : _mm256_load_ps(acc[i][g] + 8 * (c0 + c));
            const kv_t* rows = base + i * d.row + 8 * c0;
            for (int64_t k = 0; k < block_len; ++k) {
              const kv_t* v = rows + k * d.slot_stride;
              __m256 wt[G];
              if constexpr (is_quantized<kv_t>) {
                const float vs = row_scale(v - 8 * c0, head_dim);  // the row's scale, after its codes
                for (int g = 0; g < G; ++g) wt[g] = _mm256_set1_ps(score_row(i, g)[offset + k] * vs);
              } else {
                for (int g = 0; g < G; ++g) wt[g] = _mm256_broadcast_ss(score_row(i, g) + offset + k);
              }
              for (int c = 0; c < W; ++c) {
                const __m256 vc = load8(v + 8 * c);
                for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(wt[g], vc, a[g][c]);
              }
            }
            for (int g = 0; g < G; ++g)
              for (int c = 0; c < W; ++c) _mm256_store_ps(acc[i][g] + 8 * (c0 + c), a[g][c]);
          };
          for (int c0 = 0; c0 + S <= C; c0 += S) slice.template operator()<S>(c0);
          if constexpr (C % S != 0) slice.template operator()<C % S>(C - C % S);
        }
      }
      if (task.partition < 0) {  // the whole sequence: the output
        for (int64_t i = 0; i < heads_per_task; ++i)
          for (int g = 0; g < G; ++g) {
            q_t* dst = d.o_ptr + b * d.o_stride_s + ((h0 + i) * G + g) * d.o_stride_h;
            const float inv_sum = 1.f / total[i][g];
            for (int64_t x = 0; x < head_dim; ++x) dst[x] = static_cast<q_t>(acc[i][g][x] * inv_sum);
          }
      } else {  // one partition of it: its sums, max and total, merged below
        float* slot = partials.data() + task.partition * partial_stride;
        for (int64_t i = 0; i < heads_per_task; ++i)
          for (int g = 0; g < G; ++g) {
            std::copy_n(acc[i][g], head_dim, slot + (i * G + g) * head_dim);
            slot[rows_per_task * head_dim + i * G + g] = top[i][g];
            slot[rows_per_task * (head_dim + 1) + i * G + g] = total[i][g];
          }
      }
    }
  });
  tasks.merge(view, partials.data(), rows_per_task, head_dim);
}
#endif

#if defined(__AVX512F__)
// The same contract as decode_generic, for head_dim == 16 * C: a task's queries and its
// accumulators sit in zmm-sized chunks, each K/V row is C loads, exp is vectorised.
// Pass 1 takes up to 16 keys of one block at a time and sums their dot products with one reduce16;
// both passes ask for their rows ahead through the thread's RowsAhead.
template <int C, int G, typename q_t, typename kv_t>
void decode_avx512(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  constexpr int64_t head_dim = 16 * C;
  const DecodeView<q_t, kv_t> view(out, query, kv_cache, block_tables, seq_lens);

  parallel_for_by_cost(view.num_seqs * view.num_kv_heads, seq_head_cost(view.len_ptr, view.num_kv_heads),
                       [&](int64_t begin, int64_t end) {
    const auto d = view;  // a thread's own copy: its fields stay in registers, no reload after each store
    RowsAhead<std::remove_const_t<decltype(d)>> ahead(d, begin, end);
    const int64_t group = G > 0 ? G : d.group;
    HeadVectors<__m512, G * C> q(group * C), acc(group * C);
    HeadVectors<float, G> inv_sum(group);
    std::vector<float> scores(group * d.padded_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / d.num_kv_heads, h = task % d.num_kv_heads;
      const int64_t len = d.len_ptr[b];
      const int32_t* table = d.bt_ptr + b * d.bt_stride;
      const int64_t num_blocks = (len + d.block_size - 1) / d.block_size;
      // Row of this head at slot 0 of logical block j (K half; add v_offset for V).
      auto block_row = [&](int64_t j) { return d.kv_ptr + table[j] * d.block_stride + h * d.row; };
      for (int64_t g = 0; g < group; ++g) {
        const q_t* src = d.q_ptr + b * d.q_stride_s + (h * d.group + g) * d.q_stride_h;
        alignas(64) float tmp[head_dim];
        for (int64_t i = 0; i < head_dim; ++i) tmp[i] = static_cast<float>(src[i]) * static_cast<float>(scale);
        for (int c = 0; c < C; ++c) q[g * C + c] = _mm512_load_ps(tmp + 16 * c);
        for (int c = 0; c < C; ++c) acc[g * C + c] = _mm512_setzero_ps();
      }
      // Pass 1: scores[g, p] = q_g . k_p, up to 16 keys of a block at a time.
      for_each_key_run(d, block_row, num_blocks, len, [&](const kv_t* base, int64_t k0, int64_t n, int64_t p0) {
        alignas(64) float ks[16];
        for (int64_t k = 0; k < 16; ++k) ks[k] = k < n ? row_scale(base + (k0 + k) * d.slot_stride, head_dim) : 0.f;
        for (int64_t g = 0; g < group; ++g) {
          __m512 part[16];
#pragma GCC unroll 16
          for (int k = 0; k < 16; ++k) {
            if (k >= n) {
              part[reduce_slot(k)] = _mm512_setzero_ps();
              continue;
            }
            const kv_t* key = base + (k0 + k) * d.slot_stride;
            if (g == 0) ahead.step();
            __m512 s = _mm512_mul_ps(q[g * C], load16(key));
            for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(q[g * C + c], load16(key + 16 * c), s);
            part[reduce_slot(k)] = s;
          }
          __m512 sc = reduce16(part);
          if constexpr (is_quantized<kv_t>) sc = _mm512_mul_ps(sc, _mm512_load_ps(ks));
          _mm512_storeu_ps(&scores[g * d.padded_len + p0], sc);
        }
      });
      // Softmax per query head; lanes past len are masked out of max, exp and sum.
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * d.padded_len];
        const __m512 m = _mm512_set1_ps(masked_max(s, len));
        __m512 sum16 = _mm512_setzero_ps();
        for (int64_t p = 0; p < len; p += 16) {
          const __mmask16 live = live_lanes(len, p);
          const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + p), m)));
          _mm512_mask_storeu_ps(s + p, live, e);
          sum16 = _mm512_add_ps(sum16, e);
        }
        inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum16);
      }
      // Pass 2: acc_g += softmax_gp * v_p, block by block.
      for (int64_t j = 0; j < num_blocks; ++j) {
        const kv_t* base = block_row(j) + d.v_offset;
        const int64_t block_len = std::min(d.block_size, len - j * d.block_size);
        for (int64_t k = 0; k < block_len; ++k) {
          const kv_t* v = base + k * d.slot_stride;
          ahead.step();
          const int64_t p = j * d.block_size + k;
          const float vs = row_scale(v, head_dim);
          __m512 vr[C];
          for (int c = 0; c < C; ++c) vr[c] = load16(v + 16 * c);
          for (int64_t g = 0; g < group; ++g) {
            const __m512 w = _mm512_set1_ps(scores[g * d.padded_len + p] * vs);
            for (int c = 0; c < C; ++c) acc[g * C + c] = _mm512_fmadd_ps(w, vr[c], acc[g * C + c]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m512 inv = _mm512_set1_ps(inv_sum[g]);
        q_t* dst = d.o_ptr + b * d.o_stride_s + (h * d.group + g) * d.o_stride_h;
        for (int c = 0; c < C; ++c) store16(dst + 16 * c, _mm512_mul_ps(acc[g * C + c], inv));
      }
    }
  });
}

#if defined(__AVX512BF16__)
// Pass 1 of the bf16 kernels for one query head: 16 keys' scores (q . k) * scale on vdpbf16ps, key k's row at
// first + k * stride for k < n (the lanes past n are 0, scratch); on_key(k) runs before key k's row is read.
template <int W, typename OnKey>
inline __m512 score_run16(const __m512i* q, const at::BFloat16* first, int64_t stride, int64_t n, __m512 scale16,
                          OnKey&& on_key) {
  __m512 part[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) {
    if (k >= n) {
      part[reduce_slot(k)] = _mm512_setzero_ps();
      continue;
    }
    const at::BFloat16* key = first + k * stride;
    on_key(k);
    __m512 s = _mm512_setzero_ps();
    for (int w = 0; w < W; ++w) s = _mm512_dpbf16_ps(s, (__m512bh)q[w], (__m512bh)_mm512_loadu_si512(key + 32 * w));
    part[reduce_slot(k)] = s;
  }
  return _mm512_mul_ps(reduce16(part), scale16);
}

#if defined(STREAMKV_AMX)
// Pass 1 of the bf16 kernels on AMX tiles (tdpbf16ps), when the extension's AMX switch is on and a block holds
// whole runs of 16 keys: one KV head's G query heads against 16 keys of one block at once, where score_run16 takes
// one query head and reduces 16 partial vectors across lanes. Tiles (16 rows x 64 bytes):
//   0  C [16 keys][16 query heads] fp32 (columns past G stay 0)
//   1  A: the 16 keys' rows, 32 dims each, read in place from the pool (row stride: one slot)
//   2  B: the same 32 dims of the G query vectors as dword columns (amx_query_tiles)
// C[k][g] is the sum over dim pairs of exact bf16 products in fp32, like vdpbf16ps; the scale goes on after, as in
// score_run16. Every bf16 decode path of a process computes a head's scores this way while the switch is on (both
// kernels below, any batch, any thread count), so a sequence's output still does not depend on its batch. Rows of
// a run past its last key (the unwritten tail of the last block, NaN in a poisoned pool) give scores past `len`,
// which the softmax never reads.
constexpr int64_t kAmxQueryTile = 16 * 16;  // int32 words of one B tile

// amx_on() for this decode call's layout: runs of 16 keys never leave a block, and a tile's 16 columns hold the group.
inline bool amx_decode(int64_t block_size, int64_t group) {
  return block_size % 16 == 0 && group >= 1 && group <= 16 && amx_on();
}

// The tile configuration of amx_score_run16 (tiles 0-2: 16 rows x 64 bytes), loaded by each thread that runs it.
inline void amx_decode_config() {
  TileConfig cfg;
  for (int i = 0; i < 3; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  load_tiles(cfg);
}

// B tiles of one KV head's query vectors (query head g at q + g * q_stride_h, W * 32 dims each): tile t row r
// column g = g's dims (32t + 2r, 32t + 2r + 1) as one dword; columns past the group are zero.
template <int W>
inline void amx_query_tiles(const at::BFloat16* q, int64_t q_stride_h, int64_t group, int32_t* tiles) {
  std::fill(tiles, tiles + W * kAmxQueryTile, 0);
  for (int64_t g = 0; g < group; ++g) {
    int32_t pairs[16 * W];  // the query's dims as dwords (memcpy: the row need not be 4-byte aligned)
    std::memcpy(pairs, q + g * q_stride_h, sizeof(pairs));
    for (int t = 0; t < W; ++t)
      for (int r = 0; r < 16; ++r) tiles[t * kAmxQueryTile + r * 16 + g] = pairs[16 * t + r];
  }
}

// scores[g * stride + k] = (q_g . k_k) * scale for g < group, k < 16: the 16 keys whose rows start at `first`
// (`slot` elements apart), the query tiles of amx_query_tiles; `c` is 1 KiB of scratch (64-byte aligned).
template <int W>
inline void amx_score_run16(const int32_t* qtiles, const at::BFloat16* first, int64_t slot, int64_t group,
                            __m512 scale16, float* scores, int64_t stride, float* c) {
  _tile_zero(0);
  for (int t = 0; t < W; ++t) {
    _tile_loadd(1, first + 32 * t, slot * 2);
    _tile_loadd(2, qtiles + t * kAmxQueryTile, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, c, 64);
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int64_t g = 0; g < group; ++g)
    _mm512_storeu_ps(scores + g * stride, _mm512_mul_ps(_mm512_i32gather_ps(column, c + g, 4), scale16));
}
#endif

// The softmax of one query head's scores s[0, len) in fp32, the weights rounded to bf16 and written as pairs of
// tokens (2i, 2i + 1) (a zero weight pads an odd count); returns 1 / the sum of the rounded weights (inf for len 0).
inline float softmax_bf16_pairs(const float* s, int64_t len, int32_t* pairs) {
  const __m512 m = _mm512_set1_ps(masked_max(s, len));
  __m512 sum16 = _mm512_setzero_ps();
  auto* wb = reinterpret_cast<__m256i*>(pairs);
  for (int64_t p = 0; p < len; p += 16) {
    const __mmask16 live = live_lanes(len, p);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + p), m)));
    const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(wb + p / 16, eb);
    sum16 = _mm512_add_ps(sum16, bf16_widen16(eb));
  }
  return 1.f / _mm512_reduce_add_ps(sum16);
}

// Pass 2 of the bf16 kernels for one token pair: acc[g * C + c] += w_g,p v_p + w_g,p+1 v_p+1 for each query head
// g < group. V rows v0 and v1 (nullptr: a row of zeros, for an odd last token) are interleaved 16 bits at a time
// (vpunpck[lh]wd), so lane i of each accumulator holds one head dim, put back in order by store_deinterleaved;
// pair_weights(g) is the pair's two bf16 weights for head g, as one int32.
template <int C, typename PairWeights>
__attribute__((always_inline)) inline void accumulate_pair(__m512* acc, int64_t group, const at::BFloat16* v0,
                                                           const at::BFloat16* v1, PairWeights&& pair_weights) {
  __m512i vi[C];
  for (int w = 0; w < C / 2; ++w) {
    const __m512i x0 = _mm512_loadu_si512(v0 + 32 * w);
    const __m512i x1 = v1 != nullptr ? _mm512_loadu_si512(v1 + 32 * w) : _mm512_setzero_si512();
    vi[2 * w] = _mm512_unpacklo_epi16(x0, x1);
    vi[2 * w + 1] = _mm512_unpackhi_epi16(x0, x1);
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m512bh wp = (__m512bh)_mm512_set1_epi32(pair_weights(g));
    for (int c = 0; c < C; ++c) acc[g * C + c] = _mm512_dpbf16_ps(acc[g * C + c], wp, (__m512bh)vi[c]);
  }
}

// decode_avx512_bf16 with one task per sequence, all of its KV heads (a batch of kTasksPerThread sequences a thread
// or more, an even block size, a constant query group G). Each head's arithmetic is decode_avx512_bf16's to the
// bit (score_run16 or amx_score_run16, softmax_bf16_pairs, the same token pairs in the same order), so a sequence's
// output does not depend on which split its batch takes. What changes is the walk over the pool: a task reads each
// block's span of every head (block_size x Hkv rows, one contiguous stretch) head after head while it is in L1, and
// asks for the next block's span a few lines at each key or token pair (asking two blocks ahead timed the same),
// where one task per KV head reads 1 row in Hkv and comes back for the others. Pass 2's sums are parked in `acc` between
// blocks (reloaded with their bits). 30 layers' pools from memory, 2 threads, against one task per KV head:
// 4 x 4,000 tokens 21.4 -> 18.3 ms, 8 x 2,000 19.3 -> 17.4, 32 x 192 4.1 -> 3.8-4.1, 64 x 192 and 64 x 1,100
// 2-5% slower or level (docs/benchmarks.md, "Round 18").
template <int C, int G>
void decode_avx512_bf16_seqs(const DecodeView<at::BFloat16, at::BFloat16>& view, __m512 scale16) {
  using bf16 = at::BFloat16;
  constexpr int W = C / 2;  // 32-value vectors per row
  const auto cost = [lens = view.len_ptr, heads = view.num_kv_heads](int64_t b) {
    return std::max<int64_t>(lens[b], 0) * heads + kTaskCostTokens;
  };
#if defined(STREAMKV_AMX)
  const bool amx = amx_decode(view.block_size, G);
#endif
  parallel_for_by_cost(view.num_seqs, cost, [&](int64_t begin, int64_t end) {
    const auto d = view;  // a thread's own copy: its fields stay in registers, no reload after each store
    const int64_t heads = d.num_kv_heads, rows = heads * G, pairs_stride = d.padded_len / 2;
    std::vector<__m512i> q(rows * W);
    std::vector<__m512> acc(rows * C);
    std::vector<float> inv_sum(rows), scores(rows * d.padded_len);
    std::vector<int32_t> weights(rows * pairs_stride);  // bf16 weight pairs of tokens (2i, 2i + 1)
#if defined(STREAMKV_AMX)
    std::vector<int32_t> qt(amx ? heads * W * kAmxQueryTile : 0);  // each head's query tiles
    alignas(64) float ctile[256];
    if (amx) amx_decode_config();
#endif
    const int64_t span_lines = (d.block_stride * static_cast<int64_t>(sizeof(bf16)) + 63) / 64;
    // Lines of the next span asked for at each key of pass 1 / token pair of pass 2: the whole span by the end.
    const int64_t key_lines = (span_lines + heads * d.block_size - 1) / (heads * d.block_size);
    const int64_t pair_lines = (2 * span_lines + heads * d.block_size - 1) / (heads * d.block_size);
    // Into L2 (prefetcht2), not L1: a prefetcht0 holds one of the core's few L1 miss buffers until its line
    // arrives, and the pass stalled at the prefetches (perf: a third of its samples); 30 layers' pools from memory,
    // 2 threads: B=64 x 1,100 tokens 99.7 -> 95.0 ms, 64 x 192 16.6 -> 16.0, 32 x 400 18.1 -> 16.4
    // (docs/benchmarks.md, "Round 34").
    auto ask = [span_lines](const bf16* span, int64_t step, int64_t lines) {
      if (span == nullptr) return;
      const int64_t first = step * lines, last = std::min(span_lines, (step + 1) * lines);
      if (first < last) prefetch_row(reinterpret_cast<const char*>(span) + first * 64, (last - first) * 64);
    };
    // The first span task t reads (its first K block), or none.
    auto first_span = [&](int64_t t) -> const bf16* {
      return t < end && d.len_ptr[t] > 0 ? d.kv_ptr + d.bt_ptr[t * d.bt_stride] * d.block_stride : nullptr;
    };
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = d.len_ptr[b];
      const int32_t* table = d.bt_ptr + b * d.bt_stride;
      const int64_t num_blocks = (len + d.block_size - 1) / d.block_size;
      auto span = [&](int64_t j, int half) { return d.kv_ptr + half * d.v_offset + table[j] * d.block_stride; };
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* src = d.q_ptr + b * d.q_stride_s + r * d.q_stride_h;  // query head r = h * G + g
        for (int w = 0; w < W; ++w) q[r * W + w] = _mm512_loadu_si512(src + 32 * w);
      }
#if defined(STREAMKV_AMX)
      if (amx)
        for (int64_t h = 0; h < heads; ++h)
          amx_query_tiles<W>(d.q_ptr + b * d.q_stride_s + h * G * d.q_stride_h, d.q_stride_h, G,
                             &qt[h * W * kAmxQueryTile]);
#endif
      // Pass 1: scores[h * G + g, p] = (q_hg . k_hp) * scale, block by block, every head, runs of up to 16 keys.
      for (int64_t j = 0; j < num_blocks; ++j) {
        const bf16* base = span(j, 0);
        const bf16* next = j + 1 < num_blocks ? span(j + 1, 0) : span(0, 1);
        const int64_t block_len = std::min(d.block_size, len - j * d.block_size);
        int64_t step = 0;
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t k0 = 0; k0 < block_len; k0 += 16) {
            const int64_t n = std::min<int64_t>(16, block_len - k0), p0 = j * d.block_size + k0;
#if defined(STREAMKV_AMX)
            if (amx) {
              for (int64_t k = 0; k < n; ++k) ask(next, step++, key_lines);
              amx_score_run16<W>(&qt[h * W * kAmxQueryTile], base + k0 * d.slot_stride + h * d.row, d.slot_stride, G,
                                 scale16, &scores[h * G * d.padded_len + p0], d.padded_len, ctile);
              continue;
            }
#endif
            for (int g = 0; g < G; ++g)
              _mm512_storeu_ps(&scores[(h * G + g) * d.padded_len + p0],
                               score_run16<W>(&q[(h * G + g) * W], base + k0 * d.slot_stride + h * d.row,
                                              d.slot_stride, n, scale16, [&](int) {
                                                if (g == 0) ask(next, step++, key_lines);
                                              }));
          }
        }
      }
      // Softmax per query head in fp32; the weights rounded to bf16, padded with a zero weight to an even count.
      for (int64_t r = 0; r < rows; ++r)
        inv_sum[r] = softmax_bf16_pairs(&scores[r * d.padded_len], len, &weights[r * pairs_stride]);
      // Pass 2: acc_hg += w_hg,p v_hp + w_hg,p+1 v_hp+1 over token pairs (a block's pairs are its own: the block size
      // is even), block by block, every head; an odd last token pairs with zeros.
      for (int64_t j = 0; j < num_blocks; ++j) {
        const bf16* base = span(j, 1);
        const bf16* next = j + 1 < num_blocks ? span(j + 1, 1) : first_span(b + 1);
        const int64_t block_len = std::min(d.block_size, len - j * d.block_size);
        int64_t step = 0;
        for (int64_t h = 0; h < heads; ++h) {
          __m512 a[G * C];
          for (int i = 0; i < G * C; ++i) a[i] = j == 0 ? _mm512_setzero_ps() : acc[h * G * C + i];
          const int32_t* wh = &weights[h * G * pairs_stride + j * d.block_size / 2];
          for (int64_t k = 0; k < block_len; k += 2) {
            ask(next, step++, pair_lines);
            const bf16* v0 = base + k * d.slot_stride + h * d.row;
            accumulate_pair<C>(a, G, v0, k + 1 < block_len ? v0 + d.slot_stride : nullptr,
                               [&](int64_t g) { return wh[g * pairs_stride + k / 2]; });
          }
          for (int i = 0; i < G * C; ++i) acc[h * G * C + i] = a[i];
        }
      }
      if (num_blocks <= 0) std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());  // no keys: 0 / 0, NaN
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        __m512 o[C];
        for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(acc[r * C + c], inv);
        store_deinterleaved<W>(d.o_ptr + b * d.o_stride_s + r * d.o_stride_h, o);
      }
    }
#if defined(STREAMKV_AMX)
    if (amx) _tile_release();
#endif
  });
}

// bf16 query on bf16 KV (AVX512-BF16): the contract of decode_avx512, with both products on vdpbf16ps,
// which multiplies bf16 pairs exactly and adds them in fp32 (the scores and the softmax stay fp32).
// - Pass 1 takes a key row as it lies in the pool: adjacent head dims are the pairs, so q . k is C / 2
//   instructions (C * 4 fp32 FMAs and C bf16-to-fp32 widenings before), and the scale goes on the score.
// - Pass 2 pairs two tokens: the softmax weights are rounded to bf16 (as the prefill kernel and torch's
//   bf16 attention round them; the sum counts the rounded weights), and V rows p and p + 1 are interleaved
//   16 bits at a time (vpunpck[lh]wd), so lane i of each accumulator holds one head dim, put back in order
//   once per task. An odd last token pairs with zeros, never with a row it must not read.
// Measured against decode_avx512 on this engine's bf16 decode steps: docs/benchmarks.md, "bf16 decode attention and
// greedy argmax".
template <int C, int G>
void decode_avx512_bf16(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  using bf16 = at::BFloat16;
  constexpr int64_t head_dim = 16 * C;
  constexpr int W = C / 2;  // 32-value vectors per row
  const DecodeView<bf16, bf16> view(out, query, kv_cache, block_tables, seq_lens);
  const __m512 scale16 = _mm512_set1_ps(static_cast<float>(scale));
  if constexpr (G > 0) {
    if (view.block_size % 2 == 0 && view.num_seqs >= kTasksPerThread * at::get_num_threads())
      return decode_avx512_bf16_seqs<C, G>(view, scale16);
  }

#if defined(STREAMKV_AMX)
  const bool amx = amx_decode(view.block_size, view.group);
#endif
  parallel_for_by_cost(view.num_seqs * view.num_kv_heads, seq_head_cost(view.len_ptr, view.num_kv_heads),
                       [&](int64_t begin, int64_t end) {
    const auto d = view;  // a thread's own copy: its fields stay in registers, no reload after each store
    RowsAhead<std::remove_const_t<decltype(d)>> ahead(d, begin, end);
    const int64_t group = G > 0 ? G : d.group;
    HeadVectors<__m512i, G * W> q(group * W);
    HeadVectors<__m512, G * C> acc(group * C);
    HeadVectors<float, G> inv_sum(group);
    std::vector<float> scores(group * d.padded_len);
    std::vector<int32_t> weights(group * (d.padded_len / 2));  // bf16 weight pairs of tokens (2i, 2i + 1)
#if defined(STREAMKV_AMX)
    alignas(64) int32_t qt[W * kAmxQueryTile];
    alignas(64) float ctile[256];
    if (amx) amx_decode_config();  // after the allocations: nothing between it and _tile_release can throw
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / d.num_kv_heads, h = task % d.num_kv_heads;
      const int64_t len = d.len_ptr[b];
      const int32_t* table = d.bt_ptr + b * d.bt_stride;
      const int64_t num_blocks = (len + d.block_size - 1) / d.block_size;
      auto block_row = [&](int64_t j) { return d.kv_ptr + table[j] * d.block_stride + h * d.row; };
      for (int64_t g = 0; g < group; ++g) {
        const bf16* src = d.q_ptr + b * d.q_stride_s + (h * d.group + g) * d.q_stride_h;
        for (int w = 0; w < W; ++w) q[g * W + w] = _mm512_loadu_si512(src + 32 * w);
        for (int c = 0; c < C; ++c) acc[g * C + c] = _mm512_setzero_ps();
      }
#if defined(STREAMKV_AMX)
      if (amx) amx_query_tiles<W>(d.q_ptr + b * d.q_stride_s + h * d.group * d.q_stride_h, d.q_stride_h, group, qt);
#endif
      // Pass 1: scores[g, p] = (q_g . k_p) * scale, up to 16 keys of a block at a time.
      for_each_key_run(d, block_row, num_blocks, len, [&](const bf16* base, int64_t k0, int64_t n, int64_t p0) {
#if defined(STREAMKV_AMX)
        if (amx) {
          for (int64_t k = 0; k < n; ++k) ahead.step();
          amx_score_run16<W>(qt, base + k0 * d.slot_stride, d.slot_stride, group, scale16, &scores[p0], d.padded_len,
                             ctile);
          return;
        }
#endif
        for (int64_t g = 0; g < group; ++g)
          _mm512_storeu_ps(&scores[g * d.padded_len + p0],
                           score_run16<W>(&q[g * W], base + k0 * d.slot_stride, d.slot_stride, n, scale16, [&](int) {
                             if (g == 0) ahead.step();
                           }));
      });
      // Softmax per query head in fp32; the weights rounded to bf16, padded with a zero weight to an even count.
      for (int64_t g = 0; g < group; ++g)
        inv_sum[g] = softmax_bf16_pairs(&scores[g * d.padded_len], len, &weights[g * (d.padded_len / 2)]);
      // Pass 2: acc_g += w_g,p v_p + w_g,p+1 v_p+1 over token pairs, each row asked for ahead as in pass 1.
      auto v_row = [&](int64_t jj) { return block_row(jj) + d.v_offset; };
      TokenPairs<bf16, decltype(v_row), decltype(ahead)> pairs{v_row, ahead, d.block_size, d.slot_stride, len};
      for (int64_t p = 0; p < len; p += 2) {
        const bf16* v0 = pairs.next(p);
        const bf16* v1 = pairs.next(p + 1);
        accumulate_pair<C>(&acc[0], group, v0, v1, [&](int64_t g) { return weights[g * (d.padded_len / 2) + p / 2]; });
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m512 inv = _mm512_set1_ps(inv_sum[g]);
        __m512 o[C];
        for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(acc[g * C + c], inv);
        store_deinterleaved<W>(d.o_ptr + b * d.o_stride_s + (h * d.group + g) * d.o_stride_h, o);
      }
    }
#if defined(STREAMKV_AMX)
    if (amx) _tile_release();
#endif
  });
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The query rows of one (sequence, KV head) task quantized to int16 for vpdpwssd: query head g's D values times
// the softmax scale, over their own step (the largest |value| / 32767; a NaN element is skipped by the largest, as
// std::max skipped it). q gets W vectors per query head, q_scale the step of each.
template <int C, typename q_t>
inline void quantize_queries_int16(const q_t* src, int64_t stride, int64_t group, __m512 scale16, __m512i* q,
                                   float* q_scale) {
  constexpr int W = C / 2;
  for (int64_t g = 0; g < group; ++g) {
    __m512 x[C];
    __m512 absmax = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      x[c] = _mm512_mul_ps(load16(src + g * stride + 16 * c), scale16);
      absmax = _mm512_max_ps(_mm512_abs_ps(x[c]), absmax);
    }
    q_scale[g] = _mm512_reduce_max_ps(absmax) / 32767.f;
    const __m512 div = _mm512_set1_ps(q_scale[g] > 0.f ? q_scale[g] : 1.f);
    for (int w = 0; w < W; ++w) {
      const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(x[2 * w], div)));
      const __m256i hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(x[2 * w + 1], div)));
      q[g * W + w] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
  }
}

// Pass 1 of the int8 kernels for one run of n <= 16 keys (key k's row at keys[k]): scores[g * stride + k] =
// (q_g . k) * key scale * q_scale[g] for the group's query heads, each key's codes widened to int16 once (into an
// L1 buffer) for all of them; step(k) is called once for each key as it is read.
template <int C, typename Step>
inline void score_run16_int8(const int8_t* const keys[16], int64_t n, int64_t group, const __m512i* q,
                             const float* q_scale, float* scores, int64_t stride, Step&& step) {
  constexpr int64_t head_dim = 16 * C;
  constexpr int W = C / 2;
  alignas(64) int16_t wide[16 * head_dim];
  alignas(64) float ks[16];
  for (int64_t k = 0; k < 16; ++k) {
    ks[k] = 0.f;
    if (k >= n) continue;
    step(k);
    ks[k] = row_scale(keys[k], head_dim);
    for (int w = 0; w < W; ++w)
      _mm512_store_si512(wide + k * head_dim + 32 * w,
                         _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys[k] + 32 * w))));
  }
  for (int64_t g = 0; g < group; ++g) {
    __m512i part[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      __m512i s = _mm512_setzero_si512();
      if (k < n)
        for (int w = 0; w < W; ++w)
          s = _mm512_dpwssd_epi32(s, q[g * W + w], _mm512_load_si512(wide + k * head_dim + 32 * w));
      part[reduce_slot(k)] = s;
    }
    const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(reduce16i(part)), _mm512_load_ps(ks));
    _mm512_storeu_ps(scores + g * stride, _mm512_mul_ps(sc, _mm512_set1_ps(q_scale[g])));
  }
}

// Pass 2 of the int8 kernels, one run of n <= 16 tokens at a time (V row k at rows[k]; a run is tokens
// [16 r, 16 r + 16) of its sequence, so its scale does not depend on the task split): the run's softmax weights
// e = exp(s - max) in fp32 (added to sum16), u = e * V scale quantized to int16 against the run's largest u, then
// the run's sums over token pairs in int32 added to acc_f in fp32 times the run's step. A NaN u makes its run's
// step NaN, so NaN V rows stay NaN. The scratch of G query heads (or any group when G == 0) is held here, so a
// thread allocates it once.
template <int C, int G>
struct Int8Runs {
  static constexpr int64_t head_dim = 16 * C;
  static constexpr int W = C / 2;
  int64_t group;
  HeadVectors<__m512i, G * C> acc;
  HeadVectors<int16_t, G * 16> w16;  // u_p per query head; pairs (2i, 2i + 1) read as one int32
  HeadVectors<float, G> steps;

  explicit Int8Runs(int64_t g) : group(G > 0 ? G : g), acc(group * C), w16(group * 16), steps(group) {}

  void accumulate(const int8_t* const rows[16], int64_t n, const float* scores, int64_t stride,
                  const float* row_max, __m512* sum16, __m512* acc_f) {
    const int64_t group = G > 0 ? G : this->group;  // a constant bound when G is: the sums then stay in registers
    alignas(64) float vs[16];
    for (int64_t k = 0; k < 16; ++k) vs[k] = k < n ? row_scale(rows[k], head_dim) : 0.f;
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 e = _mm512_maskz_mov_ps(
          live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + g * stride), _mm512_set1_ps(row_max[g]))));
      sum16[g] = _mm512_add_ps(sum16[g], e);
      const __m512 u = _mm512_mul_ps(e, _mm512_load_ps(vs));  // lanes past n are 0
      float step = _mm512_reduce_max_ps(u) / 32767.f;
      if (_mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q)) step = std::numeric_limits<float>::quiet_NaN();
      steps[g] = step;
      // One scalar divide, not 16; a step below the smallest normal float (1 / step would overflow, and 0 * inf
      // turn a zero weight into -32768), zero or NaN divides as before.
      const __m512 codes = step >= std::numeric_limits<float>::min()
                               ? _mm512_mul_ps(u, _mm512_set1_ps(1.f / step))
                               : _mm512_div_ps(u, _mm512_set1_ps(step > 0.f ? step : 1.f));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&w16[16 * g]), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(codes)));
      for (int c = 0; c < C; ++c) acc[g * C + c] = _mm512_setzero_si512();
    }
    for (int64_t k = 0; k < n; k += 2) {
      const int8_t* v0 = rows[k];
      const int8_t* v1 = k + 1 < n ? rows[k + 1] : nullptr;
      __m512i vi[C];
      for (int w = 0; w < W; ++w) {
        const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 32 * w)));
        const __m512i c = v1 != nullptr
                              ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 32 * w)))
                              : _mm512_setzero_si512();
        vi[2 * w] = _mm512_unpacklo_epi16(a, c);
        vi[2 * w + 1] = _mm512_unpackhi_epi16(a, c);
      }
      for (int64_t g = 0; g < group; ++g) {
        int32_t pair;
        std::memcpy(&pair, &w16[16 * g + k], sizeof(pair));
        const __m512i wp = _mm512_set1_epi32(pair);
        for (int c = 0; c < C; ++c) acc[g * C + c] = _mm512_dpwssd_epi32(acc[g * C + c], wp, vi[c]);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const __m512 step = _mm512_set1_ps(steps[g]);
      for (int c = 0; c < C; ++c)
        acc_f[g * C + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g * C + c]), step, acc_f[g * C + c]);
    }
  }
};

// decode_avx512_int8 with one task per sequence, all of its KV heads (a batch of kTasksPerThread sequences a thread
// or more, a block size that is a multiple of 16, a constant query group G): decode_avx512_bf16_seqs's walk on an
// int8 cache. Each head's arithmetic is decode_avx512_int8's to the bit (the same queries, the same 16-token runs,
// the same pairs in the same order), so a sequence's output does not depend on which split its batch takes. A task
// reads each block's span of every head (block_size x Hkv rows, one contiguous stretch) head after head, and asks
// for the next span a few lines at each row; one task per KV head reads 68 bytes in every 204 of a span and leaves
// the rest to the other heads' tasks. 30 layers' pools from memory, 2 threads, B=64 x 220 tokens: see
// docs/benchmarks.md, "Round 31".
template <int C, int G, typename q_t>
void decode_avx512_int8_seqs(const DecodeView<q_t, int8_t>& view, __m512 scale16) {
  constexpr int W = C / 2;  // 32-code int16 vectors per row
  const auto cost = [lens = view.len_ptr, heads = view.num_kv_heads](int64_t b) {
    return std::max<int64_t>(lens[b], 0) * heads + kTaskCostTokens;
  };
  parallel_for_by_cost(view.num_seqs, cost, [&](int64_t begin, int64_t end) {
    const auto d = view;  // a thread's own copy: its fields stay in registers, no reload after each store
    const int64_t heads = d.num_kv_heads, rows = heads * G;
    std::vector<__m512i> q(rows * W);
    std::vector<__m512> acc_f(rows * C), sum16(rows);
    std::vector<float> q_scale(rows), row_max(rows), scores(rows * d.padded_len);
    Int8Runs<C, G> runs(G);
    const int64_t span_lines = (d.block_stride + 63) / 64;
    // Lines of the next span asked for at each row read: the whole span by the end of the block.
    const int64_t row_lines = (span_lines + heads * d.block_size - 1) / (heads * d.block_size);
    // Into L2 (prefetcht2), as decode_avx512_bf16_seqs and prefetch_row ask. On the Intel AMX host either hint
    // timed the same (docs/benchmarks.md, "Round 34"); on Zen 4 (2 threads, 30 layers' pools from memory, engine
    // tables, fp32 and bf16 queries, medians of four turns) prefetcht0 was slower, as for the fp32 rows in round
    // 42, where it held the L1 miss buffers: B=8 x 1,000 tokens 7.2-10.9 -> 6.6-7.5 ms, 32 x 1,000 28.0-31.1 ->
    // 25.1-26.2, 64 x 1,000 54.2-69.2 -> 49.1-55.1; B=8, 32 and 64 x 192 tokens level (docs/benchmarks.md,
    // "Round 43").
    auto ask = [span_lines, row_lines](const int8_t* span, int64_t step) {
      if (span == nullptr) return;
      const int64_t first = step * row_lines, last = std::min(span_lines, (step + 1) * row_lines);
      if (first < last) prefetch_row(reinterpret_cast<const char*>(span) + first * 64, (last - first) * 64);
    };
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = d.len_ptr[b];
      const int32_t* table = d.bt_ptr + b * d.bt_stride;
      const int64_t num_blocks = (len + d.block_size - 1) / d.block_size;
      auto span = [&](int64_t j, int half) { return d.kv_ptr + half * d.v_offset + table[j] * d.block_stride; };
      quantize_queries_int16<C>(d.q_ptr + b * d.q_stride_s, d.q_stride_h, rows, scale16, q.data(), q_scale.data());
      std::fill(acc_f.begin(), acc_f.end(), _mm512_setzero_ps());
      std::fill(sum16.begin(), sum16.end(), _mm512_setzero_ps());
      // Every head's runs of up to 16 tokens in one half of the pool (0: K, 1: V), block by block: body(h, rows, n,
      // p0, ask_row) gets run p0 / 16 of head h (a block size that is a multiple of 16 never splits a run) and calls
      // ask_row once for each row it reads, which asks for a few lines of the next span (after the last block:
      // `after`).
      auto each_run = [&](int half, const int8_t* after, auto&& body) {
        for (int64_t j = 0; j < num_blocks; ++j) {
          const int8_t* base = span(j, half);
          const int8_t* next = j + 1 < num_blocks ? span(j + 1, half) : after;
          const int64_t block_len = std::min(d.block_size, len - j * d.block_size);
          int64_t step = 0;
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t k0 = 0; k0 < block_len; k0 += 16) {
              const int64_t n = std::min<int64_t>(16, block_len - k0);
              const int8_t* run[16];
              for (int64_t k = 0; k < n; ++k) run[k] = base + (k0 + k) * d.slot_stride + h * d.row;
              body(h, run, n, j * d.block_size + k0, [&](int64_t) { ask(next, step++); });
            }
        }
      };
      // Pass 1: scores[h * G + g, p].
      each_run(0, num_blocks > 0 ? span(0, 1) : nullptr,
               [&](int64_t h, const int8_t* const* keys, int64_t n, int64_t p0, auto&& ask_row) {
                 score_run16_int8<C>(keys, n, G, &q[h * G * W], &q_scale[h * G], &scores[h * G * d.padded_len + p0],
                                     d.padded_len, ask_row);
               });
      for (int64_t r = 0; r < rows; ++r) row_max[r] = masked_max(&scores[r * d.padded_len], len);
      // Pass 2: acc_f, sum16; then the next sequence's first K span is asked for.
      const int8_t* next_seq =
          b + 1 < end && d.len_ptr[b + 1] > 0 ? d.kv_ptr + d.bt_ptr[(b + 1) * d.bt_stride] * d.block_stride : nullptr;
      each_run(1, next_seq, [&](int64_t h, const int8_t* const* vrows, int64_t n, int64_t p0, auto&& ask_row) {
        for (int64_t k = 0; k < n; ++k) ask_row(k);
        runs.accumulate(vrows, n, &scores[h * G * d.padded_len + p0], d.padded_len, &row_max[h * G], &sum16[h * G],
                        &acc_f[h * G * C]);
      });
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum16[r]));
        __m512 o[C];
        for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(acc_f[r * C + c], inv);
        store_deinterleaved<W>(d.o_ptr + b * d.o_stride_s + r * d.o_stride_h, o);
      }
    }
  });
}

// fp32 or bf16 query on an int8 cache (AVX-512 VNNI): the contract of decode_avx512, both products summed exactly
// in int32 by vpdpwssd (int16 pairs), the scales applied in fp32 afterwards.
// - Pass 1: each query head (times the softmax scale) is quantized to int16 with its own scale
//   (max |q| / 32767, so an element is off by at most 1 / 65534 of the largest: far below the key's own int8
//   step), and a key row's codes are widened to int16 once for the group: q . k is C / 2 instructions. The score
//   is that integer times the query's and the key row's scales (quantize_queries_int16, score_run16_int8).
// - Pass 2, in runs of 16 tokens (Int8Runs): the softmax weight of token p times its V row's scale, u_p, is
//   quantized to int16 against the largest u of its run (p / 16), so a token is off by at most 1 / 65534 of its
//   run's largest u and a long tail of small weights next to one large one is kept (one scale per head would round
//   every u below 1 / 65534 of the peak to 0). V rows p and p + 1 are widened and interleaved 16 bits at a time, as
//   decode_avx512_bf16 pairs them; each run's int32 sums go to fp32 times the run's scale. The sum of the softmax
//   is taken of the unquantized fp32 weights. Each V row's scale is read as its run starts, after the thread's
//   RowsAhead asked for the row.
// Measured against the bf16 kernel: docs/benchmarks.md, "int8 KV: the write and the decode kernel in C++".
template <int C, int G, typename q_t>
void decode_avx512_int8(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  constexpr int W = C / 2;  // 32-code int16 vectors per row
  const DecodeView<q_t, int8_t> view(out, query, kv_cache, block_tables, seq_lens);
  const __m512 scale16 = _mm512_set1_ps(static_cast<float>(scale));
  if constexpr (G > 0) {
    if (view.block_size % 16 == 0 && view.num_seqs >= kTasksPerThread * at::get_num_threads())
      return decode_avx512_int8_seqs<C, G>(view, scale16);
  }

  parallel_for_by_cost(view.num_seqs * view.num_kv_heads, seq_head_cost(view.len_ptr, view.num_kv_heads),
                       [&](int64_t begin, int64_t end) {
    const auto d = view;  // a thread's own copy: its fields stay in registers, no reload after each store
    RowsAhead<std::remove_const_t<decltype(d)>> ahead(d, begin, end);
    const int64_t group = G > 0 ? G : d.group;
    HeadVectors<__m512i, G * W> q(group * W);
    HeadVectors<__m512, G * C> acc_f(group * C);
    HeadVectors<__m512, G> sum16(group);
    HeadVectors<float, G> q_scale(group), row_max(group);
    std::vector<float> scores(group * d.padded_len);
    Int8Runs<C, G> runs(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / d.num_kv_heads, h = task % d.num_kv_heads;
      const int64_t len = d.len_ptr[b];
      const int32_t* table = d.bt_ptr + b * d.bt_stride;
      const int64_t num_blocks = (len + d.block_size - 1) / d.block_size;
      auto block_row = [&](int64_t j) { return d.kv_ptr + table[j] * d.block_stride + h * d.row; };
      quantize_queries_int16<C>(d.q_ptr + b * d.q_stride_s + h * d.group * d.q_stride_h, d.q_stride_h, group, scale16,
                                &q[0], &q_scale[0]);
      for (int64_t g = 0; g < group; ++g) {
        for (int c = 0; c < C; ++c) acc_f[g * C + c] = _mm512_setzero_ps();
        sum16[g] = _mm512_setzero_ps();
      }
      // Pass 1: scores[g, p] = (q_g . k_p) * q_scale_g * k_scale_p, up to 16 keys of a block at a time.
      for_each_key_run(d, block_row, num_blocks, len, [&](const int8_t* base, int64_t k0, int64_t n, int64_t p0) {
        const int8_t* keys[16];
        for (int64_t k = 0; k < n; ++k) keys[k] = base + (k0 + k) * d.slot_stride;
        score_run16_int8<C>(keys, n, group, &q[0], &q_scale[0], &scores[p0], d.padded_len,
                            [&](int64_t) { ahead.step(); });
      });
      for (int64_t g = 0; g < group; ++g) row_max[g] = masked_max(&scores[g * d.padded_len], len);
      // Pass 2: acc_g += u_g,p v_p + u_g,p+1 v_p+1, 16 tokens at a time, each row asked for ahead as in pass 1.
      auto v_row = [&](int64_t jj) { return block_row(jj) + d.v_offset; };
      TokenPairs<int8_t, decltype(v_row), decltype(ahead)> pairs{v_row, ahead, d.block_size, d.slot_stride, len};
      for (int64_t p0 = 0; p0 < len; p0 += 16) {
        const int64_t n = std::min<int64_t>(16, len - p0);
        const int8_t* vrows[16];
        for (int64_t k = 0; k < n; ++k) vrows[k] = pairs.next(p0 + k);
        runs.accumulate(vrows, n, &scores[p0], d.padded_len, &row_max[0], &sum16[0], &acc_f[0]);
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum16[g]));
        __m512 o[C];
        for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(acc_f[g * C + c], inv);
        store_deinterleaved<W>(d.o_ptr + b * d.o_stride_s + (h * d.group + g) * d.o_stride_h, o);
      }
    }
  });
}
#endif
#endif
#endif

// Calls body.template operator()<G>() with the query-head group as a constant G when its accumulators fit the
// registers (G * C <= 16 vectors: groups 1-4 at head_dim 64, 1-2 at 128), with G = 0 (any group) otherwise.
template <int C, typename Body>
void dispatch_group(int64_t group, Body&& body) {
  if constexpr (C <= 16) if (group == 1) return body.template operator()<1>();
  if constexpr (2 * C <= 16) if (group == 2) return body.template operator()<2>();
  if constexpr (3 * C <= 16) if (group == 3) return body.template operator()<3>();
  if constexpr (4 * C <= 16) if (group == 4) return body.template operator()<4>();
  body.template operator()<0>();
}

// Picks the vectorised kernel for the common head dims, the portable one otherwise.
template <typename q_t, typename kv_t>
void decode_kernel(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  [[maybe_unused]] const int64_t group = query.size(1) / kv_cache.size(3);
#define STREAMKV_GROUPED(C, kernel, ...)                                                                         \
  return dispatch_group<C>(group, [&]<int G>() { kernel<C, G, ##__VA_ARGS__>(out, query, kv_cache, block_tables, \
                                                                             seq_lens, scale); })
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<q_t, at::BFloat16> && std::is_same_v<kv_t, at::BFloat16>) {
    switch (query.size(2)) {
      case 64: STREAMKV_GROUPED(4, decode_avx512_bf16);
      case 128: STREAMKV_GROUPED(8, decode_avx512_bf16);
      default: break;
    }
  }
#endif
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if constexpr (std::is_same_v<kv_t, int8_t>) {
    switch (query.size(2)) {
      case 64: STREAMKV_GROUPED(4, decode_avx512_int8, q_t);
      case 128: STREAMKV_GROUPED(8, decode_avx512_int8, q_t);
      default: break;
    }
  }
#endif
#if defined(__AVX512F__)
  switch (query.size(2)) {
    case 64: STREAMKV_GROUPED(4, decode_avx512, q_t, kv_t);
    case 128: STREAMKV_GROUPED(8, decode_avx512, q_t, kv_t);
    default: break;
  }
#endif
#if defined(STREAMKV_AVX2_KV)
  // fp32 / bf16 rows, and int8 / fp8 rows under fp32 queries (an AVX2 model computes in fp32; bf16 queries on
  // quantized rows take the portable loop).
  if constexpr (!is_quantized<kv_t> || std::is_same_v<q_t, float>) {
    auto avx2 = [&]<int C>() {
      switch (group) {
        case 1: decode_avx2<C, 1, q_t, kv_t>(out, query, kv_cache, block_tables, seq_lens, scale); return true;
        case 2: decode_avx2<C, 2, q_t, kv_t>(out, query, kv_cache, block_tables, seq_lens, scale); return true;
        case 3: decode_avx2<C, 3, q_t, kv_t>(out, query, kv_cache, block_tables, seq_lens, scale); return true;
        case 4: decode_avx2<C, 4, q_t, kv_t>(out, query, kv_cache, block_tables, seq_lens, scale); return true;
        default: return false;
      }
    };
    if (query.size(2) == 64 && avx2.template operator()<8>()) return;
    if (query.size(2) == 128 && avx2.template operator()<16>()) return;
  }
#endif
#undef STREAMKV_GROUPED
  decode_generic<q_t, kv_t>(out, query, kv_cache, block_tables, seq_lens, scale);
}

}  // namespace

// out[B, Hq, D] = softmax(q K^T * scale) V over each sequence's seq_lens[b] cached tokens.
void paged_decode(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_tables,
                  at::Tensor seq_lens, double scale) {
  check_query_and_cache(out, query, kv_cache);
  const auto kv_type = kv_cache.scalar_type();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) == query.size(0),
              "block_tables must be [B, max_blocks] with unit last stride");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) == query.size(0),
              "seq_lens must be a contiguous [B]");
  TORCH_CHECK(!query.is_cuda() && !kv_cache.is_cuda(), "CPU tensors only");
  dispatch_dtypes(query.scalar_type(), kv_type, [&]<typename q_t, typename kv_t>() {
    decode_kernel<q_t, kv_t>(out, query, kv_cache, block_tables, seq_lens, scale);
  });
}

namespace {

// One row of D values as int8 codes and their float32 scale, the bytes kv_layout.quantize writes:
// scale = max |x| / 127, code = round-half-even(x / scale) clamped to +-127 (an all-zero row: scale 0, codes 0).
// The same fp32 operations in the same order (a true division, not a reciprocal), so the bytes are equal; as
// torch's amax, a NaN makes the scale NaN (the row is then divided by 1), and a NaN quotient stores code 0.
template <typename x_t>
void quantize_row_int8(const x_t* x, int64_t d, char* dst) {
  float absmax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < d; ++i) {
    const float a = std::fabs(to_float(x[i]));
    nan |= std::isnan(a);
    absmax = std::max(absmax, a);
  }
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : absmax / 127.f;
  const float divisor = scale > 0.f ? scale : 1.f;
  auto* codes = reinterpret_cast<int8_t*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 div = _mm512_set1_ps(divisor), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (; i + 16 <= d; i += 16) {
    __m512 c = _mm512_roundscale_ps(_mm512_div_ps(load16(x + i), div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(hi, _mm512_max_ps(lo, c));  // max / min return their second operand, c, when it is NaN
    c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(c, c, _CMP_ORD_Q), c);  // NaN -> code 0
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }
#elif defined(STREAMKV_AVX2_KV)
  const __m256 div = _mm256_set1_ps(divisor), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  for (; i + 8 <= d; i += 8) {
    __m256 c = _mm256_round_ps(_mm256_div_ps(load8(x + i), div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm256_min_ps(hi, _mm256_max_ps(lo, c));  // max / min return their second operand, c, when it is NaN
    c = _mm256_and_ps(c, _mm256_cmp_ps(c, c, _CMP_ORD_Q));  // NaN -> code 0
    const __m256i n = _mm256_cvtps_epi32(c);
    const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(n16, n16));
  }
#endif
  for (; i < d; ++i) {
    const float c = std::nearbyint(to_float(x[i]) / divisor);
    codes[i] = std::isnan(c) ? 0 : static_cast<int8_t>(std::clamp(c, -127.f, 127.f));
  }
  std::memcpy(dst + d, &scale, sizeof(scale));
}

// n fp32 values -> bf16, round-to-nearest-even: the bits of torch's cast (the torch write path's) for every
// number; a NaN stays NaN (0x7FC0, c10::BFloat16's scalar rule; torch's vectorised cast gives 0xFFFF).
void to_bf16(const float* x, int64_t n, at::BFloat16* dst) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000),
                                 _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    rounded = _mm256_srli_epi32(rounded, 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(x[i]);
}

}  // namespace

// kv_cache[0 / 1].view(-1, Hkv, R)[slot_mapping[t]] = key / value[t]: a step's K and V rows written into their
// slots (the torch path: two index_copy_ calls, ~10 us each per layer at a few tokens; for int8 also the ~10 ops
// of kv_layout.quantize per tensor).
// - Unquantized cache: key / value in the cache's dtype, one copy of each token's Hkv * D contiguous values.
// - bf16 cache: fp32 key / value too, rounded as torch's cast rounds (an fp32 model's --kv-cache-dtype bfloat16).
// - int8 cache (R = D + 4): fp32 or bf16 key / value, each (token, head) row quantized as kv_layout.quantize does.
// Rows of one token contiguous. A prefill's tokens are split between the threads (kWriteGrain tokens and up a
// task); a step's slots are distinct, so no two threads write one slot.
constexpr int64_t kWriteGrain = 256;

void write_kv(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, Hkv, R]");
  TORCH_CHECK(!kv_cache.is_cuda() && !key.is_cuda() && !value.is_cuda(), "CPU tensors only");
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const bool narrow = kv_cache.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kFloat;  // fp32 -> bf16
  const int64_t hkv = kv_cache.size(3), row = kv_cache.size(4), d = int8 ? row - 4 : row;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t tokens = slot_mapping.size(0);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [T]");
  for (const at::Tensor* x : {&key, &value}) {
    if (int8) {
      TORCH_CHECK(x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16,
                  "an int8 cache takes float32 or bfloat16 key / value");
    } else if (!narrow) {
      TORCH_CHECK(x->scalar_type() == kv_cache.scalar_type(),
                  "key / value dtype differs from the cache's (and is not float32 into a bfloat16 cache)");
    }
    TORCH_CHECK(x->scalar_type() == key.scalar_type(), "key and value dtypes differ");
    TORCH_CHECK(x->dim() == 3 && x->size(0) == tokens && x->size(1) == hkv && x->size(2) == d,
                "key / value must be [T, Hkv, D] like the cache");
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == d, "each token's key / value heads must be contiguous");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the pool of ", num_slots);
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const int64_t half = kv_cache.stride(0);  // bytes: int8 elements, or scaled below
  if (int8) {
    auto quantize_rows = [&]<typename x_t>() {
      const x_t* src[2] = {key.data_ptr<x_t>(), value.data_ptr<x_t>()};
      const int64_t stride[2] = {key.stride(0), value.stride(0)};
      at::parallel_for(0, tokens, kWriteGrain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          for (int kv = 0; kv < 2; ++kv)
            for (int64_t h = 0; h < hkv; ++h)
              quantize_row_int8(src[kv] + t * stride[kv] + h * d, d, base + kv * half + (slots[t] * hkv + h) * row);
      });
    };
    if (key.scalar_type() == at::kFloat)
      quantize_rows.template operator()<float>();
    else
      quantize_rows.template operator()<at::BFloat16>();
    return;
  }
  if (narrow) {
    auto* dst = reinterpret_cast<at::BFloat16*>(base);
    const float* src[2] = {key.data_ptr<float>(), value.data_ptr<float>()};
    const int64_t stride[2] = {key.stride(0), value.stride(0)};
    at::parallel_for(0, tokens, kWriteGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int kv = 0; kv < 2; ++kv) to_bf16(src[kv] + t * stride[kv], hkv * d, dst + kv * half + slots[t] * hkv * d);
    });
    return;
  }
  const int64_t elem = kv_cache.element_size(), row_bytes = hkv * d * elem;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * elem, vs = value.stride(0) * elem;
  at::parallel_for(0, tokens, kWriteGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(base + slots[t] * row_bytes, k + t * ks, row_bytes);
      std::memcpy(base + half * elem + slots[t] * row_bytes, v + t * vs, row_bytes);
    }
  });
}

#ifndef STREAMKV_NO_PYBIND  // left out of streamkv_decode_ops (decode_layer.cpp), which calls the ops directly
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention reading K/V in place (CPU)");
  m.def("write_kv", &write_kv, "write a step's K / V rows into their slots (CPU; unquantized or int8 cache)");
  m.def("paged_prefill", &paged_prefill, "paged causal attention of prefill / chunk rows, K/V read in place (CPU)");
  m.def("amx", &streamkv::amx_on,
        "whether this extension's AMX kernels (bf16, int8, fp32 prefill) run in this process");
  m.def("set_amx", &streamkv::set_amx, "switch this extension's AMX kernels; returns the state before", py::arg("on"));
}
#endif
