"""Engines taking turns: every engine loaded at once, one timed run each, round after round.

``bench_peers --interleave`` runs its engines this way. Run one after
another, each engine gets its own stretch of the host's time, and on the
2-core machines here the host's speed drifts by more than the goals' margins
within minutes (docs/benchmarks.md, round 25: one engine's figures moved by
45-60% between two runs 25 minutes apart while the peers moved by 20%).
Taking turns puts every engine's k-th run of a workload within a minute or
two of the others', so the ratio of one round is taken on nearly the same
machine:

- every engine's ``offline_runner --reply-fd`` loads and warms up first,
  one after another, and then waits;
- for each repeat and each workload, every engine runs once; the order
  rotates by one place from repeat to repeat (and starts one place further
  for each workload), so no engine is always first after a pause;
- ``--settle`` seconds pass between two runs, so the last engine's OpenMP
  threads stop spinning before the next one starts;
- the waiting engines' CPU time during each run is read from ``/proc`` and
  printed, so an engine that burns the cores while it waits shows.

The results have the same shape as the sequential mode's, so the table and
the goals read them unchanged; :func:`paired_ratios` adds the per-round
ratios.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def rotated(items: Sequence[str], k: int) -> list[str]:
    """``items`` rotated left by ``k`` places (modulo their number): the order of one round."""
    k = k % len(items) if items else 0
    return [*items[k:], *items[:k]]


def turn_order(engines: Sequence[str], workloads: Sequence[str], repeats: int) -> list[tuple[int, str, list[str]]]:
    """``(repeat, workload, engines in running order)`` for every round.

    The order rotates by one place from one repeat to the next, and starts
    one place further for each workload; with as many repeats as engines,
    each engine runs in each place once per workload. (Who follows whom
    within a round does not change.)
    """
    out = []
    for r in range(repeats):
        for w, name in enumerate(workloads):
            out.append((r, name, rotated(engines, r + w)))  # over one workload's repeats, every rotation
    return out


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in process group ``pgid`` (``/proc/<pid>/stat``)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # field 5 of stat, the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLK_TCK


@dataclass
class Runner:
    """One engine's ``offline_runner --reply-fd`` process: commands on its stdin, answers on a pipe."""

    name: str
    proc: subprocess.Popen[str]
    replies: int  # the read end of the answer pipe
    log_path: Path
    result: dict[str, Any] = field(default_factory=dict)
    buffer: bytes = b""
    stopped: bool = False

    @classmethod
    def start(cls, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> Runner:
        read, write = os.pipe()
        with open(log_path, "w") as log:
            # Its own process group, as in the sequential mode: a kill takes vLLM's engine core too.
            proc = subprocess.Popen([*cmd, "--reply-fd", str(write)], stdin=subprocess.PIPE, stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, **env}, text=True,
                                    pass_fds=(write,), start_new_session=True)  # fmt: skip
        os.close(write)
        return cls(name, proc, read, log_path)

    def answer(self, timeout: float) -> dict[str, Any]:
        """The next JSON line on the answer pipe.

        Raises:
            RuntimeError: the process exited, closed the pipe, or gave no answer within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no answer within {timeout:.0f} s")
            ready, _, _ = select.select([self.replies], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.replies, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"closed its answer pipe (exit code {self.proc.poll()})")
                self.buffer += chunk
            elif self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode}")
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def ask(self, workload: str, timeout: float) -> dict[str, Any]:
        """One timed run of ``workload``.

        Raises:
            RuntimeError: as :meth:`answer`, or the runner's stdin is closed (it died).
        """
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(workload + "\n")
            self.proc.stdin.flush()
        except OSError as e:  # BrokenPipeError: the runner is gone (killed for memory, say)
            raise RuntimeError(f"cannot send it a run ({e}; exit code {self.proc.poll()})") from e
        return self.answer(timeout)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Close stdin (the runner's loop ends), then kill the group if it has not gone in 60 s."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self.stopped:
            return
        self.stopped = True
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # vLLM's engine core may outlive the runner
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # unkillable: leave it, but stop the others all the same
            pass
        os.close(self.replies)


def fail(runner: Runner, error: Exception | str) -> None:
    """Record the error and stop the runner, so it does not compute through the other engines' turns."""
    runner.result["error"] = f"{runner.name}: {error}\n{runner.log_tail()}"
    print(f"  ERROR {runner.result['error']}", flush=True)
    runner.stop()


def run_interleaved(
    starts: dict[str, tuple[list[str], dict[str, str]]],
    workloads: list[dict[str, Any]],
    repeats: int,
    run_dir: Path,
    timeout: float,
    settle: float = 1.0,
) -> dict[str, dict[str, Any]]:
    """Load every engine, then run ``turn_order`` rounds; return each engine's result (the sequential shape).

    ``starts`` maps a variant's name to its runner command (``[python,
    offline_runner.py, --spec, <file>]``) and extra environment. Each result
    has ``load_s``, ``versions``, ``config``, ``workloads`` (runs in repeat
    order), ``wall_s`` (its load), ``waiting_cpu_s`` (the most CPU seconds the
    waiting engines used during any of its runs), or ``error`` /
    ``unsupported``.
    """
    runners: dict[str, Runner] = {}
    try:
        for name, (cmd, env) in starts.items():
            log_path = run_dir / f"{name}.log"
            print(f"--- {name}: loading ({' '.join(cmd)}, log {log_path})", flush=True)
            t0 = time.perf_counter()
            runner = Runner.start(name, cmd, env, log_path)
            runners[name] = runner
            try:
                runner.result = runner.answer(timeout)
            except RuntimeError as e:
                fail(runner, e)
            runner.result["wall_s"] = time.perf_counter() - t0
            runner.result["env"] = env
            state = next((k for k in ("error", "unsupported") if k in runner.result), "ready")
            print(f"  {state} after {runner.result['wall_s']:.0f} s", flush=True)
            if state != "ready":
                print(f"  {runner.result[state]}\n{runner.result.get('traceback', '')}", flush=True)
        live = [n for n, r in runners.items() if "error" not in r.result and "unsupported" not in r.result]
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {w["name"]: [] for w in workloads} for n in live}
        last_ids: dict[str, dict[str, list[int]]] = {n: {} for n in live}
        waiting_cpu: dict[str, float] = dict.fromkeys(live, 0.0)
        for r, wname, order in turn_order(live, [w["name"] for w in workloads], repeats):
            line = []
            for name in order:
                runner = runners[name]
                if "error" in runner.result:
                    continue
                time.sleep(settle)
                others = [o for o in live if o != name]
                before = {o: group_cpu_seconds(runners[o].proc.pid) for o in others}
                try:
                    answer = runner.ask(wname, timeout)
                except RuntimeError as e:
                    fail(runner, e)
                    continue
                used = max((group_cpu_seconds(runners[o].proc.pid) - before[o] for o in others), default=0.0)
                waiting_cpu[name] = max(waiting_cpu[name], used)
                if "error" in answer:
                    fail(runner, f"{answer['error']}\n{answer.get('traceback', '')}")
                    continue
                runs[name][wname].append(answer["run"])
                last_ids[name][wname] = answer["prompt0_output_ids"]
                line.append(f"{name} {answer['run']['output_tokens'] / answer['run']['wall_s']:.1f}")
            print(f"[repeat {r + 1}] {wname}: " + ", ".join(line) + " output tok/s", flush=True)
        for name in live:
            res = runners[name].result
            res["waiting_cpu_s"] = waiting_cpu[name]
            if "error" not in res:
                ids = last_ids[name]
                res["workloads"] = [
                    {"name": w["name"], "runs": runs[name][w["name"]], "prompt0_output_ids": ids.get(w["name"], [])}
                    for w in workloads
                ]
    finally:
        for runner in runners.values():
            runner.stop()
    return {name: {"engine": name, "variant": name, "interleaved": True, **r.result} for name, r in runners.items()}


def paired_ratios(results: dict[str, dict[str, Any]], ours: str, peers: Sequence[str], workload: str) -> list[float]:
    """Per repeat, ``ours``' output tok/s over the best of ``peers`` in the same round.

    Peers without runs of ``workload`` (failed, or not run) are left out; empty when ``ours`` or every peer has none.
    A peer that failed mid-run counts only in the rounds it finished.
    """

    def rates(name: str) -> list[float]:
        res = results.get(name, {})
        w = next((w for w in res.get("workloads", []) if w["name"] == workload), None)
        return [r["output_tokens"] / r["wall_s"] for r in w["runs"]] if w else []

    mine = rates(ours)
    theirs = [t for t in (rates(p) for p in peers) if t]
    if not theirs:
        return []
    return [mine[i] / max(t[i] for t in theirs if i < len(t)) for i in range(min(len(mine), max(map(len, theirs))))]


def paired_summary(ratios: list[float]) -> str:
    """``"1.38/1.45/1.40, median 1.40x"``, or ``"-"``."""
    if not ratios:
        return "-"
    return "/".join(f"{x:.2f}" for x in ratios) + f", median {statistics.median(ratios):.2f}x"
