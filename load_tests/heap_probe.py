"""``streamkv serve`` with a memory probe: each SIGUSR1 writes what the process holds, for ``bench_soak``.

    python -m load_tests.heap_probe --probe-dir DIR [--trace-frames N] serve --model ...

Everything after the probe's own flags goes to ``streamkv.server.cli.main``
unchanged. The ``n``-th SIGUSR1 (from 0) writes ``DIR/probe-<n>.json`` (and,
with ``--trace-frames``, ``DIR/heap-<n>.snap``, a tracemalloc snapshot):

- ``rss_mb``: RssAnon + VmSwap on arrival, before anything below runs;
- ``malloc_in_use_mb`` / ``malloc_free_mb``: glibc's ``mallinfo2``, bytes
  handed out (arena chunks in use + mmapped chunks) against bytes it holds
  free in its arenas: the native heap's live part vs its slack;
- ``rss_trimmed_mb``: RssAnon + VmSwap after ``gc.collect()`` and
  ``malloc_trim(0)`` (glibc gives its free pages back), so growth in
  ``rss_mb`` that ``malloc_trim`` undoes is allocator slack, not live memory;
- ``py_blocks``: ``sys.getallocatedblocks()``, live pymalloc blocks (all
  Python objects, free of tracemalloc's cost);
- ``gc_types``: live gc-tracked objects per type (dicts, requests, tasks ...);
- ``asyncio_tasks``, ``threads``;
- ``onednn_linear_shapes``: distinct ``(rows, in, out)`` shapes the
  oneDNN-prepacked linears have run. Each new shape costs native memory in
  two least-recently-used caches, about 0.28 MB in each (measured on the
  tiny model): oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``
  entries) and ideep's, torch's oneDNN wrapper (``LRU_CACHE_CAPACITY``), both
  1024 by default in the libraries, 256 as ``streamkv serve`` sets them
  (``--onednn-cache-capacity``). Native memory grows with this count until
  both are full, then stays flat; ``onednn_cache_capacity`` is the larger of
  the two capacities as the server set them (both caches are full once the
  count reaches it). The probe imports torch before ``serve`` sets the
  variables; they still take effect, being read at the first matmul
  (``load_tests.bench_onednn_cache``);
- ``traced_mb`` (with ``--trace-frames``): tracemalloc's traced Python heap.

The probe runs on the main thread (the event loop's) between bytecodes: send
it while the server is idle. Linux and glibc only. Not part of the server:
it is a load-test tool and never imported by ``streamkv``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import ctypes.util
import gc
import json
import os
import signal
import sys
import threading
import tracemalloc
from pathlib import Path
from types import FrameType
from typing import Any

from streamkv.server.onednn_cache import ENV_VARS, LIBRARY_DEFAULT_CAPACITY

MB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2") or not hasattr(libc, "malloc_trim"):
        return None  # not glibc >= 2.33
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def rss_anon_plus_swap(pid: int | str = "self") -> int:
    """Bytes of RssAnon + VmSwap of a process (Linux ``/proc/<pid>/status``)."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmSwap"):
            total += int(value.split()[0]) * 1024
    return total


def malloc_in_use_and_free(libc: ctypes.CDLL) -> tuple[int, int]:
    """(bytes malloc has handed out, bytes it holds free in its arenas), from glibc's ``mallinfo2``."""
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def gc_type_counts() -> dict[str, int]:
    """Live gc-tracked objects per ``module.qualname`` of their type."""
    counts: collections.Counter[str] = collections.Counter()
    for obj in gc.get_objects():
        t = type(obj)
        counts[f"{t.__module__}.{t.__qualname__}"] += 1
    return dict(counts)


def _asyncio_tasks() -> int | None:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # the signal landed outside the running loop
        return None


ONEDNN_DEFAULT_CACHE_CAPACITY = LIBRARY_DEFAULT_CAPACITY  # oneDNN's primitive cache and ideep's LRU cache alike
ONEDNN_CACHE_ENV = ENV_VARS  # oneDNN's, ideep's


def onednn_cache_capacity() -> int:
    """The larger of oneDNN's and ideep's cache capacities here (their env vars, else 1024): both are full at it."""
    return max(int(os.environ.get(name) or ONEDNN_DEFAULT_CACHE_CAPACITY) for name in ONEDNN_CACHE_ENV)


def count_linear_shapes() -> set[tuple[int, int, int]]:
    """Record each ``(rows, in, out)`` a prepacked :class:`~streamkv.model.linear.Linear` runs, from now on.

    Wraps ``Linear.forward`` (a set insert per call); the returned set fills
    as the server runs (on its engine thread; a ``len`` from another thread is
    safe under the GIL).
    """
    from streamkv.model.linear import Linear

    seen: set[tuple[int, int, int]] = set()
    forward = Linear.forward

    def counting_forward(self: Linear, x: Any) -> Any:
        if self.packed_weight is not None:
            seen.add((x.shape[0], self.in_features, self.out_features))
        return forward(self, x)

    Linear.forward = counting_forward  # type: ignore[method-assign]
    return seen


class Probe:
    """Answers SIGUSR1 with ``probe-<n>.json`` (and ``heap-<n>.snap`` when tracing) in ``probe_dir``."""

    def __init__(self, probe_dir: Path, trace_frames: int | None) -> None:
        self.probe_dir = probe_dir
        self.trace_frames = trace_frames
        self.libc = _libc()
        self.n = 0
        self.linear_shapes: set[tuple[int, int, int]] = set()

    def install(self) -> None:
        if self.trace_frames:
            tracemalloc.start(self.trace_frames)
        self.linear_shapes = count_linear_shapes()
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        n, self.n = self.n, self.n + 1
        record: dict[str, object] = {"n": n, "rss_mb": rss_anon_plus_swap() / MB}
        gc.collect()
        record["py_blocks"] = sys.getallocatedblocks()
        record["asyncio_tasks"] = _asyncio_tasks()
        record["threads"] = threading.active_count()
        record["onednn_linear_shapes"] = len(self.linear_shapes)
        record["onednn_cache_capacity"] = onednn_cache_capacity()
        if tracemalloc.is_tracing():
            record["traced_mb"] = tracemalloc.get_traced_memory()[0] / MB
            snap = tracemalloc.take_snapshot().filter_traces(
                [
                    tracemalloc.Filter(False, tracemalloc.__file__),
                    tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
                ]
            )
            snap.dump(str(self.probe_dir / f"heap-{n}.snap"))
        record["gc_types"] = gc_type_counts()
        if self.libc is not None:
            in_use, free = malloc_in_use_and_free(self.libc)
            record["malloc_in_use_mb"], record["malloc_free_mb"] = in_use / MB, free / MB
            self.libc.malloc_trim(0)
        record["rss_trimmed_mb"] = rss_anon_plus_swap() / MB
        tmp = self.probe_dir / f"probe-{n}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.probe_dir / f"probe-{n}.json")  # the reader never sees half a file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe-dir", type=Path, required=True, help="where probe-<n>.json files go")
    parser.add_argument("--trace-frames", type=int, default=None, help="run tracemalloc with this many frames")
    parser.add_argument("streamkv_argv", nargs=argparse.REMAINDER, help="streamkv's arguments (serve ...)")
    args = parser.parse_args(argv)
    Probe(args.probe_dir, args.trace_frames).install()
    from streamkv.server.cli import main as streamkv_main

    return streamkv_main(args.streamkv_argv)


if __name__ == "__main__":
    sys.exit(main())
