"""A/B of the speed levers on one process: dtype (fp32, bf16) x attention backend (torch, cpu) x fused ops.

Every variant gets its own engine over the same model weights and the same
``--batch`` prompts of ``--prompt-len`` random tokens. First each variant's
prefill of the whole batch is timed (one step of up to
``--max-num-batched-tokens``); then the variants take turns, ``--steps``
decode steps each per round for ``--rounds`` rounds (A/B/C/D/A/B/...), so load
from other processes hits all of them alike. Reported per variant: prefill
tok/s and the median decode step (ms) with its decode tok/s. Contexts grow in
lockstep, so every variant decodes the same context lengths.

``--fused on,off`` builds each dtype twice, with the fused C++ layer ops
(residual add + RMSNorm, SiLU-and-mul, RoPE) and with the torch ops. Right
after each prefill the script times the same prefill's matmuls alone (every
projection of one layer on the whole batch, times the layer count, plus the
LM head on one row per sequence) on the same packed weights: the GEMM
ceiling of that prefill on this machine at this moment. Then
``--prefill-rounds`` rounds time, variant after variant, the model's forward
alone over the whole batch as one fresh prefill (fresh KV tensors, one
attention-metadata build) and its matmuls alone again; the best round is
reported (the least disturbed by other processes).

``--int8-matmuls`` only times torch's weight-only int8 matmul
(``aten._weight_int8pack_mm``, per-output-channel scales, bf16 activations:
what gpt-fast and torchao run) against the oneDNN-packed bf16 matmul the
engine runs, on SmolLM2's projection shapes and its LM head, for a few row
counts (#13 item 5: measured before building ``--quantization int8``).

With ``--threads 1`` every time is the thread's CPU time
(``time.thread_time``): time-slicing by other processes on a loaded machine is
not counted (their cache and memory-bandwidth pressure still is). With more
threads it is wall time.

    .venv/bin/python -m load_tests.bench_levers --threads 1 --batch 32
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--backends", default="torch,cpu")
    p.add_argument("--fused", default="on", help="comma list of on/off: fused C++ layer ops or torch ops")
    p.add_argument("--prefill-rounds", type=int, default=2)
    p.add_argument("--int8-matmuls", action="store_true", help="only the int8 vs bf16 matmul A/B (item 5)")
    p.add_argument("--int8-rows", default="1,2,4,8,32")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    if args.int8_matmuls:
        print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f} at start")
        int8_matmuls([int(r) for r in args.int8_rows.split(",")], clock)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        return 0

    import transformers

    from streamkv.llm import LLM
    from streamkv.model.loader import from_hf, load_hf_checkpoint
    from streamkv.sampling_params import SamplingParams

    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f} at start")
    transformers.utils.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):
        ckpt = load_hf_checkpoint(None, torch.float32)
    gen = torch.Generator().manual_seed(0)
    vocab = ckpt.model.config.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    max_tokens = 2 + args.rounds * args.steps + 4
    engines: dict[str, LLM] = {}
    prefill: dict[str, float] = {}
    ceiling: dict[str, float] = {}
    variants = [(d, f) for d in args.dtypes.split(",") for f in args.fused.split(",")]
    for dtype, fused in variants:
        loaded = from_hf(ckpt, getattr(torch, dtype), torch.device("cpu"), fused=fused == "on")
        for backend in args.backends.split(","):
            name = f"{dtype}/{backend}" + ("" if args.fused == "on" else f"/fused {fused}")
            llm = LLM(
                loaded=loaded, device="cpu", attention_backend=backend, max_num_seqs=args.batch,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                num_blocks=args.batch * (-(-(args.prompt_len + max_tokens) // 16)) + 8,
            )  # fmt: skip
            core = llm.core
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            core.add_request(f"{name}-warm", prompts[0][:32], warm, lambda out: None)
            while core.has_work():
                core.step()
            started: set[str] = set()

            def sink(out: object, started: set[str] = started) -> None:
                if any(d.token_ids for d in out.deltas):  # type: ignore[attr-defined]
                    started.add(out.request_id)  # type: ignore[attr-defined]

            for i, prompt in enumerate(prompts):
                core.add_request(f"{name}-{i}", prompt, params, sink)
            t0 = clock()
            while len(started) < len(prompts):  # prefill done: every request has its first token
                core.step()
            prefill[name] = args.batch * args.prompt_len / (clock() - t0)
            ceiling[name] = gemm_ceiling(loaded.model, min(args.batch * args.prompt_len, args.max_num_batched_tokens),
                                         args.batch, clock)  # fmt: skip
            engines[name] = llm
    del ckpt
    steps: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            for _ in range(args.steps):
                t0 = clock()
                llm.core.step()
                steps[name].append(clock() - t0)
    fwd: dict[str, list[float]] = {n: [] for n in engines}
    fwd_ceiling: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.prefill_rounds):
        for name, llm in engines.items():
            fwd[name].append(forward_prefill(llm, prompts, clock))
            rows = args.batch * args.prompt_len
            fwd_ceiling[name].append(gemm_ceiling(llm.core.runner.model, rows, args.batch, clock))
    print(f"batch {args.batch}, prompts {args.prompt_len} tokens, decode contexts {args.prompt_len + 1}-"
          f"{args.prompt_len + args.rounds * args.steps + 1}")  # fmt: skip
    print("| variant | prefill tok/s | its matmuls alone, tok/s | share | decode step median ms | best ms "
          "| decode tok/s (median) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in engines:
        med, best = statistics.median(steps[name]) * 1e3, min(steps[name]) * 1e3
        print(f"| {name} | {prefill[name]:.0f} | {ceiling[name]:.0f} | {prefill[name] / ceiling[name]:.0%} | {med:.1f} "
              f"| {best:.1f} | {args.batch / med * 1e3:.0f} |")  # fmt: skip
    if args.prefill_rounds:
        print(
            f"\nforward-only prefill of the whole batch ({args.batch * args.prompt_len} tokens in one step), "
            f"best of {args.prefill_rounds} interleaved rounds, {'CPU' if args.threads == 1 else 'wall'} time"
        )
        print("| variant | prefill tok/s | its matmuls alone, tok/s | share |")
        print("|---|---|---|---|")
        for name in engines:
            best_fwd, best_ceiling = max(fwd[name]), max(fwd_ceiling[name])
            print(f"| {name} | {best_fwd:.0f} | {best_ceiling:.0f} | {best_fwd / best_ceiling:.0%} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


# SmolLM2-135M: (out, in) of qkv, o, gate_up, down; the LM head (tied embedding).
SMOLLM2_PROJECTIONS = ((960, 576), (576, 576), (3072, 576), (576, 1536))
SMOLLM2_LM_HEAD = (49152, 576)


@torch.inference_mode()
def int8_matmuls(rows_list: list[int], clock: Callable[[], float], rounds: int = 5, reps: int = 20) -> None:
    """Print ms of one layer's projections and of the LM head: int8 weight-only vs oneDNN-packed bf16, best round."""
    gen = torch.Generator().manual_seed(0)

    def weights(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = torch.randn(shape, generator=gen) * 0.02
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 32)
        return q, scale.to(torch.bfloat16), packed

    layer = [weights(s) for s in SMOLLM2_PROJECTIONS]
    head = [weights(SMOLLM2_LM_HEAD)]
    print("| rows | layer int8 ms | layer bf16 ms | int8 / bf16 | LM head int8 ms | LM head bf16 ms | int8 / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for rows in rows_list:
        cells = []
        for mats in (layer, head):
            xs = [torch.randn(rows, q.shape[1], generator=gen).to(torch.bfloat16) for q, _, _ in mats]
            best = {"int8": float("inf"), "bf16": float("inf")}
            n = reps if mats is layer else max(1, reps // 4)
            for _ in range(rounds):
                t0 = clock()
                for _ in range(n):
                    for x, (q, scale, _) in zip(xs, mats, strict=True):
                        torch.ops.aten._weight_int8pack_mm(x, q, scale)
                best["int8"] = min(best["int8"], (clock() - t0) / n)
                t0 = clock()
                for _ in range(n):
                    for x, (_, _, packed) in zip(xs, mats, strict=True):
                        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                best["bf16"] = min(best["bf16"], (clock() - t0) / n)
            cells += [f"{best['int8'] * 1e3:.3f}", f"{best['bf16'] * 1e3:.3f}", f"{best['int8'] / best['bf16']:.2f}"]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


@torch.inference_mode()
def forward_prefill(llm: Any, prompts: list[list[int]], clock: Callable[[], float]) -> float:
    """tok/s of the model's forward over every prompt as one fresh prefill (LM head on the last rows)."""
    from streamkv.attention.metadata import AttentionMetadata

    runner = llm.core.runner
    model, block_size = runner.model, runner.block_size
    lens = [len(p) for p in prompts]
    tables, next_block = [], 0
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    kv = [torch.zeros((2, next_block, block_size, model.num_kv_heads, model.head_dim), dtype=c.dtype)
          for c in runner.kv_caches]  # fmt: skip
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    last = torch.tensor(lens).cumsum(0) - 1
    t0 = clock()
    meta = AttentionMetadata.build(lens, lens, tables, block_size)
    model.compute_logits(model(ids, positions, kv, meta, runner.backend)[last], widen=False)
    return sum(lens) / (clock() - t0)


@torch.inference_mode()
def gemm_ceiling(model: torch.nn.Module, rows: int, num_seqs: int, clock: Callable[[], float]) -> float:
    """tok/s of a ``rows``-token prefill that ran only its matmuls: each projection of layer 0 on ``rows`` rows
    (timed once after a warm-up call), times the layer count, plus the LM head on ``num_seqs`` rows."""
    from streamkv.model.llama import Linear

    layer = model.model.layers[0]  # type: ignore[union-attr, index]
    dtype = model.model.norm.weight.dtype  # type: ignore[union-attr]
    lins = [m for m in layer.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(rows, m.in_features, dtype=dtype) for m in lins]
    head_in = torch.randn(num_seqs, model.config.hidden_size, dtype=dtype)  # type: ignore[union-attr]
    for m, x in zip(lins, inputs, strict=True):
        m(x)
    t0 = clock()
    for m, x in zip(lins, inputs, strict=True):
        m(x)
    per_layer = clock() - t0
    t0 = clock()
    model.compute_logits(head_in, widen=False)  # type: ignore[operator]
    head = clock() - t0
    return rows / (per_layer * model.num_layers + head)  # type: ignore[operator]


if __name__ == "__main__":
    raise SystemExit(main())
