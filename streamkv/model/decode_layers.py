"""A pure-decode step's decoder layers through the C++ ``decode_layer`` op: one call a layer instead of about twelve.

At few rows a decode step is bound by the bytes of its weights, and the
Python around each layer's kernels (module lookups, views, empty tensors,
argument conversion for ~12 calls) cost 35-70 us a layer on the 2-core
EPYC: 1.1-2.1 ms of a 30-layer step, 8-13% of the steps of 1-32 rows
measured.
``decode_layer`` (``streamkv/ops/csrc/decode_layer.cpp``) runs the same
kernels in the same order from C++, so its result is the same to the bit
(``tests/model/test_decode_layers.py``); measured in docs/benchmarks.md,
"One call per decoder layer".

It takes a step when every condition of that equivalence holds: a pure decode
step (every sequence has one new token) whose rows all sample (the model was
given no ``OutputRows``), every projection on the small-batch matmul kernel
(which takes any number of rows), the C++ CPU attention backend,
and a KV cache the op writes itself (the model's dtype, bf16 for an fp32
model, or int8). Anything else (fp8) runs the layers one op at a time, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.cpu_paged import CpuPagedAttention, writes_in_cpp
from streamkv.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class DecodeLayers:
    """The packed weights of every layer, in ``decode_layer``'s argument order.

    Attributes:
        ops: :func:`streamkv.ops.cpu_ops.load_decode_ops`'s module.
        layers: per layer, the arguments after ``(h, residual, first)`` up to the step's tensors.
        dtype: the model's dtype.
        geometry: ``(num_heads, num_kv_heads, head_dim, intermediate_size, softmax scale)``.
    """

    ops: ModuleType
    layers: tuple[tuple[Any, ...], ...]
    dtype: torch.dtype
    geometry: tuple[int, int, int, int, float]

    @classmethod
    def build(cls, layers: Sequence[Any], ops: ModuleType | None) -> DecodeLayers | None:
        """The op's view of a model's ``DecoderLayer`` list, or ``None`` when a projection is not on the small kernel.

        Call after ``LlamaForCausalLM.prepack_cpu_weights`` (with the small-batch ops), with the fused ops in
        use (``use_fused_ops`` does). The layers are duck-typed (``streamkv.model.llama`` imports this module).
        """
        if ops is None or not layers:
            return None
        args_of_layers = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norm, post = layer.input_layernorm, layer.post_attention_layernorm
            args: list[Any] = [norm.weight, norm.eps, post.weight, post.eps]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                m = linear.small
                if m is None:
                    return None
                args += [m.packed, m.scale, m.bias]
            silu_mul = mlp.silu_mul  # gate_up with SiLU-and-mul in one op where it takes the rows, as the MLP does
            args += [None, None] if silu_mul is None else [silu_mul.packed, silu_mul.bias]
            args_of_layers.append(tuple(args))
        a, mlp = layers[0].self_attn, layers[0].mlp
        geometry = (a.num_heads, a.num_kv_heads, a.head_dim, mlp.intermediate_size, a.scale)
        dtype = layers[0].input_layernorm.weight.dtype
        return cls(ops, tuple(args_of_layers), dtype, geometry)

    def takes(
        self, num_tokens: int, meta: AttentionMetadata, backend: AttentionBackend, kv_cache: torch.Tensor
    ) -> bool:
        """Whether this step can run on the op (see the module docstring)."""
        return (
            meta.is_pure_decode
            and isinstance(backend, CpuPagedAttention)
            and writes_in_cpp(kv_cache.dtype, self.dtype)
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded rows ``h [T, H]`` through every layer -> ``(last layer's output, residual)``, as the layer loop.

        Raises:
            RuntimeError: a tensor the op's checks refuse (a slot outside the pool, a bad block table).
        """
        hq, hkv, d, inter, scale = self.geometry
        step = (meta.slot_mapping, meta.block_tables, meta.seq_lens, hq, hkv, d, inter, scale)
        residual = h
        run = self.ops.decode_layer
        for i, (args, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = run(h, residual, i == 0, *args, cos, sin, kv_cache, *step)
        return h, residual
