"""Build and load the C++ CPU ops in ``csrc/``: paged decode and prefill attention, fused layer ops, small-batch linear.

Four extensions, built and loaded independently so one that fails to build
costs only its own fast path: ``streamkv_cpu_ops`` (``paged_attention.cpp`` and ``paged_prefill.cpp``,
:func:`load_cpu_ops`), ``streamkv_fused_ops`` (``fused_layers.cpp``:
residual add + RMSNorm, SiLU-and-mul, RoPE; :func:`load_fused_ops`),
``streamkv_linear_ops`` (``small_linear.cpp``: the matmuls of decode steps;
:func:`load_linear_ops`) and ``streamkv_decode_ops`` (``decode_layer.cpp``
with the other sources compiled in: a decode step's layer in one call;
:func:`load_decode_ops`).

The extension is JIT-compiled by :func:`torch.utils.cpp_extension.load` with
``-O3 -march=native -fopenmp`` into a per-user cache folder
(``~/.cache/streamkv/torch_extensions/<torch version>/<digest of the sources>``
for the attention ops, ``fused-``, ``linear-`` and ``decode-<digest>`` for the others); ``make install``
runs ``python -m streamkv.ops.cpu_ops`` so the first server start does not
pay the ~1 minute compile. Later loads reuse the build (cpp_extension rebuilds
only when the sources or flags change).

``-march=native`` ties the build to the CPU family it was compiled on; the
cache folder is per machine, so that is the machine that runs it.

A build killed part-way (Ctrl-C during the first start) leaves cpp_extension's
``lock`` file in its folder; the next load removes it and builds again
instead of waiting on it forever (:func:`_build_lock`).

When there is no compiler (or the build fails for any other reason),
:func:`load_cpu_ops` returns ``None`` once, logs why, and callers fall back to
the torch reference path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from streamkv.config import cache_root

logger = logging.getLogger(__name__)

EXTENSION_NAME = "streamkv_cpu_ops"
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "paged_prefill.cpp")
# Headers the sources include: not compiled themselves, but a change to one must rebuild.
HEADERS = tuple(_CSRC / h for h in ("amx.h", "kv_row.h", "kv_tile.h", "simd_math.h", "ops.h", "work_split.h"))
FUSED_EXTENSION_NAME = "streamkv_fused_ops"
FUSED_SOURCES = (_CSRC / "fused_layers.cpp",)
FUSED_HEADERS = (_CSRC / "ops.h", _CSRC / "simd_math.h", _CSRC / "silu_table.h")
LINEAR_EXTENSION_NAME = "streamkv_linear_ops"
LINEAR_SOURCES = (_CSRC / "small_linear.cpp", _CSRC / "greedy_head.cpp")
LINEAR_HEADERS = (_CSRC / "amx.h", _CSRC / "ops.h", _CSRC / "simd_math.h", _CSRC / "silu_table.h")
DECODE_EXTENSION_NAME = "streamkv_decode_ops"
DECODE_SOURCES = (_CSRC / "decode_layer.cpp", *SOURCES, *FUSED_SOURCES, *LINEAR_SOURCES)
DECODE_HEADERS = tuple(dict.fromkeys(HEADERS + FUSED_HEADERS + LINEAR_HEADERS))
CFLAGS = ("-O3", "-march=native", "-fopenmp")


def build_directory() -> Path:
    """Where the compiled extension lives: one folder per torch version (the ABI it links against)."""
    return cache_root() / "torch_extensions" / torch.__version__.replace("+", "_")


@functools.cache
def load_cpu_ops() -> ModuleType | None:
    """The paged-attention extension, building it on first use; ``None`` when it cannot be built.

    The result is cached for the process, so a failed build is tried (and
    logged) once.
    """
    folder = build_directory() / _source_digest(SOURCES + HEADERS)
    return _with_amx_setting(_build(EXTENSION_NAME, SOURCES, folder, "the torch attention path"))


@functools.cache
def load_fused_ops() -> ModuleType | None:
    """The fused layer ops (``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rope``); ``None`` when unbuildable.

    Cached for the process like :func:`load_cpu_ops`.
    """
    # Its own folder (cpp_extension keeps one build.ninja per folder), keyed by its sources like the others.
    folder = build_directory() / f"fused-{_source_digest(FUSED_SOURCES + FUSED_HEADERS)}"
    return _build(FUSED_EXTENSION_NAME, FUSED_SOURCES, folder, "the torch layer ops")


@functools.cache
def load_linear_ops() -> ModuleType | None:
    """The small-batch linear op (``pack_small_linear``, ``small_linear``); ``None`` when unbuildable or unsupported.

    fp32 weights need AVX-512, or AVX2 with FMA (``small_linear_isa()`` of the
    build says which kernel); bf16 weights need AVX512-BF16
    (``small_linear_bf16_supported()``) and int8 weights AVX-512 VNNI
    (``small_linear_int8_supported()``). On other CPUs the oneDNN matmul runs
    every batch. Cached for the process like :func:`load_cpu_ops`.
    """
    folder = build_directory() / f"linear-{_source_digest(LINEAR_SOURCES + LINEAR_HEADERS)}"
    module = _build(LINEAR_EXTENSION_NAME, LINEAR_SOURCES, folder, "oneDNN for every matmul")
    if module is not None and not module.small_linear_supported():
        logger.info("streamkv small-batch linear needs AVX-512, or AVX2 with FMA; oneDNN runs every matmul")
        return None
    return _with_amx_setting(module)


@functools.cache
def load_decode_ops() -> ModuleType | None:
    """``decode_layer``: a pure-decode step's decoder layer in one call; ``None`` when unbuildable or unsupported.

    Built from ``decode_layer.cpp`` and the sources of the three op sets
    (their Python modules left out), so it needs what the small-batch
    linear needs (AVX-512 or AVX2 for fp32 models, AVX512-BF16 for bf16 ones). Cached for the process like
    :func:`load_cpu_ops`.
    """
    if load_linear_ops() is None:
        return None
    folder = build_directory() / f"decode-{_source_digest(DECODE_SOURCES + DECODE_HEADERS)}"
    module = _build(
        DECODE_EXTENSION_NAME, DECODE_SOURCES, folder, "one call per op in each layer", ("-DSTREAMKV_NO_PYBIND",)
    )
    return _with_amx_setting(module)


# The last set_amx(on), applied to an extension loaded after it (None: the default stands).
_amx_setting: bool | None = None


def _with_amx_setting(module: ModuleType | None) -> ModuleType | None:
    if module is not None and _amx_setting is not None:
        module.set_amx(_amx_setting)
    return module


def set_amx(on: bool) -> bool:
    """Switch the AMX kernels (``small_linear``'s bf16 and int8 matmuls and fp32 prefill matmuls on GGUF codes,
    ``paged_prefill``'s bf16 attention) on or off.

    Each extension holds its own copy of the switch (``amx.h``): the attention ops, the linear ops and
    the decode-layer op. Setting one alone would run a decode row's matmuls on one kernel in pure-decode
    steps and on the other in mixed steps, so this sets every loaded one, and an extension loaded later
    takes the last setting. On only where the CPU and the OS allow it; for A/B runs and tests
    (``STREAMKV_AMX=0`` in the environment turns it off for the whole process). Returns the state
    before: True when any loaded extension had it on.
    """
    global _amx_setting
    _amx_setting = on
    before = False
    for loader in (load_cpu_ops, load_linear_ops, load_decode_ops):
        if loader.cache_info().currsize == 0:
            continue  # not loaded yet: it takes the setting when it is
        module = loader()
        if module is not None:
            before = bool(module.set_amx(on)) or before
    return before


def _source_digest(paths: tuple[Path, ...]) -> str:
    """12 hex digits of the sources' contents: checkouts with different sources build side by side.

    (One shared folder would make two worktrees rebuild over each other's build on every load.)
    """
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder/.streamkv-build`` around cpp_extension's load of ``folder``.

    cpp_extension guards a build folder with a ``lock`` file that it creates and removes itself. A process
    killed mid-build (Ctrl-C during the first ``make serve``) leaves that file behind, and every later load
    then waits on it forever without a word. Every streamkv load of a folder holds this flock, which the OS
    drops when its holder dies, for as long as the ``lock`` file can exist. So a ``lock`` file found with
    the flock in hand was left by a dead process: it is removed (logged), and the build runs again.
    """
    with open(folder / ".streamkv-build", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a live build of this folder in another process: wait for it
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that was killed; building again", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(
    name: str, sources: tuple[Path, ...], folder: Path, fallback: str, defines: tuple[str, ...] = ()
) -> ModuleType | None:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    cached = (folder / f"{name}.so").exists()  # else this call compiles it (minutes on 2 cores)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _build_lock(folder):
            module = cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                extra_cflags=[*CFLAGS, *defines],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a compile error: all mean "use torch ops"
        logger.warning("streamkv CPU ops %s unavailable (%s: %s); using %s", name, type(exc).__name__, exc, fallback)
        return None
    how = "loaded" if cached else "compiled and loaded"
    logger.info("streamkv CPU ops %s %s from %s in %.1f s", name, how, folder, time.perf_counter() - start)
    return module


def main() -> int:
    """``python -m streamkv.ops.cpu_ops``: build now (``make install``); exit 0 either way, say which."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("streamkv: building the four C++ CPU ops unless cached (the first time takes 5-10 minutes on 2 cores;"
          " each prints a line when it is done)", file=sys.stderr)  # fmt: skip
    ok = load_cpu_ops() is not None
    print(f"streamkv CPU ops: {'built' if ok else 'NOT built (the torch attention path will run)'}", file=sys.stderr)
    fused = load_fused_ops() is not None
    print(f"streamkv fused ops: {'built' if fused else 'NOT built (the torch layer ops will run)'}", file=sys.stderr)
    linear = load_linear_ops() is not None
    state = "built" if linear else "NOT used (oneDNN runs every matmul)"
    print(f"streamkv small-batch linear: {state}", file=sys.stderr)
    decode = load_decode_ops() is not None
    state = "built" if decode else "NOT used (each layer's ops are called one by one)"
    print(f"streamkv decode layer op: {state}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
