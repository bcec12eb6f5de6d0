"""Build and load the C++ CPU ops in ``csrc/`` (paged decode attention).

The extension is JIT-compiled by :func:`torch.utils.cpp_extension.load` with
``-O3 -march=native -fopenmp`` into a per-user cache folder
(``~/.cache/streamkv/torch_extensions/<torch version>``); ``make install``
runs ``python -m streamkv.ops.cpu_ops`` so the first server start does not
pay the ~1 minute compile. Later loads reuse the build (cpp_extension rebuilds
only when the sources or flags change).

``-march=native`` ties the build to the CPU family it was compiled on; the
cache folder is per machine, so that is the machine that runs it.

When there is no compiler (or the build fails for any other reason),
:func:`load_cpu_ops` returns ``None`` once, logs why, and callers fall back to
the torch reference path.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

EXTENSION_NAME = "streamkv_cpu_ops"
SOURCES = (Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp",)
CFLAGS = ("-O3", "-march=native", "-fopenmp")


def build_directory() -> Path:
    """Where the compiled extension lives: one folder per torch version (the ABI it links against)."""
    return Path.home() / ".cache" / "streamkv" / "torch_extensions" / torch.__version__.replace("+", "_")


@functools.cache
def load_cpu_ops() -> ModuleType | None:
    """The compiled extension module, building it on first use; ``None`` when it cannot be built.

    The result is cached for the process, so a failed build is tried (and
    logged) once.
    """
    from torch.utils import cpp_extension

    folder = build_directory()
    start = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a compile error: all mean "use torch ops"
        logger.warning("streamkv CPU ops unavailable (%s: %s); using the torch attention path", type(exc).__name__, exc)
        return None
    logger.info("streamkv CPU ops loaded from %s in %.1f s", folder, time.perf_counter() - start)
    return module


def main() -> int:
    """``python -m streamkv.ops.cpu_ops``: build now (``make install``); exit 0 either way, say which."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = load_cpu_ops() is not None
    print(f"streamkv CPU ops: {'built' if ok else 'NOT built (the torch attention path will run)'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
