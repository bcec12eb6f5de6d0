"""The bound on oneDNN's and ideep's shape caches: ``serve --onednn-cache-capacity``, and its gauge.

On the CPU every linear runs a oneDNN primitive built for its input shape
(rows = tokens in the step, times the weight's ``(in, out)``). Each built
shape is kept twice: in oneDNN's primitive cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and in ideep's, torch's oneDNN wrapper
(``LRU_CACHE_CAPACITY``), both least-recently-used with 1024 entries by
default, about 0.28 MB per entry each at SmolLM2-135M's and the tiny test
model's shapes (docs/benchmarks.md, "Soak"). A server meets a long tail of
step sizes, so at the defaults its RSS grows by ~0.56 MB per new shape up to
~0.56 GB. Both must be capped for the memory to come back: an entry evicted
from one is still held by the other.

Both libraries read their variable once, when the first primitive is built,
so setting them after ``import torch`` but before the first matmul works
(measured: ``python -m load_tests.bench_onednn_cache``). This module imports
no torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

ENV_VARS: tuple[str, ...] = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's
CACHE_NAMES: dict[str, str] = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "onednn", "LRU_CACHE_CAPACITY": "ideep"}
# Entries per cache. 256 shapes at ~0.56 MB is ~145 MB at most; a miss rebuilds one primitive, about
# 1 ms a step against 150+ ms of linears (docs/benchmarks.md, "Soak", "The server's bound").
DEFAULT_CAPACITY = 256
LIBRARY_DEFAULT_CAPACITY = 1024  # what either library uses when its variable is unset


def add_onednn_cache_args(parser: argparse.ArgumentParser) -> None:
    """``--onednn-cache-capacity`` on ``serve``."""
    parser.add_argument(
        "--onednn-cache-capacity",
        type=_capacity,
        default=DEFAULT_CAPACITY,
        help="CPU: entries in oneDNN's primitive cache and in ideep's LRU cache, one per matmul input shape "
        f"(~0.28 MB each); bounds their memory. A value already in ${ENV_VARS[0]} or ${ENV_VARS[1]} wins "
        f"for that cache (default: {DEFAULT_CAPACITY}; unbounded by streamkv, the libraries keep 1024)",
    )


def _capacity(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def apply_capacity(capacity: int, environ: MutableMapping[str, str] | None = None) -> dict[str, int]:
    """Set both caches' variables to ``capacity`` unless already set; call before the first matmul.

    Returns:
        The capacity each cache will use, by cache name (``onednn``, ``ideep``).

    Raises:
        ValueError: a variable the user set is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    effective = {}
    for name in ENV_VARS:
        value = env.setdefault(name, str(capacity))
        try:
            effective[CACHE_NAMES[name]] = int(value)
        except ValueError:
            raise ValueError(f"${name}={value!r} is not an integer (it overrides --onednn-cache-capacity)") from None
        if effective[CACHE_NAMES[name]] < 0:
            raise ValueError(f"${name}={value!r} is negative (it overrides --onednn-cache-capacity)")
    return effective


def register_capacity_gauge(registry: CollectorRegistry, environ: MutableMapping[str, str] | None = None) -> None:
    """``streamkv_onednn_cache_capacity{cache}``: the entries each cache was configured with (from the env).

    How many entries are filled is not readable without private torch APIs; this is the bound.
    """
    from prometheus_client import Gauge

    env = os.environ if environ is None else environ
    gauge = Gauge(
        "streamkv_onednn_cache_capacity",
        "Entries (matmul input shapes) oneDNN's primitive cache and ideep's LRU cache may hold.",
        ["cache"],
        registry=registry,
    )
    for name in ENV_VARS:
        value = env.get(name, "")
        gauge.labels(cache=CACHE_NAMES[name]).set(int(value) if value.isdigit() else LIBRARY_DEFAULT_CAPACITY)
