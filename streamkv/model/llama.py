"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat paged batch.

Reads top-down like the maths: config, the model, a decoder layer, attention,
the SwiGLU MLP, RMSNorm (RoPE is in :mod:`streamkv.model.rope`, the
oneDNN-packed linear layer in :mod:`streamkv.model.linear`). One step's tokens arrive flat (``T`` tokens of
``B`` sequences, see :mod:`streamkv.attention.metadata`); attention delegates
to an :class:`AttentionBackend` that writes and reads the paged KV cache.

For CPU speed, the q/k/v projections run as one matmul (``qkv_proj``) and the
gate/up projections as another (``gate_up_proj``): the checkpoint's weights are
concatenated at load (vLLM does the same). RoPE cos/sin are precomputed for
every position.

Submodules are called through ``.forward`` rather than ``__call__``: the
hook machinery of ``nn.Module.__call__`` costs microseconds a call, seven calls
a layer, which at batch 1 is a measurable share of a decode step (no hooks are
ever registered on these modules).

The residual stream is carried next to each sublayer's output (vLLM's layout),
so the residual add and the next RMSNorm are one op: ``x, residual =
norm.add_forward(out, residual)``. On the CPU, :meth:`LlamaForCausalLM.use_fused_ops`
swaps the element-wise ops (residual add + RMSNorm, SiLU-and-mul, RoPE) for the
C++ ones in ``streamkv/ops/csrc/fused_layers.cpp``, which round where these
torch ops do; the torch ops stay the reference and the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.metadata import AttentionMetadata, OutputRows
from streamkv.model.decode_layers import DecodeLayers
from streamkv.model.greedy_head import GreedyHead
from streamkv.model.linear import (
    Linear,
    SmallMatmul,
    dequantize_int8,
    has_int8_kernel,
    pack_linear_weight,
    quantize_int8,
)
from streamkv.model.rope import RopeScaling, apply_rope, read_rope, rope_inv_freq, rope_tables
from streamkv.model.swiglu import GateUpSiluMul

if TYPE_CHECKING:
    from streamkv.model.gguf_codes import GGUFCodes

FUSED_DTYPES = (torch.float32, torch.bfloat16)

__all__ = ["Linear", "LlamaConfig", "LlamaForCausalLM", "RopeScaling", "apply_rope", "rope_inv_freq", "rope_tables"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The architecture numbers our forward pass needs, read from a transformers config.

    Attributes:
        model_type: ``llama``, ``mistral`` or ``qwen2``.
        qkv_bias: q/k/v projections carry a bias (Qwen2; Llama with ``attention_bias``).
        o_bias: the output projection carries a bias (Llama with ``attention_bias``).
        mlp_bias: gate/up/down carry a bias (Llama with ``mlp_bias``).
        sliding_window: attention window in tokens, or ``None`` for full attention.
            The forward pass attends to the full context, which is exact only for
            sequences no longer than the window; the loader caps ``max_model_len``.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: int | None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, not {self.head_dim}")

    @classmethod
    def from_hf(cls, hf_config: Any) -> LlamaConfig:
        """Read a transformers ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config``.

        Raises:
            ValueError: an unsupported architecture, activation or RoPE scaling type.
        """
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r} (SwiGLU needs silu)")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        rope_theta, rope_scaling = read_rope(hf_config)
        return cls(
            model_type=model_type,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            vocab_size=hf_config.vocab_size,
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=model_type == "llama" and bool(getattr(hf_config, "mlp_bias", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_window=getattr(hf_config, "sliding_window", None),
        )


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head; parameter names follow the transformers checkpoint.

    Args:
        config: architecture numbers.
        max_positions: RoPE table length (defaults to ``max_position_embeddings``);
            positions must stay below it.
    """

    def __init__(self, config: LlamaConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        self.packed_lm_head: torch.Tensor | None = None
        self.small_lm_head: SmallMatmul | None = None
        # A float32 head's greedy tokens from its bf16 estimate (prepack_cpu_weights; greedy_tokens).
        self.greedy_head: GreedyHead | None = None
        # The fused C++ ops while in use (use_fused_ops); the engine's greedy sampling takes their argmax too.
        self.fused_ops: ModuleType | None = None
        self.max_positions = max_positions or config.max_position_embeddings
        # Filled by reset_rope() once the weights are in (the loader calls it).
        self.register_buffer("rope_cos", torch.empty(self.max_positions, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(self.max_positions, config.head_dim), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Run one step's flat batch through the decoder.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]``, each token's position in its sequence.
            kv_caches: one ``[2, num_blocks, block_size, Hkv, D]`` tensor per layer,
                written at ``meta.slot_mapping``.
            meta: the step's attention metadata.
            backend: the paged attention implementation.
            output_rows: the rows whose hidden states the caller uses (``None``: all). The
                last layer writes every row's K/V but runs its attention, o_proj and MLP
                on these rows alone (see :class:`OutputRows`).

        Returns:
            ``[T, hidden_size]`` final-normed hidden states in the model's dtype, or
            ``[N, hidden_size]`` for the ``N`` rows of ``output_rows``.
        """
        # Indexed once per step, shared by every layer: [T, 1, D] broadcasts over heads.
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        return self.model(input_ids, cos, sin, kv_caches, meta, backend, output_rows)

    @torch.no_grad()
    def reset_rope(self, *, dtype: torch.dtype, device: torch.device | str) -> None:
        """(Re)compute the RoPE tables: float32 angles, stored in ``dtype`` (as transformers casts them)."""
        cos, sin = rope_tables(self.config, self.max_positions)
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)

    def compute_logits(self, hidden: torch.Tensor, *, widen: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` (rows that sample) -> logits ``[N, vocab_size]``.

        float32 when ``widen`` (the default); else in the LM head's output dtype, the
        model's (bfloat16 for a bf16 model), which the engine's samplers compare or
        widen exactly where they need to: widening a bf16 model's ``[64, 49,152]``
        logits and taking their argmax took 0.74-0.79 ms, the argmax of the bf16 rows
        0.18-0.20 (docs/benchmarks.md, "Round 39").
        """
        if self.small_lm_head is not None:
            logits = self.small_lm_head(hidden)
        elif self.packed_lm_head is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self.packed_lm_head, None, "none", [], "")
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head
            logits = F.linear(hidden, weight)
        return logits.float() if widen else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """``hidden [N, H]`` -> ``argmax`` of each row's float32 logits, bitwise those of :meth:`compute_logits`,
        without computing most of them (:class:`~streamkv.model.greedy_head.GreedyHead`); ``None`` where that
        head does not run (not a float32 CPU model with the bf16 kernel, ``N`` outside its rows, a non-finite row):
        compute the logits then."""
        head = self.greedy_head
        if head is None or not head.takes(hidden.shape[0]):
            return None
        return head(hidden)

    def use_fused_ops(self, ops: ModuleType | None, decode_ops: ModuleType | None = None) -> bool:
        """Run RMSNorm (with its residual add), SiLU-and-mul and RoPE on ``ops`` (the fused C++ extension).

        ``ops`` is kept as :attr:`fused_ops` (the engine's greedy argmax uses
        it too). ``None`` restores the torch ops. Only a CPU model in float32 or
        bfloat16 takes them. With ``decode_ops`` too, and every projection on
        the small-batch kernel (:meth:`prepack_cpu_weights` first), pure-decode
        steps run each layer in one C++ call (:class:`DecodeLayers`); a call
        without ``decode_ops`` turns that off.

        Args:
            ops: :func:`streamkv.ops.cpu_ops.load_fused_ops`'s module, or ``None``.
            decode_ops: :func:`streamkv.ops.cpu_ops.load_decode_ops`'s module, or ``None``.

        Returns:
            True when the fused ops are now in use.
        """
        weight = self.model.norm.weight
        if ops is not None and (weight.device.type != "cpu" or weight.dtype not in FUSED_DTYPES):
            ops = None
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, Attention)):
                module.fused = ops
        self.fused_ops = ops
        self.model.decode_layers = DecodeLayers.build(list(self.model.layers), decode_ops if ops is not None else None)
        return ops is not None

    @torch.no_grad()
    def prepack_cpu_weights(
        self,
        batch_size_hint: int = 32,
        small_ops: ModuleType | None = None,
        *,
        int8: bool = False,
        codes: Mapping[str, GGUFCodes] | None = None,
    ) -> bool:
        """Move every matmul onto oneDNN-prepacked weights (see :class:`Linear`).

        CPU only; one-way (dense projection weights are released; a tied
        embedding keeps its dense table for lookups and gains a packed copy for
        the LM head). Call after the weights are loaded.

        Args:
            batch_size_hint: rows per matmul the packed layout is tuned for
                (any row count works).
            small_ops: :func:`streamkv.ops.cpu_ops.load_linear_ops`'s module: every matmul
                then runs on its kernel, at every batch size (float32 and bfloat16 only),
                from its own packed copy of each weight, the only copy (no oneDNN one). A
                bfloat16 model on an AVX512-BF16 build also keeps each gate_up once more,
                interleaved for its fused SiLU-and-mul (:class:`GateUpSiluMul`: every batch on
                AMX tiles, prefill-sized ones on ``vdpbf16ps``; its GGUF codes where ``codes``
                has them, else the dense weight).
            int8: every projection and the LM head become their int8 models
                (:func:`streamkv.model.linear.quantize_int8`, one scale per output),
                run by the int8 kernel at every batch size when ``small_ops`` has it
                (else dequantized, on oneDNN); the embedding lookups keep the dense table.
            codes: module name (and ``"lm_head"``) -> the GGUF codes of its float32 or bfloat16 weight
                (:func:`streamkv.model.gguf_codes.read_gguf_codes`): those matmuls' small batches
                run on the codes (:meth:`Linear.prepack`).

        Returns:
            False, changing nothing, when oneDNN is unavailable or cannot take
            this dtype on this CPU (the plain ``F.linear`` path then runs).
        """
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head
        if head.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        if head.dtype not in FUSED_DTYPES:
            small_ops = None
        gguf = {} if int8 else dict(codes or {})  # the GGUF's codes give the weights, not their int8 models
        int8_head = quantize_int8(head) if int8 else None
        small_head: SmallMatmul | None
        if int8_head is not None and has_int8_kernel(small_ops):
            small_head = SmallMatmul.pack(small_ops, head, None, int8_head)  # no dense copy: it runs every batch
            packed_head = None
        else:
            dense_head = head.detach() if int8_head is None else dequantize_int8(*int8_head, head.dtype)
            head_codes = gguf.get("lm_head")
            small_head = None if small_ops is None else SmallMatmul.pack(small_ops, dense_head, codes=head_codes)
            packed_head = None  # the kernel takes every batch size: no oneDNN copy
            if small_head is None:
                try:
                    packed_head = pack_linear_weight(dense_head, batch_size_hint)
                except RuntimeError:
                    return False
        f32 = head.dtype == torch.float32  # fp32's fused gate_up runs without AMX alone (small_linear_silu_mul_takes)
        if small_ops is not None and not int8 and small_ops.small_linear_silu_mul_supported(f32=f32) and not (
            f32 and small_ops.amx()
        ):  # fmt: skip
            for name, module in self.named_modules():  # before the Linear prepack drops the dense weights
                if isinstance(module, MLP):
                    gate_up = module.gate_up_proj
                    gate_up_codes = gguf.get(f"{name}.gate_up_proj")
                    module.silu_mul = GateUpSiluMul.pack(small_ops, gate_up.weight, gate_up.bias, gate_up_codes)
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.prepack(batch_size_hint, small_ops, int8=int8, codes=gguf.get(name))
        self.packed_lm_head = packed_head
        self.small_lm_head = small_head
        self.greedy_head = None
        if int8_head is None and head.dtype == torch.float32:
            self.greedy_head = GreedyHead.build(small_ops, head, small_head, gguf.get("lm_head"))
        if self.lm_head is not None:
            self.lm_head = nn.Parameter(self.lm_head.new_empty(0), requires_grad=False)
        return True


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Set by LlamaForCausalLM.use_fused_ops when the decode-layer op can run this model's decode steps.
        self.decode_layers: DecodeLayers | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """``input_ids [T]``, ``cos/sin [T, 1, D]`` -> normed hidden ``[T, H]`` (``[N, H]`` for ``output_rows``)."""
        h = F.embedding(input_ids, self.embed_tokens.weight)
        residual: torch.Tensor | None = None
        fast = self.decode_layers
        if output_rows is None and fast is not None and fast.takes(h.shape[0], meta, backend, kv_caches[0]):
            h, residual = fast.forward(h, cos, sin, kv_caches, meta)  # the same ops, one C++ call a layer
        else:
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                rows = output_rows if i == last else None  # only the last layer's outputs are the model's
                h, residual = layer.forward(h, residual, cos, sin, kv_cache, meta, backend, rows)
        return self.norm.add_forward(h, residual)[0]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += attn(norm(h)); h += mlp(norm(h))``, the adds fused into the norms."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, residual)`` of the previous layer (``residual`` None before the first) -> this layer's.

        The residual stream after this layer is ``out + residual``; the next
        norm adds them (in place on ``residual``). With ``rows`` (the last
        layer, when only those rows are used) every row's K/V is written but
        attention, o_proj and the MLP run on the ``N`` rows alone: in a 32 x
        128-token prefill 32 of 4,096 rows sample, and the others fed nothing
        (3% of the step's FLOPs in SmolLM2's 30 layers).

        Returns:
            ``(mlp output [T, H], residual [T, H])``, or ``[N, H]`` each with ``rows``.
        """
        x, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn.forward(x, cos, sin, kv_cache, meta, backend, rows)
        if rows is not None:
            residual = residual.index_select(0, rows.indices)
        x, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp.forward(x), residual


class Attention(nn.Module):
    """Grouped-query attention: ``Hq`` query heads share ``Hkv`` KV heads, RoPE on q and k."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        self.fused: ModuleType | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; writes this step's K/V into ``kv_cache``.

        With ``rows`` it returns ``[N, H]`` for those rows alone: all ``T`` rows' K/V are written, then each of
        the ``N`` attends as a decode query to its whole context (``rows.meta``; the backend's forward writes
        those rows' K/V a second time, the same bytes to the same slots).
        """
        num_tokens = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # [T, (Hq + 2 Hkv) D]
        qk_in = qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d)
        if self.fused is not None:
            qk = torch.empty(qk_in.shape, dtype=qk_in.dtype)
            self.fused.rope(qk, qk_in, cos, sin)
        else:
            qk = apply_rope(qk_in, cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
        if rows is not None:
            backend.write(kv_cache, meta, k, v)
            if rows.meta is None:  # no row samples: the K/V write was all this layer had to do
                return x.new_empty(0, x.shape[1])
            q, k, v = (t.index_select(0, rows.indices) for t in (q, k, v))
            meta = rows.meta
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T or N, Hq, D]
        return self.o_proj.forward(out.reshape(q.shape[0], hq * d))


# A prefill step of 4,096 rows makes a [4096, 2 I] gate_up output (50 MB in fp32 for SmolLM2) that leaves the
# cache before silu_and_mul and down_proj read it, and oneDNN's fp32 gate_up ran at ~150 GFLOP/s against ~190 at
# 512 rows. Slices of 1,024 rows: the 4,096-token fp32 prefill 5-9% faster in three alternating rounds
# (docs/benchmarks.md, "MLP slices in long prefill steps"). Rows are independent, and one kernel takes every batch size
# (streamkv/model/linear.py), so a slice gives its rows the same bits as the whole step
# (fp32 on an AMX host to the last bits' level: calls of 129+ rows of the GGUF codes run on tiles).
# Since round 47 this is the fp32 MLP's slice only where its gate_up runs unfused (an AMX host, an AVX2 build).
MLP_SLICE_ROWS = 1024
# bf16 (and fp16) steps slice at 4,096 rows: oneDNN's AMX matmul runs down_proj's [rows, 1536] x [1536, 576] on one
# of two threads at 512-1,024 rows (1.18 ms at 1,024 rows, 2.30 at 4,096 on both), and a 32 x 128-token bf16
# prefill took 0.614 s in slices of 1,024, 0.549 in 2,048 and 0.538 in 4,096 (docs/benchmarks.md, "Round 16").
# So does an fp32 step whose gate_up has SiLU-and-mul in its epilogue (GateUpSiluMul: no [rows, 2 I] output to
# leave the cache): 30 layers' MLP at 4,096 rows took 3,483 ms in unfused 1,024-row slices, 3,364 fused in 1,024-row
# slices and 3,228 fused in 4,096 (medians of 6 taking turns; docs/benchmarks.md, "Round 47").
MLP_SLICE_ROWS_WIDE = 4096


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up in one matmul."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.fused: ModuleType | None = None
        # gate_up with SiLU-and-mul in its epilogue, bf16 on AVX512-BF16 (set by prepack_cpu_weights; takes() says when)
        self.silu_mul: GateUpSiluMul | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; on the CPU a long step runs in slices of ``MLP_SLICE_ROWS`` rows (an fp32
        gate_up without SiLU-and-mul in its epilogue) or ``MLP_SLICE_ROWS_WIDE`` (bf16, fp16, fused fp32)."""
        wide = x.dtype != torch.float32 or (self.silu_mul is not None and self.silu_mul.takes(MLP_SLICE_ROWS_WIDE))
        rows = MLP_SLICE_ROWS_WIDE if wide else MLP_SLICE_ROWS
        if x.shape[0] > rows and x.device.type == "cpu":
            return torch.cat([self._forward(x[i : i + rows]) for i in range(0, x.shape[0], rows)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.silu_mul is not None and self.silu_mul.takes(x.shape[0]):
            return self.down_proj.forward(self.silu_mul(x))  # bitwise silu_and_mul of small_linear's gate_up
        gate_up = self.gate_up_proj.forward(x)  # [T, 2 I]
        if self.fused is not None:
            act = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
            self.fused.silu_and_mul(act, gate_up)
            return self.down_proj.forward(act)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 like transformers."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused: ModuleType | None = None

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (``residual = x`` when None), then the norm of it.

        With the fused ops the add happens in place on ``residual`` (a tensor
        the forward pass owns: never an input of the model).

        Returns:
            ``(normed [T, H], the new residual [T, H])``, both in ``x``'s dtype.
        """
        if residual is None:
            return self.forward(x), x
        if self.fused is not None:
            out = torch.empty_like(x)
            self.fused.add_rms_norm(out, x, residual, self.weight, self.eps)
            return out, residual
        residual = residual + x
        return self.forward(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]`` in ``x``'s dtype."""
        if self.fused is not None:
            out = torch.empty_like(x)
            self.fused.rms_norm(out, x, self.weight, self.eps)
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers rounds the normed activations to x's dtype before the weight multiplies.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
