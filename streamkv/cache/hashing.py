"""Block hashes for automatic prefix caching.

A full block's hash chains its parent's hash, the block's token ids and an
extra key (model identity, adapter): ``H(parent_hash || extra_key || tokens)``,
so equal hashes imply equal prefixes, not just equal blocks (vLLM's
``hash_block_tokens``). SHA-256 over a canonical little-endian int64 encoding,
never Python's ``hash()`` (randomised per process, 64-bit, collides by design).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"\x00" * 32


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """Return the 32-byte chained hash of one full block.

    Args:
        parent: hash of the previous block of the sequence, ``None`` for the first.
        token_ids: exactly ``block_size`` token ids.
        extra_key: anything else that changes the block's KV content.
    """
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack("<I", len(extra_key)))
    h.update(extra_key)
    tokens = array("q", token_ids)
    if tokens.itemsize != 8:  # pragma: no cover - every CPython platform we run on
        raise RuntimeError("array('q') is not 64-bit here")
    h.update(tokens.tobytes())
    return h.digest()
