"""Block copies between KV tensor lists: the one place that moves KV blocks between tiers.

A layer's KV state is a list of tensors that all carry the block index on
dim 1 (today one tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``; a quantized cache adds its scales as more tensors of the same
layer). A tier is a list of layers. Every function here goes over all
tensors of every layer, so a new tensor in a layer needs no change here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LayerKV = Sequence[torch.Tensor]  # every tensor of one layer, block index on dim 1


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or its bytes for float8 (indexing kernels cover uint8 everywhere, float8 not on every device)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def copy_blocks(
    src: Sequence[LayerKV], dst: Sequence[LayerKV], src_ids: list[int], dst_ids: list[int], non_blocking: bool = False
) -> None:
    """``dst[layer][i][:, dst_ids[k]] = src[layer][i][:, src_ids[k]]`` for every layer and tensor.

    ``src`` and ``dst`` may live on different devices (a swap); indices are
    placed on each side's device.

    Raises:
        ValueError: the id lists differ in length, or the tiers in layout.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
    if not src_ids:
        return
    if len(src) != len(dst) or any(len(s) != len(d) for s, d in zip(src, dst, strict=True)):
        raise ValueError("source and destination tiers differ in layers or tensors per layer")
    s_idx = d_idx = None
    for s_layer, d_layer in zip(src, dst, strict=True):
        for s, d in zip(s_layer, d_layer, strict=True):
            if s_idx is None or s_idx.device != s.device:
                s_idx = torch.tensor(src_ids, device=s.device)
            if d_idx is None or d_idx.device != d.device:
                d_idx = torch.tensor(dst_ids, device=d.device)
            _indexable(d)[:, d_idx] = _indexable(s)[:, s_idx].to(d.device, non_blocking=non_blocking)


def gather_blocks(tier: Sequence[LayerKV], block_ids: list[int]) -> list[list[torch.Tensor]]:
    """New CPU tensors holding ``block_ids`` of every tensor of every layer (block dim 1, in that order)."""
    idx: torch.Tensor | None = None
    out: list[list[torch.Tensor]] = []
    for layer in tier:
        row = []
        for t in layer:
            if idx is None or idx.device != t.device:
                idx = torch.tensor(block_ids, device=t.device)
            row.append(_indexable(t)[:, idx].to("cpu").view(t.dtype))
        out.append(row)
    return out


def scatter_blocks(tier: Sequence[LayerKV], block_ids: list[int], data: Sequence[LayerKV]) -> None:
    """Write ``data`` (as :func:`gather_blocks` returns it) into ``block_ids`` of ``tier``.

    Raises:
        ValueError: ``data`` does not match the tier's layout, dtypes or block count.
    """
    if len(data) != len(tier):
        raise ValueError(f"data has {len(data)} layers, the tier {len(tier)}")
    for layer, rows in zip(tier, data, strict=True):
        if len(rows) != len(layer):
            raise ValueError("data and tier differ in tensors per layer")
        for t, d in zip(layer, rows, strict=True):
            want = (t.shape[0], len(block_ids), *t.shape[2:])
            if tuple(d.shape) != want or d.dtype != t.dtype:
                raise ValueError(f"block data {tuple(d.shape)} {d.dtype} does not fit {want} {t.dtype}")
    copy_blocks(data, tier, list(range(len(block_ids))), block_ids)


def layer_bytes(data: Sequence[LayerKV]) -> int:
    """Bytes of a list of layers' tensors."""
    return sum(t.numel() * t.element_size() for layer in data for t in layer)
