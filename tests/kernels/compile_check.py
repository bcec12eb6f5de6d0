"""Compile every kernel variant ahead of time for Hopper (sm_90), no GPU needed.

The interpreter runs the kernels' maths on the CPU but never lowers them, so
a shape ``tl.dot`` rejects or a tile that overflows shared memory would only
show on a GPU. Triton compiles to a cubin offline (LLVM + the bundled
ptxas); this script does that for the variants the wrappers launch and fails
on an error or on shared memory beyond an H100/H200 block's 227 KiB.

Run as a script with ``TRITON_INTERPRET=0`` (``test_compile.py`` does).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from streamkv.kernels.paged_decode import _decode_merge_kernel, _decode_split_kernel  # noqa: E402
from streamkv.kernels.paged_prefill import _prefill_kernel, _tile_sizes  # noqa: E402
from streamkv.kernels.store_kv import _store_kv_kernel  # noqa: E402

MAX_SHARED_BYTES = 227 * 1024
TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def compile_one(fn: triton.JITFunction, pointers: dict[str, str], constexprs: dict[str, object]) -> int:
    """Compile ``fn`` for sm_90; other runtime arguments are i32 (strides, counts) or fp32 scales.

    Returns:
        shared memory bytes the kernel needs.
    """
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = pointers.get(name, "i32")
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return int(compiled.metadata.shared)


def variants() -> list[tuple[str, triton.JITFunction, dict[str, str], dict[str, object]]]:
    import torch

    out = [("store_kv bf16", _store_kv_kernel,
            {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
            {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128, "QUANT": 0,
             "QMAX": 1.0}),
           ("decode merge bf16", _decode_merge_kernel,
            {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16"},
            {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64, "BLOCK_S": 64})]
    # 16-bit tiles at both head dims; fp32 (ieee dots, the most shared memory) at the wider one.
    for dt, head_dim, group in (("bf16", 128, 4), ("bf16", 64, 8), ("fp32", 128, 3)):
        flags = {"PRECISION": "ieee" if dt == "fp32" else "tf32", "UPCAST": False}
        out.append((f"decode split {dt} D={head_dim}", _decode_split_kernel,
                    {"q_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "block_tables_ptr": "*i32",
                     "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"},
                    {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "BLOCK_H": 16, "BLOCK_D": head_dim,
                     "BLOCK_N": 64, "QUANT": 0, **flags}))
        block_m, block_n = _tile_sizes(getattr(torch, TORCH_NAMES[dt]), head_dim)
        out.append((f"prefill {dt} D={head_dim}", _prefill_kernel,
                    {"q_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "block_tables_ptr": "*i32",
                     "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": f"*{dt}"},
                    {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "BLOCK_M": block_m,
                     "BLOCK_N": block_n, "BLOCK_D": head_dim, "QUANT": 0, **flags}))
    # Quantized caches (QUANT 1 int8, 2 fp8 as uint8): bf16 queries over 8-bit rows of head_dim + 4.
    for quant, cache in ((1, "*i8"), (2, "*u8")):
        flags = {"PRECISION": "tf32", "UPCAST": False}
        out.append((f"store_kv bf16 -> quant {quant}", _store_kv_kernel,
                    {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": cache, "slot_mapping_ptr": "*i64"},
                    {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128,
                     "QUANT": quant, "QMAX": 127.0 if quant == 1 else 448.0}))
        out.append((f"decode split bf16 quant {quant}", _decode_split_kernel,
                    {"q_ptr": "*bf16", "cache_ptr": cache, "block_tables_ptr": "*i32",
                     "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"},
                    {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_H": 16, "BLOCK_D": 128,
                     "BLOCK_N": 64, "QUANT": quant, **flags}))
        block_m, block_n = _tile_sizes(torch.bfloat16, 128)
        out.append((f"prefill bf16 quant {quant}", _prefill_kernel,
                    {"q_ptr": "*bf16", "cache_ptr": cache, "block_tables_ptr": "*i32",
                     "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16"},
                    {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_M": block_m,
                     "BLOCK_N": block_n, "BLOCK_D": 128, "QUANT": quant, **flags}))
    return out


def main() -> int:
    failed = 0
    for label, fn, pointers, constexprs in variants():
        try:
            shared = compile_one(fn, pointers, constexprs)
        except Exception as exc:  # noqa: BLE001 - report every variant, then fail
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        ok = shared <= MAX_SHARED_BYTES
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: {shared} bytes shared")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
