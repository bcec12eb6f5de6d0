"""oneMKL VML's kernel dispatch, resolved before any concurrent first call.

torch's CPU wheels route float32 and float64 ``cos``, ``sin``,
``exp``, ``log``, ``sqrt``, ``tanh`` (and the rest of :data:`VML_OPS`) to
oneMKL's VML (``aten/src/ATen/cpu/vml.h``), asking each call for its
high-accuracy kernel (``VML_HA``, under 1 ulp). oneMKL picks a function's
kernel lazily, on that function's first call. When that first call runs
on several intra-op threads at once (a large tensor's first op in a fresh
process), one thread can run the low-accuracy ``VML_EP`` kernel for its
whole chunk (errors of thousands of ulp); the next call is right again.
oneMKL 2024.2, the build torch 2.13's wheels carry, has it; oneMKL 2025.0
does not (pytorch/pytorch#188792, and the same 1-element warm-up in
pytorch/pytorch#188791).

Here it was round 23's flake (docs/benchmarks.md, rounds 24, 25 and 29): the RoPE
cos table is a process's first sizable VML call, and about one test
process in 25 built a SmolLM2 whose cos table differed from a fresh
load's, its logits 0.0084 off transformers'. Swapping in the table that
``vmsCos`` gives in ``VML_EP`` mode reproduces that failure bit for bit
(the same largest difference, at the same logit, in as many logits).
"""

from __future__ import annotations

import functools

import torch

# The ops aten/src/ATen/native/cpu/UnaryOpsKernel.cpp sends to at::vml, which vml.h sends to oneMKL.
VML_OPS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)


@functools.cache
def resolve_vml_dispatch() -> None:
    """Call each op of :data:`VML_OPS` once on one float32 and one float64 element, on this thread alone.

    One element never splits between threads, so each function's kernel is
    picked by one caller; every later call, on any thread, finds it picked
    (pytorch/pytorch#188791's remedy, which its author's A/B found to remove
    the race). Runs once per process: ~2 ms, most of it oneMKL's set-up.
    """
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype, device="cpu")
        for op in VML_OPS:
            getattr(torch, op)(x)
