// The entry points of streamkv's C++ CPU op sets, declared once: each defining file includes this header (so a
// signature that drifts fails to compile there), and decode_layer.cpp calls them directly.
#pragma once

#include <torch/extension.h>

// paged_attention.cpp, paged_prefill.cpp
void paged_decode(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor seq_lens,
                  double scale);
void write_kv(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping);
void paged_prefill(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_tables,
                   at::Tensor seq_lens, at::Tensor query_start_loc, double scale);

// fused_layers.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor out, const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up);
void rope(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void argmax_rows(at::Tensor out, const at::Tensor& logits);

// small_linear.cpp
void small_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
void small_linear_int8(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias);
void small_linear_silu_mul(at::Tensor act, const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias);
bool small_linear_silu_mul_supported(bool f32);
bool small_linear_silu_mul_takes(int64_t rows, bool f32);

// greedy_head.cpp
int64_t greedy_head(at::Tensor tokens, const at::Tensor& x, const at::Tensor& approx, const at::Tensor& packed,
                    const at::Tensor& row_norms);
