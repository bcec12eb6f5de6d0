"""The model runner: KV tensors, flat batches, the forward pass, block copies.

Makes no policy decision: it computes what :class:`SchedulerOutput` says.
Also here, because they are about the device rather than about policy:
device and attention backend selection, and the GPU memory-profiling pass
that sizes the KV pool.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.kv_layout import allocate_kv_cache, resolve_kv_format
from streamkv.attention.metadata import AttentionMetadata
from streamkv.cache.block_copy import LayerKV, copy_blocks, gather_blocks, scatter_blocks
from streamkv.model.loader import LoadedModel
from streamkv.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block across all layers, quantization scales included.

    ``block_size x`` :meth:`KVCacheFormat.bytes_per_token` (2 x layers x Hkv x
    row bytes); ``kv_cache_dtype`` as ``--kv-cache-dtype`` (``auto``: the model dtype).
    """
    m = loaded.model
    fmt = resolve_kv_format(kv_cache_dtype, loaded.dtype)
    return block_size * fmt.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim)


class ModelRunner:
    """Runs the model over a step's flat batch against the paged KV pool.

    Args:
        loaded: the model and its metadata.
        backend: attention backend (torch or triton).
        num_blocks: device KV blocks.
        block_size: tokens per block.
        num_host_blocks: host blocks for swapped-out KV.
        device: where the model and the KV pool live.
        kv_cache_dtype: ``--kv-cache-dtype`` (``auto``: the model dtype); the
            layout is :mod:`streamkv.attention.kv_layout`'s.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = loaded.model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        m = self.model
        self.kv_format = resolve_kv_format(kv_cache_dtype, loaded.dtype)
        self.kv_bytes_per_token = self.kv_format.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            allocate_kv_cache(self.kv_format, num_blocks, block_size, m.num_kv_heads, m.head_dim, device)
            for _ in range(m.num_layers)
        ]
        pin = device.type == "cuda"
        # empty, not zeros: a host block is read only after a copy filled it, and untouched
        # pages of a large swap space cost no memory until used
        self.host_caches = [
            allocate_kv_cache(
                self.kv_format, num_host_blocks, block_size, m.num_kv_heads, m.head_dim, "cpu", pin, zeroed=False
            )
            for _ in range(m.num_layers if num_host_blocks else 0)
        ]
        # swaps run on their own CUDA stream; compute waits for them before the forward
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy_seconds = 0.0  # engine-thread time in host <-> device copies (on CUDA: issuing them)

    # Every KV tensor of a layer, as the tier lists block_copy works on (a quantized
    # cache adds its scale tensors to each layer's list; nothing else changes).
    @property
    def device_tier(self) -> list[LayerKV]:
        return [[t] for t in self.kv_caches]

    @property
    def host_tier(self) -> list[LayerKV]:
        return [[t] for t in self.host_caches]

    def read_host_blocks(self, host_block_ids: list[int]) -> list[list[torch.Tensor]]:
        """Copies of host blocks (per layer, per tensor, block dim 1), after any swap in flight."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        return gather_blocks(self.host_tier, host_block_ids)

    def write_host_blocks(self, host_block_ids: list[int], data: list[list[torch.Tensor]]) -> None:
        """Fill host blocks with KV read back from disk (see :func:`scatter_blocks` for errors)."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        scatter_blocks(self.host_tier, host_block_ids, data)

    def read_device_blocks(self, block_ids: list[int]) -> list[list[torch.Tensor]]:
        """CPU copies of device blocks (shutdown: pinned sessions saved to disk)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return gather_blocks(self.device_tier, block_ids)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Apply the step's block copies, run the forward, return logits (:meth:`forward`, then :meth:`logits`).

        Returns:
            ``[num_sampling, vocab]`` in the model's dtype (float32 or bfloat16, not
            widened: see ``compute_logits``): one row per scheduled sequence whose
            ``samples`` is set, in scheduling order.
        """
        return self.logits(self.forward(out))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`'s rows -> their logits ``[num_sampling, vocab]`` (see :meth:`execute`)."""
        if hidden.numel() == 0:
            return torch.empty(0, 0)
        return self.model.compute_logits(hidden, widen=False)

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """:meth:`forward`'s rows -> their greedy tokens, bitwise the argmax of :meth:`logits`, or ``None`` where the
        model computes them only from the logits (``LlamaForCausalLM.greedy_tokens``)."""
        if hidden.numel() == 0:
            return None
        return self.model.greedy_tokens(hidden)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Apply the step's block copies and run the forward.

        Returns:
            the final hidden rows ``[num_sampling, H]`` (model dtype) of the scheduled sequences whose
            ``samples`` is set, in scheduling order; empty when none samples.
        """
        self._apply_copies(out)
        if not out.scheduled:
            return torch.empty(0, 0)
        input_ids: list[int] = []
        positions: list[int] = []
        for s in out.scheduled:
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        meta = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in out.scheduled],
            seq_lens=[s.start_pos + len(s.token_ids) for s in out.scheduled],
            block_tables=[s.block_table for s in out.scheduled],
            block_size=self.block_size,
            device=self.device,
        )
        sampling = [i for i, s in enumerate(out.scheduled) if s.samples]
        # A step with prefill rows uses the last row of each sampling sequence only: the model runs its last
        # layer past the K/V write on those rows alone. A pure-decode step's rows all sample.
        output_rows = meta.last_rows(sampling) if len(sampling) < len(input_ids) else None
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
            self.backend,
            output_rows,
        )
        if not sampling:
            return torch.empty(0, 0)
        if output_rows is None:
            hidden = hidden[torch.tensor([meta.query_start_loc_cpu[i + 1] - 1 for i in sampling], device=self.device)]
        return hidden

    def _apply_copies(self, out: SchedulerOutput) -> None:
        stream = self._copy_stream
        t0 = time.perf_counter()
        if stream is not None and (out.swap_out or out.swap_in):
            stream.wait_stream(torch.cuda.current_stream(self.device))  # device blocks as of now
        with torch.cuda.stream(stream) if stream is not None else _no_stream():
            if out.swap_out:
                # list order: a later copy into a host block wins, so keep one copy per host
                # block, the last decided (index_put with duplicate indices is unordered).
                # Device -> host is blocking: the host side is written by the CPU right after.
                last = {h: d for d, h in out.swap_out}
                copy_blocks(self.device_tier, self.host_tier, list(last.values()), list(last))
            if out.swap_in:
                copy_blocks(self.host_tier, self.device_tier, [h for h, _ in out.swap_in],
                            [d for _, d in out.swap_in], non_blocking=True)  # fmt: skip
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.copy_seconds += time.perf_counter() - t0
        if out.copies:
            copy_blocks(self.device_tier, self.device_tier, [s for s, _ in out.copies], [d for _, d in out.copies])


@contextlib.contextmanager
def _no_stream() -> Iterator[None]:
    yield


# ------------------------------------------------------- device and memory


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU; other names pass through."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks triton on CUDA; on the CPU the C++ ``cpu`` backend when its op builds, else torch.

    triton and the C++ op are imported (built) lazily. A CPU op that cannot be
    built is logged by :func:`streamkv.ops.cpu_ops.load_cpu_ops`.
    """
    if name == "auto" and device.type == "cuda":
        name = "triton"
    elif name == "auto":
        from streamkv.attention.cpu_paged import cpu_ops_available

        name = "cpu" if cpu_ops_available() else "torch"
    if name == "cpu":
        from streamkv.attention.cpu_paged import CpuPagedAttention

        return CpuPagedAttention()
    if name == "triton":
        from streamkv.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention()
    from streamkv.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention()


def profile_kv_budget(
    loaded: LoadedModel,
    device: torch.device,
    utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
) -> int:
    """Device bytes left for KV after a forward at the full token budget (vLLM's profile run).

    Runs the model once over ``max_num_batched_tokens`` dummy tokens with the
    torch backend (KV in ``kv_cache_dtype``, so a quantized pool's dequantize
    scratch counts) and logits for ``max_num_seqs`` rows, then returns
    ``total * utilization - peak - memory used by other processes`` (>= 0).
    CUDA only.
    """
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    n = max_num_batched_tokens
    m = loaded.model
    nb = -(-n // block_size)
    fmt = resolve_kv_format(kv_cache_dtype, loaded.dtype)
    caches = [allocate_kv_cache(fmt, nb, block_size, m.num_kv_heads, m.head_dim, device) for _ in range(m.num_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], block_size, device)
    with torch.inference_mode():
        hidden = m(torch.zeros(n, dtype=torch.long, device=device),
                   torch.arange(n, device=device), caches, meta, make_backend("torch", device))  # fmt: skip
        m.compute_logits(hidden[-min(n, max_num_seqs):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    del caches, hidden
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - peak - used_by_others
    gib = 2**30
    logger.info("GPU profile: peak %.2f GiB of %.2f GiB; KV budget %.2f GiB", peak / gib, total / gib, budget / gib)
    return max(budget, 0)
