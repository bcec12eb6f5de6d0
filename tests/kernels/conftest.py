"""Kernel tests run the Triton interpreter on CPU tensors unless told otherwise.

``TRITON_INTERPRET`` must be set before anything imports triton (the ``@jit``
decorator reads it), hence the first statement below. ``gpu``-marked tests
compile for CUDA: run them with ``TRITON_INTERPRET=0 pytest -m gpu tests/kernels``
(``load_tests/gpu_check.sh`` does); the CPU tests need the interpreter and skip
without it.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"].strip().lower() in ("1", "true", "on")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA")


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """Readable ids for dtypes (``bfloat16`` rather than ``dtype3``)."""
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    no_cuda = pytest.mark.skip(reason="needs CUDA")
    interpreted = pytest.mark.skip(reason="compiled kernels: run with TRITON_INTERPRET=0")
    no_interpreter = pytest.mark.skip(reason="CPU kernel tests need TRITON_INTERPRET=1")
    for item in items:
        if not item.path.resolve().is_relative_to(here):
            continue
        if item.get_closest_marker("gpu") is not None:
            if not torch.cuda.is_available():
                item.add_marker(no_cuda)
            elif INTERPRET:
                item.add_marker(interpreted)
        elif not INTERPRET:
            item.add_marker(no_interpreter)
