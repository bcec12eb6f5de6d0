"""Block copies between KV tensor lists: the one place that moves KV blocks between tiers.

A layer's KV state is a list of tensors that all carry the block index on
dim 1 (today one tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``; a quantized cache packs its scales into the rows). A tier is a
list of layers. Every function here goes over all tensors of every layer, so
a new tensor in a layer needs no change here.

How a copy runs. Each tensor is seen as rows ``[2, num_blocks, row]`` of
8-byte words (one row = one block of K or of V; 4- or 1-byte words when the
row bytes do not divide by 8), so the speed does not depend on the KV dtype,
and the copy takes the cheapest form its block ids allow::

    both sides consecutive (runs)    dst[:, b:b+n].copy_(src[:, a:a+n])       memcpy
    dst consecutive (an offload)     index_select(src[h], ids, out=dst[h, b:b+n])
    src consecutive (a restore)      dst[h].index_copy_(ids, src[h, a:a+n])
    neither                          dst[h].index_copy_(ids, src[h].index_select(ids))

The host tier hands out consecutive host block ids where it can
(:class:`streamkv.cache.swap_space.SwapSpace`), so a session's offload and
restore always have one consecutive side. Measured on this 2-core box
(loaded, SmolLM2-135M layout: 30 layers, a 60-block session, fp32 42 MiB),
per session: the former ``d[:, idx] = s[:, idx]`` 16-23 ms (1.8-2.5 GiB/s;
0.5-0.8 GiB/s in bf16); dst consecutive 9 ms (4.5 GiB/s), src consecutive
10 ms (4.1 GiB/s), runs 3-4 ms (11-15 GiB/s), in either dtype. Writing into
host pages never touched before costs page faults on top (0.2-0.5 GiB/s in
this VM); the host tier reuses its lowest block ids first, so that is paid
once per page, at the tier's peak use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LayerKV = Sequence[torch.Tensor]  # every tensor of one layer, block index on dim 1

Run = tuple[int, int, int]  # (first source id, first destination id, length)


def _runs(src_ids: list[int], dst_ids: list[int]) -> list[Run]:
    """Maximal stretches where both id lists go up by one."""
    runs: list[Run] = []
    start = 0
    for i in range(1, len(src_ids) + 1):
        if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            runs.append((src_ids[start], dst_ids[start], i - start))
            start = i
    return runs


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[t.shape[0], t.shape[1], words]`` of its bytes, or ``None`` when not contiguous."""
    if not t.is_contiguous() or t.dim() < 2:
        return None
    raw = t.view(torch.uint8).view(t.shape[0], t.shape[1], -1)
    for word in (torch.int64, torch.int32):
        if raw.shape[2] % word.itemsize == 0:
            return raw.view(word)
    return raw


def _few(runs: list[Run], n: int) -> bool:
    return len(runs) <= max(1, n // 4)


class _Plan:
    """One copy's id lists, runs and index tensors (per device, built once per copy)."""

    def __init__(self, src_ids: list[int], dst_ids: list[int]) -> None:
        self.src_ids, self.dst_ids = src_ids, dst_ids
        self.n = len(src_ids)
        self.pairs = _runs(src_ids, dst_ids)
        self.dst_runs = _runs(list(range(self.n)), dst_ids)  # (position in the lists, dst id, length)
        self.src_runs = _runs(src_ids, list(range(self.n)))  # (src id, position, length)
        self._idx: dict[tuple[str, torch.device, int, int], torch.Tensor] = {}

    def index(self, side: str, device: torch.device, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        hi = self.n if hi is None else hi
        key = (side, device, lo, hi)
        if key not in self._idx:
            ids = self.src_ids if side == "src" else self.dst_ids
            self._idx[key] = torch.tensor(ids[lo:hi], device=device)
        return self._idx[key]


def _copy_tensor(s: torch.Tensor, d: torch.Tensor, plan: _Plan, non_blocking: bool) -> None:
    sr, dr = _rows(s), _rows(d)
    if sr is None or dr is None or sr.dtype != dr.dtype or sr.shape[2] != dr.shape[2]:
        # a view that is not contiguous: the general (slower) advanced-index path
        idx_s, idx_d = plan.index("src", s.device), plan.index("dst", d.device)
        _indexable(d)[:, idx_d] = _indexable(s)[:, idx_s].to(d.device, non_blocking=non_blocking)
        return
    same = s.device == d.device
    # one tensor (copy-on-write): index ops refuse an output that shares memory with their input
    alias = same and s.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    if _few(plan.pairs, plan.n):
        for a, b, k in plan.pairs:
            dr[:, b : b + k].copy_(sr[:, a : a + k], non_blocking=non_blocking)
    elif not alias and _few(plan.dst_runs, plan.n):
        for pos, b, k in plan.dst_runs:
            idx = plan.index("src", s.device, pos, pos + k)
            for h in range(sr.shape[0]):
                if same:
                    torch.index_select(sr[h], 0, idx, out=dr[h, b : b + k])
                else:
                    dr[h, b : b + k].copy_(sr[h].index_select(0, idx), non_blocking=non_blocking)
    elif not alias and _few(plan.src_runs, plan.n):
        for a, pos, k in plan.src_runs:
            idx = plan.index("dst", d.device, pos, pos + k)
            for h in range(sr.shape[0]):
                dr[h].index_copy_(0, idx, sr[h, a : a + k].to(d.device, non_blocking=non_blocking))
    else:
        idx_s, idx_d = plan.index("src", s.device), plan.index("dst", d.device)
        for h in range(sr.shape[0]):
            dr[h].index_copy_(0, idx_d, sr[h].index_select(0, idx_s).to(d.device, non_blocking=non_blocking))


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or its bytes for float8 (indexing kernels cover uint8 everywhere, float8 not on every device)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def copy_blocks(
    src: Sequence[LayerKV], dst: Sequence[LayerKV], src_ids: list[int], dst_ids: list[int], non_blocking: bool = False
) -> None:
    """``dst[layer][i][:, dst_ids[k]] = src[layer][i][:, src_ids[k]]`` for every layer and tensor.

    ``src`` and ``dst`` may live on different devices (a swap). ``dst_ids``
    must not repeat (which copy would win is not defined); ``src`` and
    ``dst`` may be the same tier when no id is both a source and a
    destination (copy-on-write).

    Raises:
        ValueError: the id lists differ in length, or the tiers in layout.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
    if not src_ids:
        return
    if len(src) != len(dst) or any(len(s) != len(d) for s, d in zip(src, dst, strict=True)):
        raise ValueError("source and destination tiers differ in layers or tensors per layer")
    plan = _Plan(list(src_ids), list(dst_ids))
    for s_layer, d_layer in zip(src, dst, strict=True):
        for s, d in zip(s_layer, d_layer, strict=True):
            _copy_tensor(s, d, plan, non_blocking)


def gather_blocks(tier: Sequence[LayerKV], block_ids: list[int]) -> list[list[torch.Tensor]]:
    """New contiguous CPU tensors holding ``block_ids`` of every tensor of every layer (block dim 1, in order)."""
    out = [[torch.empty((t.shape[0], len(block_ids), *t.shape[2:]), dtype=t.dtype) for t in layer] for layer in tier]
    copy_blocks(tier, out, block_ids, list(range(len(block_ids))))
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
