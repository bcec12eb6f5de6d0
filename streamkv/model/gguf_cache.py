"""A GGUF's transformers load kept on disk, so that a restart does not parse the file again.

transformers reads a ``.gguf`` through gguf-py three times per load
(tokenizer, config, weights), and streamkv once more for the codes
(:func:`streamkv.model.gguf_codes.gguf_tensor_table`). For the default
94 MiB model that is ~15 s of a ~19 s load, nearly all of it gguf-py
building the metadata fields (a 49,152-token vocabulary and its merges) and
transformers mapping tensor names. The weights themselves de-quantize in
~1.5 s.

The first load of a file saves what transformers built, through its own
``save_pretrained`` (float32 safetensors, config, generation config,
tokenizer and chat template), and the file's tensor table into
``<cache dir>/gguf-<key>/``. The key digests the file's bytes (sha256,
~0.1 s for the default model), the transformers version and
:data:`FORMAT`, not its name: a copy of the file elsewhere, or renamed, hits.
Later loads of the same bytes read that folder with ``from_pretrained``
(~0.3 s) and memory-map the codes through the table.

An entry is written to a temporary folder, reloaded and compared bitwise
with the weights it came from, and only then renamed into place, so a
reader sees a whole entry or none. A rename that loses to another process
writing the same entry leaves that one. The manifest lists the entry's
files and their sizes; an entry with a file missing or of another size, a
tensor table that does not fit the file, or anything that fails to load is
removed and the file parsed again. The cache is bounded in bytes
(``--gguf-cache-space``): when an entry is written or read, the least
recently used others go first, and an entry that would not fit is not
written (one already there that no longer fits still serves).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from streamkv.model.gguf_codes import GGUFTensor

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when an entry's layout or meaning changes: old entries stop matching and age out
MANIFEST = "streamkv-gguf-cache.json"  # written last: a folder without it is not an entry
MIN_FREE_BYTES = 1 << 30  # an entry is not written if the disk would be left with less free


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def entry_bytes(folder: Path) -> int:
    """Bytes of the files in ``folder`` (not recursive: an entry is flat)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def save_dequantized(model: Any, tokenizer: Any, folder: Path) -> None:
    """Save a model transformers de-quantized from a GGUF, and its tokenizer, as a plain float32 folder.

    transformers marks such a model as "gguf"-quantized and refuses to save
    it, though its weights are ordinary float32 tensors; a shallow copy
    without the marks is saved (``model`` is left as it is). The folder is
    reloaded and compared bitwise.

    Raises:
        RuntimeError: the reloaded weights differ from ``model``'s.
        OSError: the folder cannot be written.
    """
    from transformers import AutoModelForCausalLM

    plain = copy.copy(model)  # shares the parameters; the attributes set below are the copy's own
    plain.config = copy.deepcopy(model.config)
    plain.hf_quantizer = None
    plain.is_quantized = False
    if hasattr(plain.config, "quantization_config"):
        del plain.config.quantization_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    want, got = model.state_dict(), again.state_dict()
    differ = sorted(k for k in want.keys() | got.keys() if not _same(want.get(k), got.get(k)))
    if differ:
        raise RuntimeError(f"saved weights differ from the loaded ones: {differ[:5]}")


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and torch.equal(a, b)


class GGUFCache:
    """The folder of saved GGUF loads, bounded to ``max_bytes``.

    Args:
        root: the cache folder (created when the first entry is written).
        max_bytes: most bytes all entries may take together.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        self.root = root.expanduser()
        self.max_bytes = max_bytes

    def entry(self, gguf: Path) -> tuple[Path, dict[str, Any]]:
        """The entry folder of ``gguf``'s bytes and the manifest it must hold (without its files and table).

        Raises:
            OSError: ``gguf`` cannot be read.
        """
        import transformers

        identity = {
            "format": FORMAT,
            "gguf_sha256": file_sha256(gguf),
            "gguf_bytes": gguf.stat().st_size,
            "transformers": transformers.__version__,
        }
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        return self.root / f"gguf-{key}", identity

    def load(self, folder: Path, identity: dict[str, Any]) -> tuple[Any, Any, dict[str, GGUFTensor]] | None:
        """transformers' model and tokenizer from the entry, and the GGUF's tensor table; None when there is none.

        An entry that does not match ``identity`` or its own manifest, or does not load, is removed (logged).
        """
        if not folder.exists():
            return None
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            table = _checked_manifest(folder, manifest, identity)
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        except Exception as e:  # noqa: BLE001 (any failure means the entry is not usable: parse the GGUF instead)
            self._drop(folder, f"{type(e).__name__}: {e}")
            return None
        try:
            os.utime(folder / MANIFEST)  # most recently used
            # A lowered --gguf-cache-space takes effect now, not at the next new file: the others make room.
            self._evict(self.max_bytes - entry_bytes(folder), keep=folder)
        except OSError:  # a cache others wrote and this user only reads: the entry serves all the same
            pass
        return model, tokenizer, table

    def store(
        self, folder: Path, identity: dict[str, Any], model: Any, tokenizer: Any, table: dict[str, GGUFTensor]
    ) -> bool:
        """Write the entry (see the module docstring); False, logged, when it is not written."""
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
        need = sum(tensors.values())  # tied weights (embedding and LM head) are saved once
        if need > self.max_bytes:
            logger.info("GGUF cache: %s not cached: %.2f GiB is over --gguf-cache-space (%.2f GiB)",
                        folder.name, need / 2**30, self.max_bytes / 2**30)  # fmt: skip
            return False
        tmp = self.root / f".{folder.name}.{os.getpid()}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._evict(self.max_bytes - need, keep=folder)
            if shutil.disk_usage(self.root).free < need + MIN_FREE_BYTES:
                logger.warning("GGUF cache: %s not cached: the disk under %s is nearly full", folder.name, self.root)
                return False
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            start = time.perf_counter()
            save_dequantized(model, tokenizer, tmp)
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            manifest = {**identity, "files": files, "tensors": {name: asdict(t) for name, t in table.items()}}
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            try:
                tmp.rename(folder)
            except OSError:  # another process renamed its copy of the same entry first
                if not (folder / MANIFEST).is_file():
                    raise
                logger.info("GGUF cache: %s was written by another process; kept that one", folder.name)
                return True
            logger.info("GGUF cache: saved %s (%.0f MiB) in %.1f s; later loads of this file read it",
                        folder, entry_bytes(folder) / 2**20, time.perf_counter() - start)  # fmt: skip
            return True
        except (OSError, RuntimeError) as e:
            logger.warning("GGUF cache: %s not cached: %s", folder.name, e)
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def total_bytes(self) -> int:
        """Bytes of every entry in the cache (0 when the folder does not exist or cannot be read)."""
        try:
            return sum(size for _, _, size in self._entries())
        except OSError:  # an entry removed while it was being summed, or no permission
            return 0

    def _entries(self) -> list[tuple[float, Path, int]]:
        """(last use, folder, bytes) of each entry, least recently used first."""
        if not self.root.is_dir():
            return []
        found = []
        for folder in self.root.iterdir():
            manifest = folder / MANIFEST
            if not folder.name.startswith(".") and folder.is_dir() and manifest.is_file():  # not a write in progress
                found.append((manifest.stat().st_mtime, folder, entry_bytes(folder)))
        return sorted(found)

    def _evict(self, budget: int, keep: Path) -> None:
        """Remove the least recently used entries until the others take at most ``budget`` bytes.

        Also removes temporary folders more than an hour old (a writer that was killed).
        """
        for tmp in self.root.glob(".*.tmp"):
            try:
                stale = time.time() - tmp.stat().st_mtime > 3600
            except FileNotFoundError:  # its writer finished meanwhile
                continue
            if stale:
                shutil.rmtree(tmp, ignore_errors=True)
        entries = [e for e in self._entries() if e[1] != keep]
        total = sum(size for _, _, size in entries)
        for _, folder, size in entries:
            if total <= budget:
                return
            logger.info("GGUF cache: removing %s (least recently used) to stay within --gguf-cache-space", folder)
            shutil.rmtree(folder, ignore_errors=True)
            total -= size

    def _drop(self, folder: Path, why: str) -> None:
        try:
            shutil.rmtree(folder)
            done = "removed it"
        except OSError as e:
            done = f"could not remove it ({e})"
        logger.warning("GGUF cache: %s is not usable (%s); %s, reading the GGUF", folder, why, done)


def _checked_manifest(folder: Path, manifest: Any, identity: dict[str, Any]) -> dict[str, GGUFTensor]:
    """The entry's tensor table, once its manifest is checked against ``identity``, its files and the GGUF's size.

    Raises:
        ValueError: the manifest names other bytes or versions, a file is missing or of another size, or a tensor
            lies outside the file.
    """
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in identity.items()):
        raise ValueError("its manifest names other bytes or versions")
    for name, size in dict(manifest["files"]).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            raise ValueError(f"{name} is missing or not {size} bytes")
    table = {name: GGUFTensor(**fields) for name, fields in dict(manifest["tensors"]).items()}
    for name, t in table.items():
        if t.rows < 1 or t.nbytes % t.rows or t.offset < 0 or t.offset + t.nbytes > identity["gguf_bytes"]:
            raise ValueError(f"tensor {name} does not fit the GGUF ({t})")
    return table
