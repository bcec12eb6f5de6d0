"""One session's KV blocks in one file: a checked header, then the raw tensors.

Layout::

    MAGIC (16 bytes) | header length (u32, little endian) | header (JSON) | payload

The header holds ``version``, ``fingerprint`` (what produced the KV: model,
dtype, KV dtype, block size, KV shape; see
:func:`streamkv.cache.disk_tier.kv_fingerprint`), ``session_id``,
``token_ids`` (tokens whose KV the blocks hold), ``history_tail``,
``num_blocks``, ``tensors`` (per layer, per tensor: ``dtype`` and ``shape``,
block index on dim 1), ``payload_bytes`` and ``crc32`` of the payload. The
payload is every tensor's bytes in layer, then tensor order. Files are
written to a temporary name and renamed, so a reader sees a whole file or
none; a torn or flipped file fails the length or checksum test.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"STREAMKV-KVSESS1"
VERSION = 1
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                                       torch.uint8, torch.float8_e4m3fn)}  # fmt: skip


class KVFileError(ValueError):
    """A session file that cannot be used: bad magic, truncated, corrupt, or another fingerprint."""


@dataclass(slots=True)
class KVFileHeader:
    """A session file's header (see the module doc for the fields)."""

    fingerprint: dict[str, Any]
    session_id: str
    token_ids: list[int]
    history_tail: list[int]
    num_blocks: int
    tensors: list[list[dict[str, Any]]]
    payload_bytes: int
    crc32: int
    offset: int  # where the payload starts in the file


def _spec(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def write_kv_file(
    path: Path,
    fingerprint: dict[str, Any],
    session_id: str,
    token_ids: list[int],
    history_tail: list[int],
    data: list[list[torch.Tensor]],
) -> int:
    """Write a session file atomically (temporary file, fsync, rename); returns its size in bytes.

    Raises:
        OSError: the write failed (full disk, read-only directory...); the
            temporary file is removed and ``path`` is untouched.
    """
    chunks = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for layer in data for t in layer]
    crc = 0
    for c in chunks:
        crc = zlib.crc32(c, crc)
    payload_bytes = sum(len(c) for c in chunks)
    header = {
        "version": VERSION,
        "fingerprint": fingerprint,
        "session_id": session_id,
        "token_ids": token_ids,
        "history_tail": history_tail,
        "num_blocks": data[0][0].shape[1] if data else 0,
        "tensors": [[_spec(t) for t in layer] for layer in data],
        "payload_bytes": payload_bytes,
        "crc32": crc,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<I", len(head)))
            f.write(head)
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(MAGIC) + 4 + len(head) + payload_bytes


def read_kv_header(path: Path) -> KVFileHeader:
    """Read and check a session file's header (not its payload).

    Raises:
        KVFileError: bad magic, a truncated or unparsable header, another version.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            raise KVFileError(f"{path.name}: not a streamkv session file")
        raw = f.read(4)
        if len(raw) != 4:
            raise KVFileError(f"{path.name}: truncated header")
        (n,) = struct.unpack("<I", raw)
        head = f.read(n)
    if len(head) != n:
        raise KVFileError(f"{path.name}: truncated header")
    try:
        h = json.loads(head)
        if h.get("version") != VERSION:
            raise KVFileError(f"{path.name}: format version {h.get('version')!r}, expected {VERSION}")
        return KVFileHeader(
            fingerprint=dict(h["fingerprint"]),
            session_id=str(h["session_id"]),
            token_ids=[int(t) for t in h["token_ids"]],
            history_tail=[int(t) for t in h["history_tail"]],
            num_blocks=int(h["num_blocks"]),
            tensors=h["tensors"],
            payload_bytes=int(h["payload_bytes"]),
            crc32=int(h["crc32"]),
            offset=len(MAGIC) + 4 + n,
        )
    except (ValueError, KeyError, TypeError) as e:
        raise KVFileError(f"{path.name}: bad header ({e})") from None


def read_kv_file(path: Path, fingerprint: dict[str, Any]) -> tuple[KVFileHeader, list[list[torch.Tensor]]]:
    """Read a whole session file and check it against ``fingerprint``.

    Returns the header and the tensors (per layer, per tensor, CPU).

    Raises:
        KVFileError: another fingerprint, a truncated or corrupt payload (length
            or CRC-32), or a bad header.
        OSError: the file cannot be read.
    """
    h = read_kv_header(path)
    if h.fingerprint != fingerprint:
        diff = sorted(k for k in {*h.fingerprint, *fingerprint} if h.fingerprint.get(k) != fingerprint.get(k))
        raise KVFileError(f"{path.name}: saved by another model or cache layout (differs in {', '.join(diff)})")
    with open(path, "rb") as f:
        f.seek(h.offset)
        payload = bytearray(f.read(h.payload_bytes + 1))
    if len(payload) != h.payload_bytes:
        raise KVFileError(f"{path.name}: payload of {len(payload)} bytes, header says {h.payload_bytes}")
    if zlib.crc32(payload) != h.crc32:
        raise KVFileError(f"{path.name}: checksum mismatch (corrupt file)")
    data: list[list[torch.Tensor]] = []
    pos = 0
    buf = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    try:
        for layer in h.tensors:
            row = []
            for spec in layer:
                dtype = _DTYPES[spec["dtype"]]
                shape = [int(x) for x in spec["shape"]]
                nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
                row.append(buf[pos : pos + nbytes].view(dtype).reshape(shape))
                pos += nbytes
            data.append(row)
    except (KeyError, RuntimeError, ValueError) as e:
        raise KVFileError(f"{path.name}: tensor table does not match the payload ({e})") from None
    if pos != len(payload):
        raise KVFileError(f"{path.name}: tensor table covers {pos} of {len(payload)} payload bytes")
    return h, data
