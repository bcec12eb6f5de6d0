// One decoder layer of a pure-decode step in one call: the ops streamkv/model/llama.py calls one by one from
// Python, in the same order on the same kernels, so the result is the same to the bit.
//
// Why: a decode step at few rows spends its time in the weights' bytes, and the ~12 calls a layer makes from
// Python (module lookups, views, empty tensors, argument conversion) cost 35-70 us a layer on the 2-core EPYC:
// 1.1-2.1 ms of a 30-layer step, 8-13% of the steps of 1-32 rows measured (docs/benchmarks.md, "One call per
// decoder layer").
//
// Built as its own extension (streamkv_decode_ops) from this file and the sources of the three op sets, whose
// Python modules are left out (STREAMKV_NO_PYBIND): one that fails to build costs only this fast path.
//
//   x        = rms_norm(h)                               first layer (residual = h, the embedding rows)
//            | add_rms_norm(h, residual)                 later layers (residual += h in place)
//   qkv      = x W_qkv^T (+ b)                           small_linear / small_linear_int8
//   q, k     = rope(qkv[:, :(Hq + Hkv) D]);  v = qkv[:, (Hq + Hkv) D:]
//   write_kv(kv_cache, k, v, slot_mapping);  a = paged_decode(q, kv_cache, block_tables, seq_lens)
//   x        = add_rms_norm(a W_o^T (+ b), residual)
//   returns    down(silu_and_mul(x W_gate_up^T (+ b)))   the layer's output; the residual is updated in place
//              (gate_up and SiLU-and-mul in one small_linear_silu_mul where the layer has its interleaved pack
//              and small_linear_silu_mul_takes the rows, as the MLP's forward takes it: bitwise the same act)

#include <torch/extension.h>

#include "amx.h"
#include "ops.h"

#include <optional>

namespace {

// y [M, N] = x W^T (+ b): W packed for small_linear, or int8 codes with their float32 scale [N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                  const c10::optional<at::Tensor>& bias, int64_t n) {
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (scale.has_value())
    small_linear_int8(out, x, packed, *scale, bias);
  else
    small_linear(out, x, packed, bias);
  return out;
}

}  // namespace

// h [T, H] -> the layer's output [T, H]; residual [T, H] updated in place (pass h itself for the first layer).
// Weights: the packed matmuls of SmallMatmul (scale set for int8), each with its N; silu_mul_w / silu_mul_bias:
// GateUpSiluMul's interleaved gate_up and its float32 bias, or none.
at::Tensor decode_layer(const at::Tensor& h, at::Tensor residual, bool first, const at::Tensor& input_norm,
                        double input_eps, const at::Tensor& post_norm, double post_eps,
                        const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_scale,
                        const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_w,
                        const c10::optional<at::Tensor>& o_scale, const c10::optional<at::Tensor>& o_bias,
                        const at::Tensor& gate_up_w, const c10::optional<at::Tensor>& gate_up_scale,
                        const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_w,
                        const c10::optional<at::Tensor>& down_scale, const c10::optional<at::Tensor>& down_bias,
                        const c10::optional<at::Tensor>& silu_mul_w, const c10::optional<at::Tensor>& silu_mul_bias,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                        double scale) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && residual.sizes() == h.sizes(), "h and residual must be [T, H]");
  const int64_t tokens = h.size(0), hidden = h.size(1);
  const int64_t q_width = num_heads * head_dim, qk_heads = num_heads + num_kv_heads;
  at::Tensor x = at::empty_like(h);
  if (first) {
    TORCH_CHECK(residual.is_same(h), "the first layer's residual is h itself");
    rms_norm(x, h, input_norm, input_eps);
  } else {
    add_rms_norm(x, h, residual, input_norm, input_eps);
  }
  const at::Tensor qkv = linear(x, qkv_w, qkv_scale, qkv_bias, (qk_heads + num_kv_heads) * head_dim);
  at::Tensor qk = at::empty({tokens, qk_heads, head_dim}, h.options());
  rope(qk, qkv.narrow(1, 0, qk_heads * head_dim).view({tokens, qk_heads, head_dim}), cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, qk_heads * head_dim, num_kv_heads * head_dim).view({tokens, num_kv_heads, head_dim});
  write_kv(kv_cache, k, v, slot_mapping);
  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, h.options());
  paged_decode(attn, q, kv_cache, block_tables, seq_lens, scale);
  const at::Tensor o = linear(attn.view({tokens, q_width}), o_w, o_scale, o_bias, hidden);
  at::Tensor x2 = at::empty_like(h);
  add_rms_norm(x2, o, residual, post_norm, post_eps);
  at::Tensor act = at::empty({tokens, intermediate}, h.options());
  if (silu_mul_w.has_value() && small_linear_silu_mul_takes(x2.size(0), x2.scalar_type() == at::kFloat)) {
    small_linear_silu_mul(act, x2, *silu_mul_w, silu_mul_bias);
  } else {
    const at::Tensor gate_up = linear(x2, gate_up_w, gate_up_scale, gate_up_bias, 2 * intermediate);
    silu_and_mul(act, gate_up);
  }
  return linear(act, down_w, down_scale, down_bias, hidden);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layer", &decode_layer, "one decoder layer of a pure-decode step, the model's ops in one call (CPU)");
  // this extension holds its own AMX switch (amx.h): streamkv.ops.cpu_ops.set_amx sets it with the others'
  m.def("amx", &streamkv::amx_on,
        "whether this extension's AMX kernels (bf16, int8, fp32 prefill) run in this process");
  m.def("set_amx", &streamkv::set_amx, "switch this extension's AMX kernels; returns the state before", py::arg("on"));
}
