"""The disk tier: idle sessions' KV in files, so they outlive the host tier and a restart.

One file per session (:mod:`streamkv.cache.kv_file`), named by a hash of the
session id and the fingerprint, holding the fingerprint of what produced the KV. Writes and deletes
run on one background thread fed by a bounded queue (the engine thread waits
only when the queue is full); reads (a session's next turn, once per
restore) and their CRC-32 check run on a reader thread
(:meth:`DiskTier.take_async`), so a step never waits for the disk. Faults cost the session its saved KV and
nothing else: a full disk, a read-only directory, a truncated or corrupt
file, a file of another model or cache layout give one log line (per kind of
fault), a counted error, and the turn recomputes.

The index (which sessions are on disk, LRU first) belongs to the engine
thread; the writer and reader threads share only the pending writes, the
failures and the counters, under a lock.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamkv.cache.block_copy import layer_bytes
from streamkv.cache.kv_file import KVFileError, read_kv_file, read_kv_header, write_kv_file

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"

Saved = tuple[list[int], list[int], list[list[torch.Tensor]]]  # (token_ids, history_tail, data) of a session


def kv_fingerprint(
    model: torch.nn.Module,
    model_path: str | None,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    block_size: int,
    kv_shape: list[int],
) -> dict[str, Any]:
    """What must match for saved KV to be reused: model identity, dtypes, block size, KV layout.

    The model is identified by its weights file (path, size and mtime; for a
    folder, those of its weight files) and by a CRC-32 of a strided sample
    of its first parameter, so two random models of one config differ too.
    ``kv_shape`` is a device KV tensor's shape without the block count.
    """
    files: list[list[Any]] = []
    if model_path is not None:
        p = Path(model_path)
        paths = [p] if p.is_file() else sorted(q for q in p.glob("*") if q.suffix in (".safetensors", ".bin", ".gguf"))
        for q in paths:
            st = q.stat()
            files.append([str(q.resolve()), st.st_size, int(st.st_mtime)])
    first = next(model.parameters()).detach().reshape(-1)
    sample = first[:: max(1, first.numel() // 65536)].to("cpu", torch.float32).contiguous()
    return {
        "weights": files,
        "weights_crc32": zlib.crc32(sample.numpy().tobytes()),
        "dtype": str(dtype).removeprefix("torch."),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "block_size": block_size,
        "kv_shape": kv_shape,
    }


@dataclass(slots=True)
class DiskEntry:
    """A session in the disk tier (its file may still be in the write queue)."""

    session_id: str
    token_ids: list[int]
    history_tail: list[int]
    num_blocks: int
    num_bytes: int
    path: Path
    write: _Write | None = None  # the pending write, while it is pending


@dataclass(slots=True)
class _Write:
    entry: DiskEntry
    data: list[list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class DiskStats:
    """The disk tier's gauges and counters (see :class:`streamkv.cache.cache_stats.OffloadStats`)."""

    sessions: int = 0
    blocks: int = 0
    bytes: int = 0
    restored_sessions: int = 0
    restored_blocks: int = 0
    dropped_sessions: int = 0
    errors: int = 0
    written_bytes: int = 0
    read_bytes: int = 0


class DiskTier:
    """Session KV files under ``directory``, at most ``max_bytes`` of them.

    Args:
        directory: created if missing. When it cannot be written, the tier
            only reads (sessions saved earlier still restore) and says so once.
        max_bytes: cap on the files' total size; the least recently used
            sessions are dropped to stay under it.
        fingerprint: :func:`kv_fingerprint` of this engine; files with another
            one are left alone and never read.
        max_queue: writes and deletes waiting for the writer thread.
    """

    def __init__(self, directory: str | Path, max_bytes: int, fingerprint: dict[str, Any], max_queue: int = 16):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.entries: OrderedDict[str, DiskEntry] = OrderedDict()  # LRU first; engine thread only
        self.num_bytes = 0
        self._lock = threading.Lock()
        self._failed: list[DiskEntry] = []  # writes that failed; the engine thread forgets them
        self._logged: set[str] = set()
        self._c = {"restored_sessions": 0, "restored_blocks": 0, "dropped": 0, "errors": 0, "written": 0, "read": 0}
        self.writable = self._prepare()
        self.saved_at_start = self._scan()
        self._queue: queue.Queue[_Write | Path | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="streamkv-kv-offload", daemon=True)
        self._thread.start()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamkv-kv-read")

    # ----------------------------------------------------------- engine thread

    def put(
        self, session_id: str, token_ids: list[int], history_tail: list[int], data: list[list[torch.Tensor]]
    ) -> bool:
        """Queue a session's KV (CPU tensors, per layer) for writing; ``False`` if it is not kept.

        Replaces the session's earlier file. Drops least recently used
        sessions to stay under ``max_bytes``.
        """
        self._reap()
        self.discard(session_id)
        if not self.writable:
            return False
        size = layer_bytes(data) + 8 * (len(token_ids) + len(history_tail)) + 4096  # header estimate
        if size > self.max_bytes:
            self._count_drop(1)
            return False
        while self.entries and self.num_bytes + size > self.max_bytes:
            self.discard(next(iter(self.entries)))
            self._count_drop(1)
        entry = DiskEntry(session_id, token_ids, history_tail, data[0][0].shape[1] if data else 0, size,
                          self._path(session_id))  # fmt: skip
        entry.write = _Write(entry, data)
        self.entries[session_id] = entry
        self.num_bytes += size
        self._queue.put(entry.write)
        return True

    def take_async(self, session_id: str) -> Future[Saved | None] | None:
        """Start taking a session back; ``None`` when it is not here, else a future of :meth:`take`'s result.

        The index changes at once (engine thread); the file is read and its
        CRC-32 checked on the reader thread, so the engine keeps stepping. A
        session whose write is still queued comes back at once, from memory.
        """
        self._reap()
        entry = self.entries.pop(session_id, None)
        if entry is None:
            return None
        self.num_bytes -= entry.num_bytes
        with self._lock:
            write, entry.write = entry.write, None
        if write is None:
            return self._reader.submit(self._read, entry)
        done: Future[Saved | None] = Future()  # still queued or being written: the writer deletes what it wrote
        self._count_restore(entry.num_blocks)
        done.set_result((entry.token_ids, entry.history_tail, write.data))
        return done

    def take(self, session_id: str) -> Saved | None:
        """Remove a session from the tier and return ``(token_ids, history_tail, data)``, or ``None``.

        ``None`` when the session is not here or its file cannot be used
        (logged once per kind, counted; the caller recomputes). Waits for the read.
        """
        future = self.take_async(session_id)
        return None if future is None else future.result()

    def discard(self, session_id: str) -> None:
        """Forget a session and delete its file (the session is gone, or superseded)."""
        entry = self.entries.pop(session_id, None)
        if entry is None:
            return
        self.num_bytes -= entry.num_bytes
        with self._lock:
            entry.write = None
        self._delete(entry.path)

    def stats(self) -> DiskStats:
        self._reap()
        with self._lock:
            c = dict(self._c)
        return DiskStats(
            sessions=len(self.entries),
            blocks=sum(e.num_blocks for e in self.entries.values()),
            bytes=self.num_bytes,
            restored_sessions=c["restored_sessions"],
            restored_blocks=c["restored_blocks"],
            dropped_sessions=c["dropped"],
            errors=c["errors"],
            written_bytes=c["written"],
            read_bytes=c["read"],
        )

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued reads and writes, stop the reader and writer threads (idempotent)."""
        self._reader.shutdown(wait=True)  # a read queues its file's deletion for the writer
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # ------------------------------------------------------------ internals

    def _path(self, session_id: str) -> Path:
        # the fingerprint is in the name too: engines of two layouts sharing a directory never clobber
        key = json.dumps(self.fingerprint, sort_keys=True) + "\0" + session_id
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + _SUFFIX)

    def _delete(self, path: Path) -> None:
        if self.writable:
            self._queue.put(path)

    def _count_drop(self, n: int) -> None:
        with self._lock:
            self._c["dropped"] += n

    def _count_restore(self, num_blocks: int) -> None:
        with self._lock:
            self._c["restored_sessions"] += 1
            self._c["restored_blocks"] += num_blocks

    def _fault(self, kind: str, message: str) -> None:
        """Log a fault once per kind (later ones at debug level) and count it."""
        with self._lock:
            self._c["errors"] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        (logger.warning if first else logger.debug)("kv offload dir %s: %s", self.directory, message)

    def _reap(self) -> None:
        with self._lock:
            failed, self._failed = self._failed, []
        for entry in failed:
            if self.entries.get(entry.session_id) is entry:
                del self.entries[entry.session_id]
                self.num_bytes -= entry.num_bytes

    def _prepare(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            for stale in self.directory.glob(".*.tmp"):
                stale.unlink(missing_ok=True)
            return True
        except OSError as e:
            self._fault("dir", f"cannot write ({e.strerror or e}); offloaded sessions are not saved to disk")
            return False

    def _scan(self) -> list[DiskEntry]:
        if not self.directory.is_dir():
            return []
        found: list[tuple[float, DiskEntry]] = []
        other = bad = 0
        for path in self.directory.glob("*" + _SUFFIX):
            try:
                h = read_kv_header(path)
                st = path.stat()
            except (KVFileError, OSError) as e:
                bad += 1
                logger.debug("unusable session file: %s", e)
                if self.writable:
                    path.unlink(missing_ok=True)
                continue
            if h.fingerprint != self.fingerprint:
                other += 1
                continue
            found.append((st.st_mtime, DiskEntry(h.session_id, h.token_ids, h.history_tail, h.num_blocks,
                                                 st.st_size, path)))  # fmt: skip
        for _, entry in sorted(found, key=lambda x: x[0]):
            self.entries[entry.session_id] = entry
            self.num_bytes += entry.num_bytes
        if other:
            logger.warning("kv offload dir %s: %d saved sessions are of another model, dtype or block size; "
                           "they are not loaded (those conversations recompute)", self.directory, other)  # fmt: skip
        if bad:
            self._fault("scan", f"{bad} truncated or corrupt session files removed")
        logger.info("kv offload dir %s: %d saved sessions (%.1f MiB)", self.directory, len(found),
                    self.num_bytes / 2**20)  # fmt: skip
        return list(self.entries.values())

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if isinstance(item, Path):
                    item.unlink(missing_ok=True)
                else:
                    self._write(item)
            except OSError as e:
                self._fault("delete", f"cannot delete a session file ({e})")
            finally:
                self._queue.task_done()

    def _read(self, entry: DiskEntry) -> Saved | None:
        """Reader thread: read and check a session file, then queue its deletion; ``None`` if unusable."""
        t0 = time.perf_counter()
        try:
            header, data = read_kv_file(entry.path, self.fingerprint)
            if header.session_id != entry.session_id:
                raise KVFileError(f"{entry.path.name}: holds another session")
        except (KVFileError, OSError) as e:
            self._fault("read", f"saved KV of a session not usable, it recomputes: {e}")
            self._delete(entry.path)
            return None
        with self._lock:
            self._c["read"] += header.payload_bytes
        logger.debug("read %d KV blocks from disk in %.1f ms", header.num_blocks, 1e3 * (time.perf_counter() - t0))
        self._count_restore(header.num_blocks)
        self._delete(entry.path)
        return header.token_ids, header.history_tail, data

    def _write(self, w: _Write) -> None:
        e = w.entry
        with self._lock:
            if e.write is not w:
                return  # taken back or discarded before it was written
        try:
            size = write_kv_file(e.path, self.fingerprint, e.session_id, e.token_ids, e.history_tail, w.data)
        except OSError as exc:
            kind = errno.errorcode.get(exc.errno or 0, "write")
            self._fault(kind, f"cannot save a session's KV ({exc.strerror or exc}); it will recompute")
            with self._lock:
                if e.write is w:
                    e.write = None
                    self._failed.append(e)
            return
        with self._lock:
            self._c["written"] += size
            if e.write is w:
                e.write = None
                return
        e.path.unlink(missing_ok=True)  # taken back or discarded while being written
