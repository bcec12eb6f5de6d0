"""The model runner: KV tensors, flat batches, the forward pass, block copies.

Makes no policy decision: it computes what :class:`SchedulerOutput` says.
"""

from __future__ import annotations

import torch

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.metadata import AttentionMetadata
from streamkv.model.loader import LoadedModel
from streamkv.sched.output import SchedulerOutput


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    """Bytes of one block across all layers: 2 (K and V) x layers x block x kv heads x head dim x dtype size."""
    m = loaded.model
    elem = torch.tensor([], dtype=loaded.dtype).element_size()
    return 2 * m.num_layers * block_size * m.num_kv_heads * m.head_dim * elem


class ModelRunner:
    """Runs the model over a step's flat batch against the paged KV pool.

    Args:
        loaded: the model and its metadata.
        backend: attention backend (torch or triton).
        num_blocks: device KV blocks.
        block_size: tokens per block.
        num_host_blocks: host blocks for swapped-out KV.
        device: where the model and the KV pool live.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = loaded.model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        m = self.model
        shape = (2, num_blocks, block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=loaded.dtype, device=device) for _ in range(m.num_layers)]
        host_shape = (2, num_host_blocks, block_size, m.num_kv_heads, m.head_dim)
        pin = device.type == "cuda"
        self.host_caches = [
            torch.zeros(host_shape, dtype=loaded.dtype, pin_memory=pin) for _ in range(m.num_layers if num_host_blocks else 0)
        ]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Apply the step's block copies, run the forward, return logits.

        Returns:
            float32 ``[num_sampling, vocab]``: one row per scheduled sequence
            whose ``samples`` is set, in scheduling order.
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
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
            self.backend,
        )
        rows = [meta.query_start_loc_cpu[i + 1] - 1 for i, s in enumerate(out.scheduled) if s.samples]
        if not rows:
            return torch.empty(0, 0)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    def _apply_copies(self, out: SchedulerOutput) -> None:
        if out.swap_out:
            src = torch.tensor([d for d, _ in out.swap_out], device=self.device)
            dst = torch.tensor([h for _, h in out.swap_out])
            for dev, host in zip(self.kv_caches, self.host_caches):
                host[:, dst] = dev[:, src].to("cpu")
        if out.swap_in:
            src = torch.tensor([h for h, _ in out.swap_in])
            dst = torch.tensor([d for _, d in out.swap_in], device=self.device)
            for dev, host in zip(self.kv_caches, self.host_caches):
                dev[:, dst] = host[:, src].to(self.device)
        if out.copies:
            src = torch.tensor([s for s, _ in out.copies], device=self.device)
            dst = torch.tensor([d for _, d in out.copies], device=self.device)
            for dev in self.kv_caches:
                dev[:, dst] = dev[:, src]
