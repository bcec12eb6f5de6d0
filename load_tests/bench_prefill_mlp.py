"""Prefill steps of a bf16 model with gate_up and SiLU-and-mul fused, and without (one process).

``batch`` prompts of ``--prompt`` random tokens are admitted at once and the
first engine step is timed (it prefills up to ``--budget`` tokens of them:
``max_num_batched_tokens``); the rest of the run is stepped off untimed. The
two routings take turns each round in the same engine, the fused one
(``small_linear_silu_mul``: act straight out of the kernel's passes, on AMX
tiles or ``vdpbf16ps``, the gate_up rows interleaved;
``streamkv/model/swiglu.py``) and the unfused one (gate_up on the same
kernel, then ``silu_and_mul``), so machine load hits both alike; the median
and best of each are printed.

    .venv/bin/python -m load_tests.bench_prefill_mlp                                 # budgets 512, 2048, 4096
    .venv/bin/python -m load_tests.bench_prefill_mlp --budgets 512 --rounds 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from load_tests.common import print_header  # noqa: E402


def first_step_ms(core: object, batch: int, prompt: int, tag: str, rng: random.Random) -> float:
    """Admit ``batch`` random prompts, time the first step, step the rest off; milliseconds."""
    from streamkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(100, 40000) for _ in range(prompt)]
        core.add_request(f"{tag}-{i}", ids, params, lambda out: None)  # type: ignore[attr-defined]
    start = time.perf_counter()
    core.step()  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    while core.has_work():  # type: ignore[attr-defined]
        core.step()  # type: ignore[attr-defined]
    return elapsed * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the default GGUF)")
    p.add_argument("--budgets", default="512,2048,4096", help="comma-separated token budgets (one engine each)")
    p.add_argument("--batch", type=int, default=32, help="prompts admitted at once")
    p.add_argument("--prompt", type=int, default=128, help="tokens per prompt")
    p.add_argument("--rounds", type=int, default=10, help="turns of each routing per budget")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print_header("prefill steps: gate_up + SiLU-and-mul fused against unfused", "load_tests.bench_prefill_mlp")
    from streamkv.llm import LLM
    from streamkv.model.llama import MLP

    print("| budget | fused median ms | fused best ms | unfused median ms | unfused best ms | median ratio |")
    print("|---|---|---|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",")):
        llm = LLM(
            args.model, dtype="bfloat16", device="cpu", kv_cache_memory=1 << 30, max_num_seqs=max(args.batch, 1),
            max_num_batched_tokens=budget, max_model_len=args.prompt + 8, enable_prefix_caching=False, seed=0,
        )  # fmt: skip
        mlps = [m for m in llm.core.runner.model.modules() if isinstance(m, MLP)]
        fused = [m.silu_mul for m in mlps]
        rows = min(budget, args.batch * args.prompt)  # the first step's
        if not all(f is not None and f.takes(rows) for f in fused):
            why = "needs a bf16 model on AVX512-BF16; > 128 rows without AMX"
            print(f"| {budget} | - | - | - | - | no fused gate_up here ({why}) |")
            continue
        rng = random.Random(0)
        times: dict[str, list[float]] = {"fused": [], "unfused": []}
        for r in range(args.rounds):
            for kind in ("fused", "unfused"):
                for m, f in zip(mlps, fused, strict=True):
                    m.silu_mul = f if kind == "fused" else None
                times[kind].append(first_step_ms(llm.core, args.batch, args.prompt, f"{kind}{r}", rng))
        for m, f in zip(mlps, fused, strict=True):
            m.silu_mul = f
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"| {budget} | {med['fused']:.1f} | {min(times['fused']):.1f} | {med['unfused']:.1f} | "
            f"{min(times['unfused']):.1f} | {med['fused'] / med['unfused']:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
