"""The ``serve`` flags of idle-session offload (host tier, disk tier), in one block."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from streamkv.config import CacheConfig


def add_offload_args(parser: argparse.ArgumentParser, parse_bytes: Callable[[str], int]) -> None:
    """Add ``--no-session-offload``, ``--kv-offload-dir`` and ``--kv-offload-disk-space``."""
    cache = CacheConfig()
    parser.add_argument(
        "--no-session-offload",
        action="store_true",
        help="a session pin that has to give way is dropped (its next turn recomputes) instead of moving "
        "to host memory (--swap-space) and swapping back in",
    )
    parser.add_argument(
        "--kv-offload-dir",
        default=None,
        help="directory for the disk tier: sessions evicted from the host tier, and at shutdown every idle "
        "session, are saved there and survive a restart (default: none, no disk tier)",
    )
    parser.add_argument(
        "--kv-offload-disk-space",
        type=parse_bytes,
        default=cache.kv_offload_disk_space,
        help="most bytes of session files in --kv-offload-dir; least recently used ones are dropped (default: 4GiB)",
    )


def offload_cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`CacheConfig` fields the flags above set."""
    return {
        "session_offload": not args.no_session_offload,
        "kv_offload_dir": args.kv_offload_dir,
        "kv_offload_disk_space": args.kv_offload_disk_space,
    }
