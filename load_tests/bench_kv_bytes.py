"""Bytes and capacity by KV cache dtype: tokens per GiB, 1,000-token conversations in a pool, perplexity.

Three figures for ``--kv-cache-dtype`` float32 (the reference), bfloat16,
float16, int8 and fp8_e4m3, on the model's own shape (SmolLM2-135M by
default: 30 layers, 3 KV heads of 64):

* bytes per token (scales counted) and tokens per GiB;
* the most concurrent conversations of ``--conversation-tokens`` tokens
  that fit a ``--pool-mib`` pool (each needs ``ceil(tokens / 16)`` whole
  blocks);
* perplexity with fp32 weights, KV stored in each dtype, over a fixed text
  of ``--num-tokens`` tokens cut into windows of ``--context`` tokens (each
  window a fresh sequence, scored on its tokens 2..n, one paged prefill with
  the torch reference attention; a prefill attends to its K/V as the cache
  stores it, so this is what decoding the same tokens would see). Goals:
  bfloat16 within 0.5% of fp32, 8-bit within 2%.

The text ships with Python: the ``pydoc_data.topics`` help texts (the
language reference prose ``help()`` shows), entries in sorted key order,
joined by blank lines; its exact content follows the Python version (printed).

    python -m load_tests.bench_kv_bytes
    python -m load_tests.bench_kv_bytes --num-tokens 1024   # quicker
"""

from __future__ import annotations

import math
import platform
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import add_model_args, ensure_tiny_model, goal, make_parser, print_header, table, write_json

KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")
GOALS = {"bfloat16": 0.005, "float16": 0.005, "int8": 0.02, "fp8_e4m3": 0.02}


def fixed_text() -> str:
    """Python's own help texts (``pydoc_data.topics``), sorted by topic: English prose with some code."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def perplexity(loaded, ids: list[int], kv_cache_dtype: str, context: int, block_size: int = 16) -> float:  # type: ignore[no-untyped-def]
    """exp(mean next-token cross-entropy) over windows of ``context`` tokens, KV stored as ``kv_cache_dtype``."""
    import torch

    from streamkv.attention.kv_layout import allocate_kv_cache, resolve_kv_format
    from streamkv.attention.metadata import AttentionMetadata
    from streamkv.attention.torch_paged import TorchPagedAttention

    model = loaded.model
    fmt = resolve_kv_format(kv_cache_dtype, loaded.dtype)
    total_loss, total_count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context]
        if len(window) < 2:
            break
        num_blocks = -(-len(window) // block_size)
        caches = [allocate_kv_cache(fmt, num_blocks, block_size, model.num_kv_heads, model.head_dim)
                  for _ in range(model.num_layers)]  # fmt: skip
        meta = AttentionMetadata.build([len(window)], [len(window)], [list(range(num_blocks))], block_size)
        with torch.inference_mode():
            hidden = model(torch.tensor(window), torch.arange(len(window)), caches, meta, TorchPagedAttention())
            logits = model.compute_logits(hidden[:-1])
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum")
        total_loss += float(loss)
        total_count += len(window) - 1
    return math.exp(total_loss / total_count)


def main() -> int:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--num-tokens", type=int, default=4096, help="tokens of the fixed text to score")
    p.add_argument("--context", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--pool-mib", type=int, default=512, help="pool size for the conversation count")
    p.add_argument("--conversation-tokens", type=int, default=1000, help="tokens of KV one conversation holds")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-perplexity", action="store_true", help="bytes and capacity only (no forward passes)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args()

    import torch

    from streamkv.attention.kv_layout import resolve_kv_format
    from streamkv.config import ModelConfig
    from streamkv.model.loader import load_model

    torch.set_num_threads(a.threads)
    header = print_header("KV bytes, capacity and perplexity by KV cache dtype", "load_tests.bench_kv_bytes",
                          python=platform.python_version())  # fmt: skip
    model_path = ensure_tiny_model() if a.model == "tiny" else a.model
    t0 = time.perf_counter()
    loaded = load_model(ModelConfig(model=model_path, dtype="float32", device="cpu"), torch.device("cpu"))
    m = loaded.model
    print(f"model: {loaded.name} in float32 ({time.perf_counter() - t0:.1f} s to load); "
          f"{m.num_layers} layers, {m.num_kv_heads} KV heads of {m.head_dim}")  # fmt: skip

    pool = a.pool_mib << 20
    blocks_per_conv = -(-a.conversation_tokens // a.block_size)
    rows, results = [], {}
    fp32_bytes = resolve_kv_format("float32", loaded.dtype).bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim)
    for name in KV_DTYPES:
        per_token = resolve_kv_format(name, loaded.dtype).bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim)
        num_blocks = pool // (per_token * a.block_size)
        results[name] = {
            "bytes_per_token": per_token,
            "tokens_per_gib": (1 << 30) // per_token,
            "x_fp32": fp32_bytes / per_token,
            "pool_blocks": num_blocks,
            "conversations": num_blocks // blocks_per_conv,
        }
    if not a.no_perplexity:
        ids = loaded.tokenizer.encode(fixed_text())[: a.num_tokens]
        print(f"text: pydoc_data.topics of Python {platform.python_version()}, first {len(ids)} tokens, "
              f"windows of {a.context}", flush=True)  # fmt: skip
        for name in KV_DTYPES:
            t0 = time.perf_counter()
            results[name]["perplexity"] = perplexity(loaded, ids, name, a.context, a.block_size)
            results[name]["ppl_seconds"] = time.perf_counter() - t0
            print(f"  {name}: perplexity {results[name]['perplexity']:.4f} "
                  f"({results[name]['ppl_seconds']:.0f} s)", flush=True)  # fmt: skip
    ref = results["float32"].get("perplexity")
    for name in KV_DTYPES:
        r = results[name]
        ppl = r.get("perplexity")
        delta = None if ppl is None or ref is None else 100 * (ppl / ref - 1)
        r["ppl_vs_fp32_pct"] = delta
        rows.append([name, r["bytes_per_token"], r["tokens_per_gib"], f"{r['x_fp32']:.2f}x", r["pool_blocks"],
                     r["conversations"], "-" if ppl is None else f"{ppl:.4f}",
                     "-" if delta is None else f"{delta:+.3f}%"])  # fmt: skip
    print()
    print(table(["KV dtype", "bytes/token", "tokens/GiB", "vs fp32", f"blocks in {a.pool_mib} MiB",
                 f"{a.conversation_tokens}-token convs", "perplexity", "vs fp32"], rows))  # fmt: skip
    goals = []
    if ref is not None:
        for name, limit in GOALS.items():
            d = results[name]["ppl_vs_fp32_pct"]
            goals.append(goal(f"{name} perplexity within {limit:.1%} of fp32", abs(d) <= 100 * limit, f"{d:+.3f}%"))
    if a.out:
        write_json(a.out, {**header, "args": vars(a), "results": results, "goals": goals})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
