"""Microbenchmarks of the Triton paged-attention kernels against torch, on one GPU.

Each kernel runs on a paged KV cache whose blocks are a random permutation of
the pool; the torch baseline runs on the same values laid out contiguously:

- ``store_kv`` vs ``index_copy_`` into the flat slot view;
- ``paged_decode`` (split-K) vs SDPA over ``[B, Hkv, S, D]`` with ``enable_gqa``;
- ``paged_prefill`` (a 512-token chunk over a cached context) vs SDPA with a
  bottom-right causal mask over K/V repeated to the query heads.

Writes ``gpu_check.json`` (every figure) and ``gpu_check.md`` (a table) under
``--out``. ``--e2e`` adds end-to-end decode throughput through
``streamkv.llm.LLM``; a failure there is recorded, never fatal. ``--smoke``
runs the same code at tiny sizes on the CPU under ``TRITON_INTERPRET=1``.

Sized for ~5 minutes on one H200 with ``gpu_check.sh``'s compiled tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Shapes of one benchmark run (bf16 Llama-3-8B-like attention by default)."""

    device: str
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    extend_batch: int
    extend_chunk: int
    extend_contexts: tuple[int, ...]
    store_tokens: tuple[int, ...]
    cpu_reps: int = 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


FULL = BenchConfig(
    device="cuda", dtype="bfloat16", num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
    decode_batches=(1, 32, 128), decode_contexts=(1024, 8192, 32768),
    extend_batch=4, extend_chunk=512, extend_contexts=(0, 8192), store_tokens=(128, 4096),
)
SMOKE = BenchConfig(
    device="cpu", dtype="bfloat16", num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
    decode_batches=(1, 2), decode_contexts=(16, 300),
    extend_batch=2, extend_chunk=16, extend_contexts=(0, 40), store_tokens=(8,),
)


def time_ms(fn: Callable[[], Any], device: str, cpu_reps: int) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` on CUDA, wall clock on the CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # trace once so the timing below is steady-state
    samples = []
    for _ in range(cpu_reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def make_paged(cfg: BenchConfig, batch: int, seq_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random paged cache plus the same K/V contiguous.

    Returns:
        kv_cache ``[2, num_blocks, block_size, Hkv, D]``, block_tables int32
        ``[batch, blocks_per_seq]`` (a random permutation of the pool),
        k and v ``[batch, Hkv, seq_len, D]`` contiguous.
    """
    gen = torch.Generator(device=cfg.device).manual_seed(seed)
    blocks_per_seq = math.ceil(seq_len / cfg.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (2, num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    kv_cache = torch.randn(shape, generator=gen, device=cfg.device, dtype=cfg.torch_dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=cfg.device)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    dense = []
    for i in range(2):  # one at a time keeps the peak at ~2x the cache
        gathered = kv_cache[i][block_tables.long()].flatten(1, 2)[:, :seq_len]  # [B, S, Hkv, D]
        dense.append(gathered.transpose(1, 2).contiguous())
        del gathered
    return kv_cache, block_tables, dense[0], dense[1]


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def bench_store(cfg: BenchConfig, num_tokens: int) -> dict[str, Any]:
    from streamkv.kernels import store_kv

    num_blocks = math.ceil(2 * num_tokens / cfg.block_size)
    kv_cache = torch.zeros((2, num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim),
                           dtype=cfg.torch_dtype, device=cfg.device)
    slots = torch.randperm(num_blocks * cfg.block_size, device=cfg.device)[:num_tokens]
    key = torch.randn((num_tokens, cfg.num_kv_heads, cfg.head_dim), dtype=cfg.torch_dtype, device=cfg.device)
    value = torch.randn_like(key)
    flat = kv_cache.view(2, -1, cfg.num_kv_heads, cfg.head_dim)

    def torch_fn() -> None:
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)

    triton_ms = time_ms(lambda: store_kv(key, value, kv_cache, slots), cfg.device, cfg.cpu_reps)
    torch_ms = time_ms(torch_fn, cfg.device, cfg.cpu_reps)
    moved = 4 * key.numel() * key.element_size()  # read + write, keys and values
    return {"tokens": num_tokens, "triton_ms": triton_ms, "torch_ms": torch_ms,
            "triton_gbps": moved / triton_ms / 1e6, "torch_gbps": moved / torch_ms / 1e6, "baseline": "index_copy_"}


def bench_decode(cfg: BenchConfig, batch: int, context: int) -> dict[str, Any]:
    from streamkv.kernels import paged_decode
    from streamkv.kernels.paged_decode import default_num_splits

    kv_cache, block_tables, k, v = make_paged(cfg, batch, context, seed=batch * 7 + context)
    query = torch.randn((batch, cfg.num_heads, cfg.head_dim), dtype=cfg.torch_dtype, device=cfg.device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=cfg.device)
    scale = cfg.head_dim**-0.5
    q4 = query[:, :, None]  # [B, Hq, 1, D]

    # F821 below is a false positive: the closures run before the `del` at the end frees these names
    def triton_fn() -> torch.Tensor:
        return paged_decode(query, kv_cache, block_tables, seq_lens, scale, max_seq_len=context)  # noqa: F821

    def sdpa_fn() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)[:, :, 0]  # noqa: F821

    row: dict[str, Any] = {"batch": batch, "context": context,
                           "num_splits": default_num_splits(batch, cfg.num_kv_heads, context),
                           "baseline": "sdpa(enable_gqa)"}
    err = (triton_fn().float() - sdpa_fn().float()).abs().max().item()
    row["triton_ms"] = time_ms(triton_fn, cfg.device, cfg.cpu_reps)
    row["torch_ms"] = time_ms(sdpa_fn, cfg.device, cfg.cpu_reps)
    moved = 2 * k.numel() * k.element_size()  # every cached K and V read once
    row.update(max_abs_err=err, triton_gbps=moved / row["triton_ms"] / 1e6, torch_gbps=moved / row["torch_ms"] / 1e6)
    del kv_cache, k, v
    _free(cfg.device)
    return row


def bench_extend(cfg: BenchConfig, context: int) -> dict[str, Any]:
    from streamkv.kernels import paged_prefill

    batch, chunk = cfg.extend_batch, cfg.extend_chunk
    seq_len = context + chunk
    kv_cache, block_tables, k, v = make_paged(cfg, batch, seq_len, seed=context + 1)
    query = torch.randn((batch * chunk, cfg.num_heads, cfg.head_dim), dtype=cfg.torch_dtype, device=cfg.device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=cfg.device) * chunk
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=cfg.device)
    scale = cfg.head_dim**-0.5
    group = cfg.num_heads // cfg.num_kv_heads
    q_dense = query.view(batch, chunk, cfg.num_heads, cfg.head_dim).transpose(1, 2).contiguous()
    k_rep = k.repeat_interleave(group, dim=1)
    v_rep = v.repeat_interleave(group, dim=1)

    # F821 below is a false positive: the closures run before the `del` at the end frees these names
    def triton_fn() -> torch.Tensor:
        return paged_prefill(
            query, kv_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len=chunk  # noqa: F821
        )

    baseline = "sdpa(repeat_kv, causal_lower_right)"
    try:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(chunk, seq_len)
        F.scaled_dot_product_attention(q_dense[:1], k_rep[:1], v_rep[:1], attn_mask=bias, scale=scale)
        mask: Any = bias
    except (ImportError, RuntimeError, NotImplementedError):
        baseline = "sdpa(repeat_kv, bool mask)"
        mask = torch.ones(chunk, seq_len, dtype=torch.bool, device=cfg.device).tril_(context)

    def sdpa_fn() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_dense, k_rep, v_rep, attn_mask=mask, scale=scale)  # noqa: F821
        return out.transpose(1, 2).reshape(batch * chunk, cfg.num_heads, cfg.head_dim)

    row: dict[str, Any] = {"batch": batch, "chunk": chunk, "context": context, "baseline": baseline}
    err = (triton_fn().float() - sdpa_fn().float()).abs().max().item()
    row["triton_ms"] = time_ms(triton_fn, cfg.device, cfg.cpu_reps)
    row["torch_ms"] = time_ms(sdpa_fn, cfg.device, cfg.cpu_reps)
    # Useful FLOPs only: QK^T and PV over the causal (bottom-right) region.
    pairs = chunk * context + chunk * (chunk + 1) // 2
    flops = 4 * batch * cfg.num_heads * cfg.head_dim * pairs
    row.update(max_abs_err=err, triton_tflops=flops / row["triton_ms"] / 1e9,
               torch_tflops=flops / row["torch_ms"] / 1e9)
    del kv_cache, k, v, k_rep, v_rep
    _free(cfg.device)
    return row


def bench_e2e(device: str, num_prompts: int, max_tokens: int, backend: str, dtype: str = "auto") -> dict[str, Any]:
    """Greedy generation through ``LLM``; decode tokens/s excludes a prefill-only run's time.

    ``dtype`` ``auto`` is the server default (bf16 on GPUs with bf16). The same
    weights then also run on the torch reference backend for a few prompts, and
    the share of identical greedy outputs is recorded (``greedy_vs_torch``).
    """
    from streamkv.llm import LLM
    from streamkv.sampling_params import SamplingParams

    llm = LLM(device=device, dtype=dtype, attention_backend=backend)
    prompts = [f"Request {i}: explain, step by step, how a paged KV cache works." for i in range(num_prompts)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # compile / warm up

    def timed(tokens: int) -> tuple[float, int]:
        _sync(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
        _sync(device)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)

    prefill_s, prefill_tokens = timed(1)
    total_s, total_tokens = timed(max_tokens)
    decode_tokens = total_tokens - prefill_tokens
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    reference = LLM(loaded=llm.core.loaded, device=device, attention_backend="torch")
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], greedy)]
    theirs = [o.outputs[0].token_ids for o in reference.generate(prompts[:4], greedy)]
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)
    return {"backend": llm.core.backend.name, "dtype": str(llm.core.loaded.dtype).removeprefix("torch."),
            "greedy_vs_torch": agree, "num_prompts": num_prompts, "max_tokens": max_tokens,
            "generated_tokens": total_tokens,
            "total_s": total_s, "prefill_only_s": prefill_s, "output_tokens_per_s": total_tokens / total_s,
            "decode_tokens_per_s": decode_tokens / max(total_s - prefill_s, 1e-9)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _guarded(results: list[dict[str, Any]], label: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> None:
    """Run one benchmark; on failure record the error instead of aborting the run."""
    started = time.perf_counter()
    try:
        row = fn()
    except Exception as exc:  # noqa: BLE001 - every figure that can be produced should be
        row = {**label, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)}
    row["wall_s"] = round(time.perf_counter() - started, 2)
    results.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)


def run(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    import triton

    report: dict[str, Any] = {
        "config": asdict(cfg),
        "env": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                "gpu": torch.cuda.get_device_name() if cfg.device == "cuda" else None,
                "interpreter": os.environ.get("TRITON_INTERPRET", "0")},
        "store_kv": [], "decode": [], "extend": [],
    }
    for tokens in cfg.store_tokens:
        _guarded(report["store_kv"], {"tokens": tokens}, lambda t=tokens: bench_store(cfg, t))
    for batch in cfg.decode_batches:
        for context in cfg.decode_contexts:
            _guarded(report["decode"], {"batch": batch, "context": context},
                     lambda b=batch, c=context: bench_decode(cfg, b, c))
    for context in cfg.extend_contexts:
        _guarded(report["extend"], {"context": context}, lambda c=context: bench_extend(cfg, c))
    if args.e2e:
        # The smoke run only proves the plumbing: two short greedy requests.
        prompts, tokens = (2, 8) if args.smoke else (args.e2e_prompts, args.e2e_max_tokens)
        try:
            report["e2e"] = bench_e2e(cfg.device, prompts, tokens, args.e2e_backend, args.e2e_dtype)
        except Exception as exc:  # noqa: BLE001 - kernel figures still get written
            report["e2e"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    return report


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else ("" if value is None else str(value))


def to_markdown(report: dict[str, Any]) -> str:
    cfg, env = report["config"], report["env"]
    lines = [
        "# Triton paged attention vs torch",
        "",
        f"{env['gpu'] or 'CPU (TRITON_INTERPRET smoke run)'}, torch {env['torch']}, triton {env['triton']}; "
        f"{cfg['dtype']}, Hq={cfg['num_heads']} Hkv={cfg['num_kv_heads']} D={cfg['head_dim']} "
        f"block={cfg['block_size']}. Times are medians in ms; speedup = torch / triton.",
        "",
        "| kernel | batch | context | chunk/tokens | triton ms | torch ms | speedup | triton | torch "
        "| max abs err | baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    units = (("store_kv", "gbps", "GB/s"), ("decode", "gbps", "GB/s"), ("extend", "tflops", "TFLOP/s"))
    for kind, unit, label in units:
        for row in report[kind]:
            if "error" in row:
                lines.append(f"| {kind} | {_fmt(row.get('batch'))} | {_fmt(row.get('context'))} | "
                             f"{_fmt(row.get('tokens'))} | error: {row['error'][:80]} |  |  |  |  |  |  |")
                continue
            speedup = row["torch_ms"] / row["triton_ms"]
            lines.append(
                f"| {kind} | {_fmt(row.get('batch'))} | {_fmt(row.get('context'))} | "
                f"{_fmt(row.get('chunk', row.get('tokens')))} | {row['triton_ms']:.4f} | {row['torch_ms']:.4f} | "
                f"{speedup:.2f}x | {row[f'triton_{unit}']:.1f} {label} | "
                f"{row[f'torch_{unit}']:.1f} {label} | {_fmt(row.get('max_abs_err'), 4)} | "
                f"{row['baseline']} |"
            )
    if "e2e" in report:
        e2e = report["e2e"]
        lines += ["", "## End to end", ""]
        if "error" in e2e:
            lines.append(f"failed: `{e2e['error']}`")
        else:
            lines.append(f"{e2e['backend']} backend, {e2e.get('dtype', '?')}, {e2e['num_prompts']} prompts x "
                         f"{e2e['max_tokens']} tokens (greedy; identical to the torch backend on "
                         f"{e2e.get('greedy_vs_torch', float('nan')):.0%} of 4 prompts x 32 tokens): "
                         f"{e2e['decode_tokens_per_s']:.1f} decode tokens/s, "
                         f"{e2e['output_tokens_per_s']:.1f} output tokens/s including prefill.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "load_tests" / "out",
                        help="folder for gpu_check.json and gpu_check.md (default: load_tests/out/)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU under TRITON_INTERPRET=1 (checks the script, not the GPU)")
    parser.add_argument("--e2e", action="store_true", help="also measure decode tokens/s through streamkv.llm.LLM")
    parser.add_argument("--e2e-prompts", type=int, default=32, help="prompts in the end-to-end batch")
    parser.add_argument("--e2e-max-tokens", type=int, default=128, help="tokens generated per prompt end to end")
    parser.add_argument("--e2e-backend", choices=("auto", "triton", "torch"), default="auto",
                        help="attention backend for the end-to-end run (auto: triton on CUDA)")
    parser.add_argument("--e2e-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="model and KV dtype end to end (auto: bf16 on GPUs with bf16, the server default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # Must precede the first triton import: @triton.jit reads it at decoration.
        os.environ["TRITON_INTERPRET"] = "1"
        cfg = SMOKE
    elif not torch.cuda.is_available():
        print("gpu_check needs CUDA; use --smoke to exercise it on the CPU", file=sys.stderr)
        return 2
    else:
        cfg = FULL
    report = run(cfg, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (args.out / "gpu_check.md").write_text(to_markdown(report))
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    failed = [row for kind in ("store_kv", "decode", "extend") for row in report[kind] if "error" in row]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
