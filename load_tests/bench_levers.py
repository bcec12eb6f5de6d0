"""A/B of the speed levers on one process: dtype (fp32, bf16) x attention backend (torch, cpu).

Every variant gets its own engine over the same model weights and the same
``--batch`` prompts of ``--prompt-len`` random tokens. First each variant's
prefill of the whole batch is timed (one step of up to
``--max-num-batched-tokens``); then the variants take turns, ``--steps``
decode steps each per round for ``--rounds`` rounds (A/B/C/D/A/B/...), so load
from other processes hits all of them alike. Reported per variant: prefill
tok/s and the median decode step (ms) with its decode tok/s. Contexts grow in
lockstep, so every variant decodes the same context lengths.

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
from pathlib import Path

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
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

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
    for dtype in args.dtypes.split(","):
        loaded = from_hf(ckpt, getattr(torch, dtype), torch.device("cpu"))
        for backend in args.backends.split(","):
            name = f"{dtype}/{backend}"
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
            t0 = time.perf_counter()
            while len(started) < len(prompts):  # prefill done: every request has its first token
                core.step()
            prefill[name] = args.batch * args.prompt_len / (time.perf_counter() - t0)
            engines[name] = llm
    del ckpt
    steps: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                llm.core.step()
                steps[name].append(time.perf_counter() - t0)
    print(f"batch {args.batch}, prompts {args.prompt_len} tokens, decode contexts {args.prompt_len + 1}-"
          f"{args.prompt_len + args.rounds * args.steps + 1}")  # fmt: skip
    print("| variant | prefill tok/s | decode step median ms | best ms | decode tok/s (median) |")
    print("|---|---|---|---|---|")
    for name in engines:
        med, best = statistics.median(steps[name]) * 1e3, min(steps[name]) * 1e3
        print(f"| {name} | {prefill[name]:.0f} | {med:.1f} | {best:.1f} | {args.batch / med * 1e3:.0f} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
