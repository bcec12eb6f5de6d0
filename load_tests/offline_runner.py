"""One engine's offline run, in whatever venv that engine lives in: a spec file in, a result file out.

``bench_peers`` writes the spec (engine, dtype, threads, repeats and the
workloads as token ids), then runs this script with the engine's own python
(the vLLM venv, the OpenVINO venv, or streamkv's). Only the standard library
is imported here; each engine's module (``runner_hf``, ``runner_streamkv``,
``runner_vllm``, ``runner_openvino``) imports its own library. Engines print
what they like (vLLM prints a lot); the figures go to ``--out`` only.

Timing is the same for every engine: each timed run records, from the moment
all requests are submitted, one ``(seconds, new tokens)`` event per step of
the engine and each request's time to its first token. From those:

- output tok/s = output tokens / wall (prefill included);
- decode tok/s = tokens that arrive after the last request got its first
  token, over the time from then to the end (every sequence is decoding);
- TTFT = submission to first token, per request.

With ``--reply-fd N`` the runner is one of several engines that
``bench_peers --interleave`` keeps loaded at once and takes turns between
(see ``load_tests/interleave.py``): after the load and the warm-up it writes
one JSON line to file descriptor ``N`` (``load_s``, ``versions``, ``config``;
or ``unsupported`` / ``error``), then reads workload names from stdin, one a
line, and answers each with one timed run's record (or an ``error``) as a
JSON line on ``N``, until stdin closes.

    .venv/bin/python load_tests/offline_runner.py --spec spec.json --out result.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENGINE_MODULES = {"transformers": "runner_hf", "streamkv": "runner_streamkv", "vllm": "runner_vllm",
                  "openvino": "runner_openvino"}  # fmt: skip


@dataclass(slots=True)
class Workload:
    """Requests of one offline run: prompt token ids and exact output lengths (``ignore_eos``)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


class EventLog:
    """Arrival times of tokens during one timed run; :meth:`start` marks the submission of all requests."""

    def __init__(self, num_requests: int) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[float, int]] = []
        self.first: list[float | None] = [None] * num_requests

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def tokens(self, request: int, n: int, now: float | None = None) -> None:
        """``n`` new tokens of request index ``request`` arrived (``now``: a perf_counter reading)."""
        if n <= 0:
            return
        t = (time.perf_counter() if now is None else now) - self.t0
        self.events.append((t, n))
        if self.first[request] is None:
            self.first[request] = t

    def record(self, workload: Workload) -> RunRecord:
        """Summarize the run.

        Raises:
            RuntimeError: a request got no token, or the token count is not the requested one.
        """
        got = sum(n for _, n in self.events)
        if got != workload.num_output_tokens or any(f is None for f in self.first):
            missing = sum(f is None for f in self.first)
            raise RuntimeError(f"{workload.name}: {got} tokens for {workload.num_output_tokens} requested, "
                               f"{missing} requests without a token")  # fmt: skip
        ttft = [float(f) for f in self.first if f is not None]
        wall = max(t for t, _ in self.events)
        t_dec = max(ttft)
        decode_tokens = sum(n for t, n in self.events if t > t_dec)
        return RunRecord(wall, got, ttft, decode_tokens, wall - t_dec)


@dataclass(slots=True)
class RunRecord:
    """One timed run. Seconds from submission; ``decode_*`` cover the span where every request decodes."""

    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    decode_tokens: int
    decode_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None


@dataclass(slots=True)
class WorkloadResult:
    """Every timed run of one workload and the output ids of its request 0 (greedy agreement)."""

    name: str
    runs: list[RunRecord] = field(default_factory=list)
    prompt0_output_ids: list[int] = field(default_factory=list)


def load_spec(path: Path) -> tuple[dict[str, Any], list[Workload]]:
    spec = json.loads(path.read_text())
    workloads = [Workload(w["name"], w["prompts"], w["output_lens"]) for w in spec["workloads"]]
    return spec, workloads


def warm_up(engine: Any, spec: dict[str, Any]) -> None:
    """One untimed run of the spec's ``warmup`` workload, if it has one."""
    if spec.get("warmup") is not None:
        w = spec["warmup"]
        warm = Workload("warmup", w["prompts"], w["output_lens"])
        engine.generate(warm, EventLog(len(warm.prompts)))


def run_all(engine: Any, spec: dict[str, Any], workloads: list[Workload]) -> list[WorkloadResult]:
    """Warm up once, then ``repeats`` timed runs of every workload, in order.

    ``engine.generate(workload, log)`` must submit everything, call
    ``log.start()`` right before the first submission, feed ``log.tokens``
    and return the output ids of every request.
    """
    warm_up(engine, spec)
    results = []
    for wl in workloads:
        res = WorkloadResult(wl.name)
        for _ in range(int(spec.get("repeats", 1))):
            log = EventLog(len(wl.prompts))
            outputs = engine.generate(wl, log)
            res.runs.append(log.record(wl))
            res.prompt0_output_ids = list(outputs[0])
        print(f"[{spec['engine']} {spec.get('variant', '')}] {wl.name}: "
              + ", ".join(f"{r.output_tok_s:.1f}" for r in res.runs) + " output tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
        results.append(res)
    return results


def serve_commands(engine: Any, spec: dict[str, Any], workloads: list[Workload], reply: Any) -> None:
    """The interleaved mode's loop: one timed run per workload name read from stdin, answered on ``reply``.

    Each answer is ``{"workload", "run", "prompt0_output_ids"}``, or
    ``{"workload", "error", "traceback"}`` after which the loop ends.
    """
    by_name = {w.name: w for w in workloads}
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        try:
            wl = by_name[name]
            log = EventLog(len(wl.prompts))
            outputs = engine.generate(wl, log)
            answer: dict[str, Any] = {"workload": name, "run": asdict(log.record(wl)),
                                      "prompt0_output_ids": list(outputs[0])}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - reported to the parent, which stops asking this engine
            answer = {"workload": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
        if "error" in answer:
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, default=None, help="the result file (the whole-spec mode)")
    p.add_argument("--reply-fd", type=int, default=None, help="interleaved mode: answer on this file descriptor")
    args = p.parse_args(argv)
    if (args.out is None) == (args.reply_fd is None):
        p.error("give exactly one of --out and --reply-fd")
    spec, workloads = load_spec(args.spec)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out: dict[str, Any] = {"engine": spec["engine"], "variant": spec.get("variant"), "python": sys.executable}
    # The engine modules import this file as ``offline_runner``, not ``__main__``: catch their class.
    unsupported = importlib.import_module("offline_runner").Unsupported
    try:
        module = importlib.import_module(ENGINE_MODULES[spec["engine"]])
        t0 = time.perf_counter()
        engine = module.Engine(spec)
        out["load_s"] = time.perf_counter() - t0
        out["versions"] = engine.versions()
        out["config"] = engine.config()
        if args.reply_fd is None:
            out["workloads"] = [asdict(r) for r in run_all(engine, spec, workloads)]
        else:
            warm_up(engine, spec)
    except unsupported as e:
        out["unsupported"] = str(e)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which prints it
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    if args.reply_fd is None:
        args.out.write_text(json.dumps(out))
        return 1 if "error" in out else 0
    os.set_inheritable(args.reply_fd, False)  # not into the engine's own children (vLLM's engine core)
    with os.fdopen(args.reply_fd, "w") as reply:
        reply.write(json.dumps(out) + "\n")
        reply.flush()
        if "error" in out or "unsupported" in out:
            return 1 if "error" in out else 0
        serve_commands(engine, spec, workloads, reply)
    return 0


class Unsupported(Exception):
    """The engine here lacks what the variant asks for (e.g. streamkv without ``--quantization``)."""


if __name__ == "__main__":
    raise SystemExit(main())
